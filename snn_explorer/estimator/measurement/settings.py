"""What every plan measure() runs shares: the checked arguments, and the timed steps on each rank."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ...core.validate import positive_int
from ...ranks.progress import heartbeat
from ..instruments.isolation import collected
from ..profile.step import check_inputs, check_optimizer, run_dtypes


@dataclass(frozen=True)
class MeasureSettings:
    """What every measured plan shares: the work of one step and where it runs."""

    example_input: torch.Tensor
    labels: Optional[torch.Tensor]
    steps: int
    optimizer: str
    dtype: torch.dtype
    lr: float
    device: str  # "cpu" (gloo) or "cuda" (NCCL, one GPU per rank)
    cast: Optional[torch.dtype] = None  # the model's dtype for the run; None keeps a mixed-dtype model as it is


def measure_settings(model, plans, example_input, labels, steps, optimizer, dtype, lr, device) -> MeasureSettings:
    """The checked arguments shared by every measured plan."""
    optimizer = check_optimizer(optimizer)
    for p in plans:
        check_inputs(model, example_input, labels, dtype, p)
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
    return MeasureSettings(example_input, labels, steps, optimizer, input_dtype, lr, device, cast)


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
