"""The figures of the built-in GPU hardware profiles: datasheet peaks, achieved fractions, topology, each with its
source (:func:`.hardware.hardware_profiles` builds the profiles from them).

Every built-in is a ``cuda`` profile, so it predicts with the traced GPU kernel model
(:mod:`..memory.gpu_trace`, :mod:`.gpu_kernels`); ``efficiency`` is 1 on all of them (no blanket
factor). None of these figures comes from, or was tuned to, the reference tables that
``benchmarks/reference_gpu.py`` checks.

Datasheet peaks (dense, no sparsity): FP32, TF32 tensor (cuDNN convolutions: torch's default
``torch.backends.cudnn.allow_tf32 = True``) and BF16/FP16 tensor FLOP/s, memory bandwidth, SM count:
NVIDIA A100 datasheet and Ampere GA100 whitepaper (108 SMs), H100 / H200 datasheets and Hopper
whitepaper (132 SMs, SXM5), Ada Lovelace whitepaper appendix (RTX 4090: 128 SMs).

Achieved fractions (:attr:`~.hardware.HardwareProfile.achieved`):

- ``bandwidth``, a copy-like streaming kernel at full occupancy: A100-SXM4-80GB 1732 GB/s of 2039
  (``scale`` kernel, github.com/te42kyfo/gpu-benches ``cuda-stream/a100_80.txt``); H100 1704 GB/s of
  the H100 PCIe's 2000 (same benchmark, README, "NVIDIA-H100-PCIe / CUDA 11.7"), the fraction taken
  for the HBM3 / HBM3e parts (H100 SXM, H200) that no such table covers; RTX 4090 921.9 GB/s of 1008
  (github.com/xytpai/nvbench README, ``global_memory_bandwidth``, float4).
- ``matmul``, cuBLAS's maximum achievable matmul FLOP/s (BF16, best large shape) over the datasheet
  peak: A100 SXM 267.9 of 312, H100 SXM 792.1 of 989, H100/H200 SXM 794.5 of 989 (github.com/stas00/
  ml-engineering, ``compute/accelerator`` "Maximum Achievable Matmul FLOPS comparison table"); applied
  to TF32 and FP32 too (same tensor cores / the same kernel families, no per-precision table). RTX
  4090: at or above its datasheet (float32 matmul 82.8 TFLOP/s at n=2048, github.com/mli/
  transformers-benchmarks issue #4; cuBLASLt bf16 175.1, fp32 89.9 at 8192, a published gpu-bench
  run): 1.
- Kernel launch: 4.0 us per eager operator, the RTX 4090 measurement above (an n=128 matmul, 4.19
  MFLOP, ran at 1.048 TFLOP/s back to back: the launch is the whole call). The issue cost is the host
  CPU's and the driver's, so it is used for every GPU.

Collectives (alpha-beta per ring step and bus bandwidth, :func:`.hardware.link_table`):

- NVLink3, 8 x A100 SXM: all-reduce bus bandwidth about 200 GB/s at large sizes (github.com/NVIDIA/
  nccl-tests issue #149, 8 x A100-SXM4-80GB, NCCL 2.18; issue #178: 208 GB/s);
- NVLink4, 8 x H100 / H200 SXM: 480 GB/s all-reduce bus bandwidth with NVLink SHARP (GTC S62129, as
  quoted in github.com/NVIDIA/nccl issue #1374);
- InfiniBand between nodes, one NIC per GPU: 96 GB/s bus bandwidth of 100 theoretical on 4 HDR NICs
  per 8 A100 (nccl-tests issue #119): 0.96 of the NIC rate, so 24 GB/s per GPU on HDR (200 Gb/s)
  and 48 on NDR (400 Gb/s);
- latency: a 2-GPU NVLink all-reduce of 128 B takes about 6 us under CUDA graphs (github.com/NVIDIA/
  nccl issue #1259), i.e. 3 us for each of its 2 ring steps; eager adds the 4 us launch above once
  per collective, so 5 us per ring step in a node; between nodes 10 us (InfiniBand's 1-2 us wire
  latency plus the proxy thread; an assumption, no published figure at hand);
- RTX 4090 without peer-to-peer (``NCCL_P2P_DISABLE=1``, the reference benchmark's setting): 7.9 GB/s
  and 14 us between two GPUs through host memory (p2pBandwidthLatencyTest with peer access disabled
  on 8 x RTX 4090, github.com/NVIDIA/nccl-tests issue #117: 7.8-8.2 GB/s, 12-18 us); groups that run
  at once share that host path (:meth:`.hardware.HardwareProfile.collective_time`). With P2P the 4090
  is PCIe 4.0 x16 (31.5 GB/s each way), at the same achieved share of the wire as the staged copy
  path is not measured: the datasheet rate, stated as such.
- Host link (activation / FSDP2 offload): PCIe Gen5 64 GB/s each way (H100, H200), Gen4 32 (A100),
  31.5 (RTX 4090).
"""
from __future__ import annotations

