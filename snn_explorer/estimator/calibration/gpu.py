"""calibrate(device="cuda"): this GPU's achieved rates, at a model's own shapes, as a profile file.

What it measures (a minute on one GPU; every figure is a median of timed repeats after a warm-up,
each kernel synchronised with ``torch.cuda.synchronize``):

- GEMMs and convolutions at the shapes the model runs (:func:`model_shapes` records them from one
  forward under a dispatch mode: ``mm`` / ``addmm`` / ``bmm`` / ``convolution``), in fp32 (torch's
  defaults: cuBLAS without TF32, cuDNN with TF32) and bf16; the rate is the model's mix, total FLOPs
  over total seconds;
- elementwise bandwidth at the model's activation sizes (``a + b``: two reads, one write), and a
  256 MiB add as the STREAM-like memory bandwidth;
- the launch cost of one kernel (a loop of one-element adds), and host-to-device copies from pinned memory;
- NCCL all-reduce, all-gather, reduce-scatter, broadcast and send/recv at sizes from 4 KiB to 64 MiB
  on every visible GPU (when there are two or more), fitted to latency + bytes / bandwidth.

The measurements are a plain dict (:func:`measure_device`, which runs on any torch device: the CPU
too, for tests) and :func:`profile_from_measurement` turns one into a :class:`HardwareProfile`
(``device="cuda"``, ``kernel_model=True``, ``source="calibration"``), saved as JSON that
``estimate(hardware=<file>)``, the Explorer and ``snn-explorer compare --hardware <file>`` load.
With one GPU no collective can be timed: they come from the built-in profile ``collectives_from``
(by default the one whose name the GPU's name holds), and the profile says so in ``topology``.
"""
from __future__ import annotations

import math
import platform
import socket
import statistics
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ... import ranks
from ...compat import TorchDispatchMode
from ...core.model import reset_all
from ..timing.hardware import HOST_ADAM_PARAMS_PER_S, KINDS, HardwareProfile, hardware_profile
from .fit import fit_alpha_beta
from .probes import collective_op

#: The most distinct GEMM / conv / elementwise shapes timed (the largest by work), repeats per shape.
MAX_SHAPES, REPEATS = 12, 7
STREAM_ELEMENTS = 2 ** 26  # 256 MiB of fp32
NCCL_SIZES = tuple(4 * 2 ** 10 * 4 ** i for i in range(8))  # 4 KiB .. 64 MiB
#: Built-in profiles whose collectives a one-GPU calibration borrows, by a word of the GPU's name.
_BUILTIN_BY_NAME = (("H200", "H200-SXM"), ("H100", "H100-SXM"), ("A100", "A100-SXM-80GB"), ("4090", "RTX-4090"))


class CudaRequiredError(RuntimeError):
    """calibrate(device="cuda") on a machine where torch sees no CUDA device."""


def require_cuda() -> None:
    """Raise :class:`CudaRequiredError` unless torch sees a CUDA device (checked before any work)."""
    if not torch.cuda.is_available():
        built = torch.version.cuda and f"built with CUDA {torch.version.cuda}" or "built without CUDA"
        raise CudaRequiredError(f"calibrate(device='cuda') needs CUDA: torch {torch.__version__} ({built}) sees no "
                                "CUDA device on this machine; run it where a GPU is visible, or calibrate() for this "
                                "machine's CPU")


class _ShapeRecorder(TorchDispatchMode):
    """Records the shapes of the GEMMs, convolutions and pointwise ops one forward dispatches."""

    def __init__(self):
        super().__init__()
        self.matmul: Dict[tuple, int] = {}
        self.conv: Dict[tuple, int] = {}
        self.elementwise: Dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "bmm", "baddbmm"):
            a, b = (args[0], args[1]) if name in ("mm", "bmm") else (args[1], args[2])
            key = (tuple(a.shape), tuple(b.shape))
            self.matmul[key] = self.matmul.get(key, 0) + 1
        elif name == "convolution":
            key = (tuple(args[0].shape), tuple(args[1].shape), tuple(args[3]), tuple(args[4]), tuple(args[5]),
                   int(args[8]))
            self.conv[key] = self.conv.get(key, 0) + 1
        elif torch.Tag.pointwise in func.tags and isinstance(out, torch.Tensor) and out.is_floating_point():
            self.elementwise[out.numel()] = self.elementwise.get(out.numel(), 0) + 1
        return out


def model_shapes(model: torch.nn.Module, example_input) -> dict:
    """``{"matmul": [[a shape, b shape, count]], "conv": [[input, weight, stride, padding, dilation,
    groups, count]], "elementwise": [[numel, count]]}`` of one forward of ``model`` on ``example_input``
    (under ``no_grad``, on the model's own device: build a large model on ``meta``); its neurons are
    reset afterwards."""
    recorder = _ShapeRecorder()
    try:
        with torch.no_grad(), recorder:
            model(example_input)
    finally:
        reset_all(model)  # the neurons' state of this forward is no state of the user's
    return {"matmul": [[list(a), list(b), n] for (a, b), n in recorder.matmul.items()],
            "conv": [[list(k[0]), list(k[1]), list(k[2]), list(k[3]), list(k[4]), k[5], n]
                     for k, n in recorder.conv.items()],
            "elementwise": [[numel, n] for numel, n in recorder.elementwise.items()]}


