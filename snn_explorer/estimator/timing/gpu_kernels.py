"""Step time on a GPU from the kernels of the step as the GPU runs it (:mod:`..memory.gpu_trace`).

Each kernel is timed by a roofline on the hardware profile's achieved rates, plus its launches:

- a cuDNN convolution at the TF32 tensor-core rate (:meth:`HardwareProfile.conv_flops`: torch sets
  ``torch.backends.cudnn.allow_tf32 = True`` by default), half precision at the half rate;
- any other operator with FLOPs (matmuls: cuBLAS) at the FP32 rate (torch's default
  ``torch.backends.cuda.matmul.allow_tf32 = False``), half precision at the half rate;
- a GEMM (a matmul, or a convolution as its implicit GEMM) at that rate times its quantisation
  (:func:`gemm_efficiency`, NVIDIA's "Matrix Multiplication Background User's Guide": the output is
  computed in tiles, one tile per SM at a time, so a partial last tile and a partial last wave of
  tiles over the SMs run at the cost of whole ones; the reduction dimension is padded to the tensor
  cores' 16-byte alignment (a 2-channel input to 4 TF32 channels); too few tiles to fill the SMs are
  split along the reduction, as cuBLAS's and cuDNN's split-K kernels do);
- under a mixed-precision plan the step is traced with autocast's casts (:mod:`..memory.meta_autocast`),
  so its convolutions and matmuls are 2-byte kernels at the half rate; a pipeline stage's trace has no
  autocast, so there they are timed in the 2-byte compute dtype (autocast's lower-precision list), at the
  half rate with half their operand bytes, elementwise kernels keeping the traced dtype;
- elementwise, reduction and copy kernels, and the fused neuron kernel (one pass over
  ``T * N * features``: input, spikes, fp32 ``h`` and the state), at the achieved memory bandwidth;

``seconds = max(flops / rate, bytes / bandwidth) + launches * op_overhead_s``. The optimizer's
kernels (``foreach``, as torch runs Adam on CUDA) are scaled to the parameter shard the rank
updates. Kernels of one stream run one after another, so a phase is the sum of its kernels;
collectives are timed and overlapped as on every profile (:func:`.step_time.exposed_comm_s`).
DDP (``gradient_as_bucket_view=False``, its default and the package's) copies every gradient twice
(torch's ``torch/csrc/distributed/c10d/reducer.cpp``): into its bucket as it becomes ready, divided by the
world size on the way (``at::mul_out(bucket_view, grad, 1 / div_factor)``, one launch per gradient), and
back into ``param.grad`` once its bucket is all-reduced (``grad.copy_(bucket_view)``): two memory-bound
kernels per gradient, counted in the backward (:func:`ddp_copy_kernels`).

A pipeline plan (:func:`gpu_pipeline_time`) times each stage's forward and backward of one
micro-batch from that stage's own traced kernels (:func:`~..memory.gpu_trace.gpu_stage_kernels`)
and composes them as on every profile: the schedule's actions replayed with the transfers between
stages, the dp all-reduce and the loss broadcast after them (:func:`.pipeline_time.pipeline_time_table`);
each rank's optimizer is the optimizer's kernels scaled to the parameters of its stages.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable

import pandas as pd

from ...core import SNNDistributedPlan
from ..memory.gpu_trace import GpuStep, Kernel, gpu_stage_kernels, optimizer_kernels
from .fsdp_overlap import fsdp_collective_s, fsdp_exposed_s
from .hardware import HardwareProfile
from .pipeline_time import pipeline_time_table
from .placement import ranks_on_host
from .step_time import time_table

#: Output tiles (M x N) the GEMM libraries choose between (the guide in the module doc lists these sizes).
TILES = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64))
#: The reduction length one split-K slice keeps at least (an assumption: the guide gives no figure).
SPLIT_K_MIN = 256


def gemm_efficiency(batch: int, m: int, n: int, k: int, sm_count: int, itemsize: int) -> float:
    """The share of the tensor cores' rate a GEMM of ``batch`` x (``m`` x ``k``) @ (``k`` x ``n``) keeps
    after tile, wave and alignment quantisation on ``sm_count`` SMs (module doc); the best tile wins."""
    align = max(1, 16 // itemsize)
    k_share = k / (math.ceil(k / align) * align)
    best = 0.0
    for tm, tn in TILES:
        rows, cols = math.ceil(m / tm), math.ceil(n / tn)
        tiles = batch * rows * cols
        tile_share = m * n / (rows * tm * cols * tn)
        if tiles < sm_count:  # split-K: the reduction shared out to fill the SMs
            tiles *= max(1, min(sm_count // tiles, k // SPLIT_K_MIN))
        waves = math.ceil(tiles / sm_count)
        best = max(best, tile_share * tiles / (waves * sm_count))
    return best * k_share


def kernel_seconds(kernel: Kernel, hw: HardwareProfile, scale: float = 1.0, half: bool = False) -> float:
    """Seconds of ``kernel`` on ``hw`` (module doc); ``scale`` multiplies its FLOPs and bytes, not its launches;
    ``half``: a mixed-precision plan's, whose convolutions and matmuls run in a 2-byte dtype."""
    rate = {"conv": hw.conv_flops, "matmul": hw.flops}.get(kernel.kind)
    itemsize, moved = kernel.itemsize, kernel.bytes
    if half and rate is not None and itemsize > 2:
        itemsize, moved = 2, moved * 2 / itemsize
    compute = 0.0
    if rate is not None and kernel.flops:
        compute = kernel.flops * scale / rate(itemsize)
        if kernel.gemms and hw.sm_count:
            gemm_flops = [2.0 * b * m * n * k for b, m, n, k in kernel.gemms]
            total = sum(gemm_flops) or 1.0
            compute *= sum(f / total / max(gemm_efficiency(b, m, n, k, hw.sm_count, itemsize), 1e-6)
                           for f, (b, m, n, k) in zip(gemm_flops, kernel.gemms))
    return max(compute, moved * scale / hw.bandwidth()) + kernel.launches * hw.op_overhead_s


