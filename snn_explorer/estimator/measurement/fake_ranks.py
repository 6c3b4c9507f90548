"""A plan's training step on one rank of a fake process group: its collectives and its peak memory.

This process plays rank ``rank`` of ``plan.world_size`` on torch's fake backend (every collective
returns at once and sends nothing) and runs steps of the plan's model as ``apply`` builds it, on a
copy whose tensors are FakeTensors (:mod:`..profile.shape_only`): FSDP2's all-gathers and
reduce-scatters and DTensor's redistributions are issued as on a real rank and counted by the
:class:`~..instruments.recorder.CollectiveRecorder`, and torch's ``MemTracker`` follows the storages
as ``measure()`` does on a real rank, while nothing of the model's or the activations' size is
allocated. So a model that this machine cannot hold (built on ``meta``) at a world size it cannot
spawn (512 ranks) gets the two figures ``measure()`` checks the estimate with, in seconds to minutes.

Not runnable here, and refused: DDP (dp, dp + ZeRO), whose C++ reducer allocates real gradient
buckets and needs its all-reduce's result, and pipelines, whose stages move real modules between
devices; ``measure()`` checks those on real gloo ranks.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn

from ... import compat_fake
from ...core import SNNDistributedPlan, apply
from ...core.common import check_instance
from ..instruments.recorder import CollectiveRecorder
from ..instruments.tables import COLLECTIVE_COLUMNS
from ..profile.shape_only import fake_copy, following, to_fake
from ..profile.step import OPTIMIZERS, batch_slice, check_optimizer, resolve_layout
from .plan_measurement import tracked_peak, training_step


def _check_recordable(plan: SNNDistributedPlan, rank: int) -> None:
    """Refuse what a fake process group cannot record (module doc), before anything is built."""
    check_instance("plan", plan, SNNDistributedPlan, "an SNNDistributedPlan")
    if plan.uses_ddp or plan.uses_pp:
        raise ValueError(f"record_rank_step: mode={plan.mode!r} cannot run on a fake process group (DDP's reducer "
                         "allocates real gradient buckets; a pipeline moves real stage modules); it runs fsdp2, tp "
                         "and fsdp2_tp plans; measure() records the others on real gloo ranks")
    if not isinstance(rank, int) or not 0 <= rank < plan.world_size:
        raise ValueError(f"rank={rank!r}; expected an int in [0, {plan.world_size}) for this plan's world size")
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("record_rank_step needs a process without a process group (it makes a fake one); "
                           f"this process is already rank {dist.get_rank()} of {dist.get_world_size()}")


@dataclass(frozen=True)
class FakeRankStep:
    """One training step of a plan on one rank of a fake process group (module doc)."""

    plan: SNNDistributedPlan
    rank: int
    #: the collectives issued, in :attr:`PlanEstimate.collectives`' columns ``mesh_dim, kind, phase, count, bytes``
    collectives: pd.DataFrame
    #: the step's peak memory on the rank as torch's ``MemTracker`` counts it, as ``measure()`` reads it
    peak_bytes: int


def record_rank_step(model: nn.Module, plan: SNNDistributedPlan, example_input: torch.Tensor,
                     labels: Optional[torch.Tensor] = None, *, rank: int = 0, optimizer: str = "adam",
                     layout=None) -> FakeRankStep:
    """A warm-up step and a recorded one of ``plan`` on rank ``rank`` of a fake process group (module
    doc): the collectives of the second and its tracked peak, as ``measure()`` records them on a real
    rank. ``example_input`` and ``layout`` are read as ``estimate`` reads them; ``model`` may be real or
    on ``meta`` and is not changed. A plan of one rank communicates nothing."""
    _check_recordable(plan, rank)
    check_optimizer(optimizer)
    layout, _ = resolve_layout(model, example_input, labels, [plan], layout)
    fake, mode = fake_copy(model)
    with compat_fake.fake_process_group(rank, plan.world_size) if plan.distributed else contextlib.nullcontext():
        runtime = apply(model=fake, plan=plan, device_type="cpu")  # the mesh is made outside the fake mode
        with following(fake, mode):
            x = layout.to_time_major(to_fake(example_input))
            n = plan.per_rank_batch
            x, y = batch_slice(x, to_fake(labels), n, x.shape[0], start=runtime.dp_rank * n, layout=layout)
            kind = OPTIMIZERS[optimizer]
            opt = runtime.build_optimizer(kind.cls, lr=1e-3, **kind.kwargs)
            recorder = CollectiveRecorder()
            step = training_step(runtime.model, opt, x, y, layout)
            peak = tracked_peak(runtime, opt, x, step, lambda: step(recorder), contextlib.nullcontext(), recorder,
                                cuda=False)
        rows = _rows(recorder, runtime.mesh, plan) if plan.distributed else []
    return FakeRankStep(plan, rank, pd.DataFrame(rows, columns=list(COLLECTIVE_COLUMNS)), peak)


def _rows(recorder: CollectiveRecorder, mesh, plan: SNNDistributedPlan) -> list:
    """The recorder's rows, less those over a mesh dim of one rank (they move nothing; not estimated)."""
    groups = {d: mesh.get_group(d) for d in plan.mesh_dim_names}
    alone = {d for d, g in groups.items() if dist.get_world_size(g) == 1}
    return [r for r in recorder.table(groups) if r["mesh_dim"] not in alone]
