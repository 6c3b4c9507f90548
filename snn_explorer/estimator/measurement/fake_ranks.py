"""The collectives of one training step of a plan, recorded on one rank of a fake process group.

This process plays rank ``rank`` of ``plan.world_size`` on torch's fake backend (every collective
returns at once and sends nothing) and runs one step of the plan's model as ``apply`` builds it,
on a copy whose tensors are FakeTensors (:mod:`..profile.shape_only`): FSDP2's all-gathers and
reduce-scatters and DTensor's redistributions are issued as on a real rank, and the
:class:`~..instruments.recorder.CollectiveRecorder` counts them, while nothing of the model's or the
activations' size is allocated. A model that this machine cannot hold (built on ``meta``) and a
world size it cannot spawn (512 ranks) are recorded in seconds to minutes.

Not recordable here, and refused: DDP (dp, dp + ZeRO), whose C++ reducer allocates real gradient
buckets and needs its all-reduce's result, and pipelines, whose stages move real modules between
devices; the estimate's rows for those are checked on real gloo ranks instead (``measure``).
"""
from __future__ import annotations

from typing import Optional

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn

from ... import compat
from ...core import SNNDistributedPlan, apply
from ...core.validate import check_instance
from ..instruments.recorder import CollectiveRecorder
from ..instruments.tables import COLLECTIVE_COLUMNS
from ..profile.shape_only import fake_copy, following, to_fake
from ..profile.step import OPTIMIZERS, batch_slice, check_optimizer, forward_loss, resolve_layout


def _check_recordable(plan: SNNDistributedPlan, rank: int) -> None:
    """Refuse what a fake process group cannot record (module doc), before anything is built."""
    check_instance("plan", plan, SNNDistributedPlan, "an SNNDistributedPlan")
    if plan.uses_ddp or plan.uses_pp:
        raise ValueError(f"record_collectives: mode={plan.mode!r} cannot run on a fake process group (DDP's reducer "
                         "allocates real gradient buckets; a pipeline moves real stage modules); it records fsdp2, tp "
                         "and fsdp2_tp plans; measure() records the others on real gloo ranks")
    if not isinstance(rank, int) or not 0 <= rank < plan.world_size:
        raise ValueError(f"rank={rank!r}; expected an int in [0, {plan.world_size}) for this plan's world size")
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("record_collectives needs a process without a process group (it makes a fake one); "
                           f"this process is already rank {dist.get_rank()} of {dist.get_world_size()}")


def record_collectives(model: nn.Module, plan: SNNDistributedPlan, example_input: torch.Tensor,
                       labels: Optional[torch.Tensor] = None, *, rank: int = 0, optimizer: str = "adam",
                       layout=None) -> pd.DataFrame:
    """One training step of ``plan`` on rank ``rank``, recorded on a fake process group (module doc):
    a table with :attr:`PlanEstimate.collectives`' columns (``mesh_dim, kind, phase, count, bytes``),
    so the two compare row for row. ``example_input`` and ``layout`` are read as ``estimate`` reads them;
    ``model`` may be real or on ``meta``; it is not changed. A plan of one rank communicates nothing."""
    _check_recordable(plan, rank)
    check_optimizer(optimizer)
    if not plan.distributed:
        return pd.DataFrame(columns=list(COLLECTIVE_COLUMNS))
    layout, _ = resolve_layout(model, example_input, labels, [plan], layout)
    fake, mode = fake_copy(model)
    with compat.fake_process_group(rank, plan.world_size):
        runtime = apply(model=fake, plan=plan, device_type="cpu")  # the mesh is made outside the fake mode
        recorder = CollectiveRecorder()
        with following(fake, mode):
            x = layout.to_time_major(to_fake(example_input))
            n = plan.per_rank_batch
            x, y = batch_slice(x, to_fake(labels), n, x.shape[0], start=runtime.dp_rank * n, layout=layout)
            kind = OPTIMIZERS[optimizer]
            opt = runtime.build_optimizer(kind.cls, lr=1e-3, **kind.kwargs)
            with recorder:
                loss = forward_loss(runtime.model, x, y, layout)
                recorder.phase = "backward"
                loss.backward()
                recorder.phase = "optimizer"
                opt.step()
        groups = {d: runtime.mesh.get_group(d) for d in plan.mesh_dim_names}
        alone = {d for d, g in groups.items() if dist.get_world_size(g) == 1}  # moves nothing; not estimated
        rows = [r for r in recorder.table(groups) if r["mesh_dim"] not in alone]
    return pd.DataFrame(rows, columns=list(COLLECTIVE_COLUMNS))