#: Shapes timed when no model is given: square GEMMs, a ResNet-style 3x3 conv, activation-sized adds.
DEFAULT_SHAPES = {"matmul": [[[n, n], [n, n], 1] for n in (1024, 4096)],
                  "conv": [[[16, 64, 56, 56], [64, 64, 3, 3], [1, 1], [1, 1], [1, 1], 1, 1]],
                  "elementwise": [[2 ** 20, 1], [2 ** 24, 1]]}


def _timer(device):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def seconds(fn, repeats: int = REPEATS) -> float:
        fn()
        sync()
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - start)
        return statistics.median(out)
    return seconds


def _largest(rows: list, work, limit: int = MAX_SHAPES) -> list:
    return sorted(rows, key=lambda r: -work(r) * r[-1])[:limit]


def _matmul_rows(shapes: dict, device, dtype, seconds) -> List[dict]:
    rows = []
    for a_shape, b_shape, count in _largest(shapes["matmul"], lambda r: math.prod(r[0]) * r[1][-1]):
        a = torch.randn(a_shape, device=device, dtype=dtype)
        b = torch.randn(b_shape, device=device, dtype=dtype)
        op = torch.bmm if len(a_shape) == 3 else torch.mm
        rows.append(dict(shape=[a_shape, b_shape], count=count, flops=2 * math.prod(a_shape) * b_shape[-1],
                         seconds=seconds(lambda: op(a, b))))
    return rows


def _conv_rows(shapes: dict, device, dtype, seconds) -> List[dict]:
    rows = []
    convs = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}
    for x_shape, w_shape, stride, padding, dilation, groups, count in _largest(
            shapes["conv"], lambda r: math.prod(r[0]) * math.prod(r[1][1:]) * r[1][0]):
        x = torch.randn(x_shape, device=device, dtype=dtype)
        w = torch.randn(w_shape, device=device, dtype=dtype)
        conv = convs[len(w_shape) - 2]
        out = conv(x, w, None, stride, padding, dilation, groups)
        rows.append(dict(shape=[x_shape, w_shape], count=count, flops=2 * out.numel() * math.prod(w_shape[1:]),
                         seconds=seconds(lambda: conv(x, w, None, stride, padding, dilation, groups))))
    return rows


def _add_rows(shapes: dict, device, dtype, seconds) -> List[dict]:
    rows = []
    for numel, count in _largest(shapes["elementwise"], lambda r: r[0]):
        a, b = torch.randn(numel, device=device, dtype=dtype), torch.randn(numel, device=device, dtype=dtype)
        rows.append(dict(numel=numel, count=count, bytes=3 * numel * a.element_size(),
                         seconds=seconds(lambda: a + b)))
    return rows