def phase_seconds(kernels: Iterable[Kernel], hw: HardwareProfile, scale: float = 1.0,
                  half: bool = False) -> Dict[str, float]:
    """Seconds per phase of ``kernels`` run one after another on ``hw`` (``half``: :func:`kernel_seconds`)."""
    out: Dict[str, float] = {}
    for k in kernels:
        out[k.phase] = out.get(k.phase, 0.0) + kernel_seconds(k, hw, scale, half)
    return out


def ddp_copy_kernels(grad_bytes: Iterable[int]) -> tuple:
    """DDP's two copies of gradients of ``grad_bytes`` each (module doc): into the buckets and back, each reading
    and writing every gradient, one launch per gradient."""
    sizes = list(grad_bytes)
    return tuple(Kernel("backward", "memory", 0.0, 2 * sum(sizes), 4, len(sizes)) for _ in range(2))


def _optimizer_s(plan: SNNDistributedPlan, profile, hw: HardwareProfile, optimizer: str):
    """``seconds(params_bytes)``: the optimizer's kernels over the model one rank runs, their FLOPs and
    bytes scaled to ``params_bytes`` of its trainable parameters (launches as for the whole model)."""
    model = profile.rank_model(plan.tensor_parallel_plan, plan.tp_size)[1]
    whole = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    opt = optimizer_kernels(profile, plan.tensor_parallel_plan, plan.tp_size, optimizer)
    return lambda params_bytes: sum(phase_seconds(opt, hw, params_bytes / whole if whole else 1.0).values())


def gpu_pipeline_time(plan: SNNDistributedPlan, profile, collectives: pd.DataFrame, per_rank: pd.DataFrame,
                      hw: HardwareProfile, t: int, optimizer: str) -> pd.DataFrame:
    """The ``rank, compute_s, exposed_comm_s, bubble_s, step_s`` table of a pipeline plan (module doc)."""
    def stage_s(stages, n: int):
        traced = gpu_stage_kernels(profile, stages, n, t, plan.tensor_parallel_plan, plan.tp_size, plan.neuron_backend)
        half = plan.precision.mixed
        return [(sum(phase_seconds(s.forward, hw, half=half).values()),
                 sum(phase_seconds(s.backward, hw, half=half).values())) for s in traced]
    return pipeline_time_table(plan, profile, collectives, per_rank, hw, t, profile.compute_itemsize, {},
                               ranks_on_host(plan, hw), _optimizer_s(plan, profile, hw, optimizer), stage_s)


def gpu_plan_time(plan: SNNDistributedPlan, profile, collectives: pd.DataFrame, per_rank: pd.DataFrame,
                  hw: HardwareProfile, optimizer: str, step: GpuStep, timeline=None) -> pd.DataFrame:
    """The ``rank, compute_s, exposed_comm_s, bubble_s, step_s`` table of a plan without pipelining,
    its compute from the traced ``step`` of the model one rank runs and its optimizer's kernels; FSDP2's
    collectives (``timeline``: the plan's units) walked unit by unit against those kernels (:mod:`.fsdp_overlap`)."""
    half = False  # the traced step ran autocast's casts already (:mod:`..memory.meta_autocast`)
    phases = {"forward": 0.0, "backward": 0.0}
    phases.update(phase_seconds(step.kernels, hw, half=half))
    local = float(per_rank["params_bytes"].iloc[0]) / (plan.dp_size if plan.uses_zero else 1)
    phases["optimizer"] = _optimizer_s(plan, profile, hw, optimizer)(local)
    if plan.uses_ddp and plan.dp_size > 1:  # its gradient copies into the buckets and back (module doc)
        model = profile.rank_model(plan.tensor_parallel_plan, plan.tp_size)[1]
        grads = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
        phases["backward"] += sum(kernel_seconds(k, hw) for k in ddp_copy_kernels(grads))
    fsdp_s = None
    if timeline is not None and plan.dp_size > 1 and hw.overlaps_comm:
        copy_s = lambda nbytes: kernel_seconds(Kernel("fsdp", "memory", 0.0, nbytes, 4, 1), hw)  # noqa: E731
        fsdp_s = fsdp_exposed_s(step.log, [kernel_seconds(k, hw, half=half) for k in step.kernels], timeline.units,
                                timeline.reshard_after_forward, fsdp_collective_s(plan, hw), plan.dp_size, copy_s)
    return time_table(plan, collectives, hw, phases, fsdp_s)
