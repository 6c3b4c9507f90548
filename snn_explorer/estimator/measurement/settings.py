"""What every plan measure() runs shares: the checked arguments, and the timed steps on each rank."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ...core.common import positive_int
from ...core.model import TIME_MAJOR, DataLayout
from ...ranks.progress import heartbeat
from ..instruments.isolation import as_found, collected
from ..profile.step import check_inputs, check_optimizer, resolve_layout, run_dtypes


@dataclass(frozen=True)
class MeasureSettings:
    """What every measured plan shares: the work of one step and where it runs. ``example_input`` is
    kept time-major ``[T, N, ...]``; ``layout`` is the model's, in which each rank's batch is cut."""

    example_input: torch.Tensor
    labels: Optional[torch.Tensor]
    steps: int
    optimizer: str
    dtype: torch.dtype
    lr: float
    device: str  # "cpu" (gloo) or "cuda" (NCCL, one GPU per rank)
    cast: Optional[torch.dtype] = None  # the model's dtype for the run; None keeps a mixed-dtype model as it is
    layout: DataLayout = TIME_MAJOR
    layout_how: str = ""

    def plan_for(self, plan):
        """``plan`` carrying this run's data layout (``apply`` cuts micro-batches and runs per step by it)."""
        return plan if plan.data_layout == self.layout else dataclasses.replace(plan, data_layout=self.layout)


def measure_settings(model, plans, example_input, labels, steps, optimizer, dtype, lr, device,
                     layout=None) -> MeasureSettings:
    """The checked arguments shared by every measured plan; the data layout ``layout``, the plans'
    or detected (:func:`~..profile.step.resolve_layout`)."""
    optimizer = check_optimizer(optimizer)
    for p in plans:
        check_inputs(model, example_input, None, dtype, p)
    with as_found():  # detection runs the model once
        layout, how = resolve_layout(model, example_input, labels, plans, layout)
    for p in plans:
        check_inputs(model, example_input, labels, dtype, p, layout)
        if p.uses_pp and labels is None:
            raise ValueError(f"measure() of a pipeline plan ({p!r}) needs labels: its schedule computes a "
                             "cross-entropy loss per micro-batch on the last stage (runtime.train_step)")
    steps = positive_int("steps", steps, what="timed training steps before the measured one")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}; expected 'cpu' (gloo ranks) or 'cuda' (NCCL, one GPU per rank)")
    worlds = sorted({p.world_size for p in plans})
    if device == "cuda" and (not torch.cuda.is_available() or torch.cuda.device_count() < max(worlds, default=1)):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ValueError(f"device='cuda' needs one GPU per rank: {max(worlds)} ranks, {count} GPU(s) visible")
    cast, input_dtype = run_dtypes(model, dtype, example_input)
    return MeasureSettings(layout.to_time_major(example_input), labels, steps, optimizer, input_dtype, lr, device,
                           cast, layout, how)


def timed_steps(step, steps: int, mode: str) -> list:
    """Seconds of each of ``steps`` runs of ``step()`` on this rank, each started together with the
    other ranks (a barrier) and reported as a heartbeat, the garbage collector paused
    (:func:`~..instruments.isolation.collected`); the first (warm-up) dropped when there are more."""
    times = []
    with collected():
        for i in range(steps):
            dist.barrier()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
            heartbeat(step=i + 1, total=steps + 1, message=f"{mode}: timed step")
    return times[1:] if len(times) > 1 else times