def measure_device(device="cuda", shapes: Optional[dict] = None, stream_elements: int = STREAM_ELEMENTS) -> dict:
    """Every compute figure of the module doc on ``device`` at ``shapes`` (:func:`model_shapes`;
    default :data:`DEFAULT_SHAPES`), as a plain dict :func:`profile_from_measurement` reads."""
    device = torch.device(device)
    shapes, seconds = shapes or DEFAULT_SHAPES, _timer(device)
    measured = dict(device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
                    or "cpu", torch=torch.__version__, cuda=torch.version.cuda, host=socket.gethostname(),
                    shapes=shapes, by_dtype={})
    for dtype in (torch.float32, torch.bfloat16):
        measured["by_dtype"][str(dtype).rpartition(".")[2]] = dict(
            matmul=_matmul_rows(shapes, device, dtype, seconds), conv=_conv_rows(shapes, device, dtype, seconds),
            elementwise=_add_rows(shapes, device, dtype, seconds))
    big = torch.randn(stream_elements, device=device)
    measured["stream_bytes_per_s"] = 3 * big.numel() * 4 / seconds(lambda: big + big)
    tiny, loop = torch.ones(1, device=device), 200
    measured["launch_s"] = seconds(lambda: [tiny + tiny for _ in range(loop)], 3) / loop
    if device.type == "cuda":
        host = torch.randn(stream_elements // 4).pin_memory()
        measured["host_link_bytes_per_s"] = host.numel() * 4 / seconds(lambda: host.to(device, non_blocking=True))
    return measured


def _rate(rows: List[dict], work: str) -> Optional[float]:
    """Total work over total seconds of ``rows``, each weighted by how often the model runs it."""
    total = sum(r[work] * r["count"] for r in rows)
    spent = sum(r["seconds"] * r["count"] for r in rows)
    return total / spent if rows and spent > 0 else None


def nccl_on_rank(sizes=NCCL_SIZES) -> dict:
    """On each NCCL rank: every collective kind at ``sizes`` bytes, back to back after a warm-up
    (median seconds per call); rank 0's ``{kind: [[bytes, seconds], ...]}``."""
    device = torch.device("cuda", torch.cuda.current_device())
    seconds, p = _timer(device), dist.get_world_size()
    out = {}
    for kind in KINDS:
        out[kind] = []
        for nbytes in sizes:
            op = collective_op(dist, kind, p, nbytes, device)
            dist.barrier()
            out[kind].append([nbytes, seconds(op)])
    return {"group_size": p, "timings": out}


def measure_collectives(timeout: float = 120.0) -> Optional[dict]:
    """NCCL collectives on every visible GPU (:func:`nccl_on_rank`); None with fewer than two GPUs."""
    count = torch.cuda.device_count()
    if count < 2:
        return None
    return ranks.run(nccl_on_rank, nprocs=count, backend="nccl", timeout=timeout).values[0]


def _borrowed(measured: dict, collectives_from: Optional[str]) -> HardwareProfile:
    if collectives_from is None:
        name = measured.get("device_name", "")
        collectives_from = next((b for word, b in _BUILTIN_BY_NAME if word in name), None)
        if collectives_from is None:
            raise ValueError(f"one GPU ({name!r}): no collective can be timed, and no built-in profile matches its "
                             f"name; give collectives_from= one of {[b for _, b in _BUILTIN_BY_NAME]}")
    return hardware_profile(collectives_from)


def profile_from_measurement(measured: dict, *, name: Optional[str] = None,
                             collectives_from: Optional[str] = None) -> HardwareProfile:
    """The :class:`HardwareProfile` of a :func:`measure_device` dict (with ``measured["nccl"]`` from
    :func:`measure_collectives`, or None): fp32 GEMM / conv / elementwise rates at the model's shapes,
    bf16 ones as ``half_flops_per_s`` and ``measured_half``, the launch cost per operator, collectives
    fitted per kind (or borrowed, module doc). Achieved rates: ``efficiency`` 1."""
    fp32, bf16 = measured["by_dtype"]["float32"], measured["by_dtype"].get("bfloat16")
    flops = _rate(fp32["matmul"], "flops") or _rate(fp32["conv"], "flops")
    bandwidth = _rate(fp32["elementwise"], "bytes") or measured["stream_bytes_per_s"]
    if flops is None:
        raise ValueError("the measurement holds no GEMM or convolution timing; measure shapes with a matmul or a conv")
    half = {}
    if bf16 and (_rate(bf16["matmul"], "flops") or _rate(bf16["conv"], "flops")):
        half["bf16"] = {"flops_per_s": _rate(bf16["matmul"], "flops") or _rate(bf16["conv"], "flops"),
                        "bytes_per_s": _rate(bf16["elementwise"], "bytes") or bandwidth}
    nccl = measured.get("nccl")
    if nccl:
        p = int(nccl["group_size"])
        table = {kind: {p: fit_alpha_beta([b for b, _ in rows], [s for _, s in rows])}
                 for kind, rows in nccl["timings"].items()}
        table = {k: {q: (max(a, 0.0), max(b, 1e-15)) for q, (a, b) in v.items()} for k, v in table.items()}
        topology = f"{p} GPUs in one node, NCCL collectives measured on all of them"
    else:
        borrowed = _borrowed(measured, collectives_from)
        table = borrowed.collectives
        topology = f"one GPU measured; collectives are the built-in {borrowed.name!r} profile's (not measured)"
    return HardwareProfile(
        name=name or f"{measured['device_name']} (calibrated)", device="cuda", flops_per_s=flops,
        bytes_per_s=bandwidth, op_overhead_s=measured["launch_s"], collectives=table,
        half_flops_per_s=half.get("bf16", {}).get("flops_per_s"),
        tensor_flops_per_s=_rate(fp32["conv"], "flops"), kernel_model=True, efficiency=1.0,
        source=f"calibration on {measured['device_name']} (torch {measured['torch']}, CUDA {measured['cuda']}); "
               f"STREAM-like add {measured['stream_bytes_per_s'] / 1e9:.0f} GB/s",
        host=measured.get("host"), measured_half=half, topology=topology,
        host_link_bytes_per_s=measured.get("host_link_bytes_per_s"), host_adam_params_per_s=HOST_ADAM_PARAMS_PER_S)


def calibrate_gpu(model: Optional[torch.nn.Module] = None, example_input=None, *, output=None,
                  name: Optional[str] = None, collectives_from: Optional[str] = None,
                  timeout: float = 120.0) -> HardwareProfile:
    """This GPU measured at ``model``'s shapes (its forward on ``example_input``; default
    :data:`DEFAULT_SHAPES`) into a profile, saved as JSON to ``output`` when given (module doc).
    Raises :class:`CudaRequiredError` first where torch sees no CUDA device."""
    require_cuda()
    if (model is None) != (example_input is None):
        raise ValueError("give both model= and example_input= (the shapes are those of one forward) or neither")
    shapes = model_shapes(model, example_input) if model is not None else None
    measured = measure_device("cuda", shapes)
    measured["nccl"] = measure_collectives(timeout)
    profile = profile_from_measurement(measured, name=name, collectives_from=collectives_from)
    if output is not None:
        profile.save(output)
    return profile
