"""Step time on a GPU from the kernels of the step as the GPU runs it (:mod:`..memory.gpu_trace`).

Each kernel is timed by a roofline on the hardware profile, plus its launches:

- a cuDNN convolution at the TF32 tensor-core rate (:meth:`HardwareProfile.conv_flops`: torch sets
  ``torch.backends.cudnn.allow_tf32 = True`` by default), half precision at the half rate;
- any other operator with FLOPs (matmuls: cuBLAS) at the FP32 rate (torch's default
  ``torch.backends.cuda.matmul.allow_tf32 = False``), half precision at the half rate;
- elementwise, reduction and copy kernels, and the fused neuron kernel (one pass over
  ``T * N * features``: input, spikes, fp32 ``h`` and the state), at memory bandwidth;

``seconds = max(flops / rate, bytes / bandwidth) + launches * op_overhead_s``. The optimizer's
kernels (``foreach``, as torch runs Adam on CUDA) are scaled to the parameter shard the rank
updates. Kernels of one stream run one after another, so a phase is the sum of its kernels;
collectives are timed and overlapped as on every profile (:func:`.step_time.exposed_comm_s`).

A pipeline plan (:func:`gpu_pipeline_time`) times each stage's forward and backward of one
micro-batch from that stage's own traced kernels (:func:`~..memory.gpu_trace.gpu_stage_kernels`)
and composes them as on every profile: the schedule's actions replayed with the transfers between
stages, the dp all-reduce and the loss broadcast after them (:func:`.pipeline_time.pipeline_time_table`);
each rank's optimizer is the optimizer's kernels scaled to the parameters of its stages.
"""
from __future__ import annotations

from typing import Dict, Iterable

import pandas as pd

from ...core import SNNDistributedPlan
from ..memory.gpu_trace import GpuStep, Kernel, gpu_stage_kernels, optimizer_kernels
from .hardware import HardwareProfile
from .pipeline_time import pipeline_time_table
from .placement import ranks_on_host
from .step_time import time_table


def kernel_seconds(kernel: Kernel, hw: HardwareProfile, scale: float = 1.0) -> float:
    """Seconds of ``kernel`` on ``hw`` (module doc); ``scale`` multiplies its FLOPs and bytes, not its launches."""
    rate = {"conv": hw.conv_flops, "matmul": hw.flops}.get(kernel.kind)
    compute = kernel.flops * scale / rate(kernel.itemsize) if rate is not None and kernel.flops else 0.0
    return max(compute, kernel.bytes * scale / hw.bandwidth()) + kernel.launches * hw.op_overhead_s


def phase_seconds(kernels: Iterable[Kernel], hw: HardwareProfile, scale: float = 1.0) -> Dict[str, float]:
    """Seconds per phase of ``kernels`` run one after another on ``hw``."""
    out: Dict[str, float] = {}
    for k in kernels:
        out[k.phase] = out.get(k.phase, 0.0) + kernel_seconds(k, hw, scale)
    return out


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
        return [(sum(phase_seconds(s.forward, hw).values()), sum(phase_seconds(s.backward, hw).values()))
                for s in traced]
    return pipeline_time_table(plan, profile, collectives, per_rank, hw, t, profile.compute_itemsize, {},
                               ranks_on_host(plan, hw), _optimizer_s(plan, profile, hw, optimizer), stage_s)


def gpu_plan_time(plan: SNNDistributedPlan, profile, collectives: pd.DataFrame, per_rank: pd.DataFrame,
                  hw: HardwareProfile, optimizer: str, step: GpuStep) -> pd.DataFrame:
    """The ``rank, compute_s, exposed_comm_s, bubble_s, step_s`` table of a plan without pipelining,
    its compute from the traced ``step`` of the model one rank runs and its optimizer's kernels."""
    phases = {"forward": 0.0, "backward": 0.0}
    phases.update(phase_seconds(step.kernels, hw))
    local = float(per_rank["params_bytes"].iloc[0]) / (plan.dp_size if plan.uses_zero else 1)
    phases["optimizer"] = _optimizer_s(plan, profile, hw, optimizer)(local)
    return time_table(plan, collectives, hw, phases)