_GB = 1e9
#: Per device: datasheet peaks, SMs, achieved fractions, the intra-node link's bus bandwidth and name,
#: the host link (module doc for every source).
DEVICES = {
    "A100-SXM-80GB": dict(flops_per_s=19.5e12, half_flops_per_s=312e12, tensor_flops_per_s=156e12,
                          bytes_per_s=2039 * _GB, sm_count=108, achieved=dict(bandwidth=1732 / 2039, matmul=267.9 / 312),
                          link=200 * _GB, link_name="NVLink3", host=32 * _GB),
    "H100-SXM": dict(flops_per_s=67e12, half_flops_per_s=989e12, tensor_flops_per_s=494.5e12, bytes_per_s=3350 * _GB,
                     sm_count=132, achieved=dict(bandwidth=1704 / 2000, matmul=792.1 / 989), link=480 * _GB,
                     link_name="NVLink4", host=64 * _GB),
    "H200-SXM": dict(flops_per_s=67e12, half_flops_per_s=989e12, tensor_flops_per_s=494.5e12, bytes_per_s=4800 * _GB,
                     sm_count=132, achieved=dict(bandwidth=1704 / 2000, matmul=794.5 / 989), link=480 * _GB,
                     link_name="NVLink4", host=64 * _GB),
    # torchtitan's Llama 3.1 benchmark card (Grand Teton hosts): an H100 SXM with 96 GB HBM2e at
    # 2.4 TB/s, NVLink within the host, 400 Gb/s RDMA per GPU, run at a 500 W power limit
    # (github.com/pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, "Hardware"); its
    # FLOP/s are the H100 SXM datasheet's, an upper bound (that card's true peak is unpublished).
    "H100-SXM-96GB": dict(flops_per_s=67e12, half_flops_per_s=989e12, tensor_flops_per_s=494.5e12,
                          bytes_per_s=2400 * _GB, sm_count=132, achieved=dict(bandwidth=1704 / 2000, matmul=792.1 / 989),
                          link=480 * _GB, link_name="NVLink4", host=64 * _GB),
    "RTX-4090": dict(flops_per_s=82.6e12, half_flops_per_s=165.2e12, tensor_flops_per_s=82.6e12, bytes_per_s=1008 * _GB,
                     sm_count=128, achieved=dict(bandwidth=921.85 / 1008), link=31.5 * _GB, link_name="PCIe4-x16",
                     host=31.5 * _GB),
}
#: Between nodes: the NIC per GPU and its achieved bus bandwidth (module doc).
IB = {"A100-SXM-80GB": ("IB-HDR", 24 * _GB), "H100-SXM": ("IB-NDR", 48 * _GB), "H200-SXM": ("IB-NDR", 48 * _GB),
       "H100-SXM-96GB": ("RDMA-400G", 48 * _GB)}
#: Node counts of the multi-node built-ins, per device (default 2 and 8 nodes of 8 GPUs).
NODES = {"H100-SXM-96GB": (2, 8, 64)}
#: One ring step's latency in a node and between nodes, and one eager operator's launch (module doc).
INTRA_LATENCY_S, INTER_LATENCY_S, GPU_OP_OVERHEAD_S = 5e-6, 10e-6, 4.0e-6
#: Host CPU Adam updates per second for one rank (one thread), the rate of FSDP2's offloaded optimizer step. A
#: documented measurement on an 8x H100 node's host: an fp32 AdamW step over 512 CPU tensors of 1 Mi elements
#: (536.9 M parameters) took 1.93 s on one thread, 1.81 s on two (github.com/ISEEKYAN/Megatron-LM issue 188,
#: 2026-08-25: 536.9e6 / 1.93 s = 2.78e8 per s). That source timed Megatron-LM lite's FP32AdamW (a per-parameter
#: Python loop), not torch.optim.Adam; in the same table 8 ranks sharing 2 CPUs ran ~10x slower (17.2 s), so the figure
#: assumes one free CPU core per rank. Assumed for every built-in's host (no datasheet gives it);
#: ``this_host_adam_rate()`` (:mod:`..calibration.host_adam`) measures a host's own.
HOST_ADAM_PARAMS_PER_S = 536.9e6 / 1.93
#: The efficiency every built-in states: 1, their rates are achieved rates already (kept for profile files).
DEFAULT_EFFICIENCY = 1.0
#: RTX 4090 boxes as the reference project benchmarks them (PCIe, ``NCCL_P2P_DISABLE=1``; module doc).
RTX4090_NO_P2P_LINK_S, RTX4090_NO_P2P_LINK_BPS, RTX4090_OP_S = 14e-6, 7.9e9, GPU_OP_OVERHEAD_S
