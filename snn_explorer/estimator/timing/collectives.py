"""Collectives of one training step under a plan: kind, count and bytes per mesh dim and phase.

``bytes`` is the full buffer each collective works on (all-reduce / broadcast: the tensor,
all-gather: the output, reduce-scatter: the input), summed over its calls, on every rank.
"""
from __future__ import annotations

import functools
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ...compat import DDP_FIRST_BUCKET_BYTES, ddp_bucket_assignment
from ...core import SNNDistributedPlan
from ...core.common import Collective
from ...core.planning import check_pp_model, stage_units
from ...core.tp import STYLES
from ..instruments.tables import tp_phase
from ..memory.sharding import (
    Param,
    ddp_reduce_bytes,
    fsdp_group_sizes,
    fsdp_groups,
    reduce_itemsize,
)
from ..profile.profiling import ModelProfile

Row = Tuple[str, str, str]  # mesh_dim, kind, phase
def ddp_buckets(params: Sequence[Param], ready_order: Sequence[str]) -> List[int]:
    """Bytes of each DDP bucket after its first-iteration rebuild (gradients in ready order)."""
    by_name = {p.name: p for p in params}
    ready = set(ready_order)
    order = [n for n in ready_order if n in by_name] + [p.name for p in params if p.name not in ready]
    return list(_buckets(tuple((by_name[n].numel, by_name[n].itemsize) for n in order)))


@functools.lru_cache(maxsize=32)
def _buckets(sizes: Tuple[Tuple[int, int], ...]) -> Tuple[int, ...]:
    """torch's own bucket assignment (on meta tensors) for gradients of these (numel, itemsize)."""
    meta = [torch.empty(numel, dtype=_dtype(itemsize), device="meta") for numel, itemsize in sizes]
    buckets = ddp_bucket_assignment(meta, [DDP_FIRST_BUCKET_BYTES, 25 * 1024 * 1024])
    return tuple(sum(sizes[i][0] * sizes[i][1] for i in b) for b in buckets)


def _dtype(itemsize: int) -> torch.dtype:
    return {1: torch.uint8, 2: torch.float16, 4: torch.float32, 8: torch.float64}[itemsize]


def _fsdp(out, plan: SNNDistributedPlan, params, profile: ModelProfile, t: int, timeline=None) -> None:
    reshard, dp, reduce_size = plan.reshard_after_forward, plan.dp_size, reduce_itemsize(plan)
    # all-gathered in the unit's gather dtype (norm layers: their own), reduce-scattered in the reduce dtype
    if timeline is not None:  # the plan's FsdpTimeline of ``params`` has them already
        sizes = [(u.path, u.flat, u.scatter_bytes) for u in timeline.units]
    else:
        sizes = [(unit, *fsdp_group_sizes(group, dp, reduce_size)[1::2]) for unit, group in fsdp_groups(params).items()]
    for unit, nbytes, reduced in sizes:
        module = profile.modules.get(unit)
        calls = round(module.calls(1, t)) if module and unit else 1
        hooked = bool(module and unit and module.input_requires_grad)  # post-backward hook per call
        if unit and reshard:
            fwd, bwd = calls, calls if hooked else 1
        else:  # kept unsharded after forward (memopt 0, and always the root)
            fwd, bwd = 1, calls - 1 if hooked else 0
        _add(out, ("dp", Collective.ALL_GATHER, "forward"), fwd, fwd * nbytes)
        _add(out, ("dp", Collective.ALL_GATHER, "backward"), bwd, bwd * nbytes)
        _add(out, ("dp", Collective.REDUCE_SCATTER, "backward"), 1, reduced)


def _tp(out, plan: SNNDistributedPlan, profile: ModelProfile, n: int, t: int, itemsize: int,
        units: Optional[Sequence[str]] = None) -> None:
    """TP rows of every styled module (with ``units``: of those under these module paths only)."""
    for path, name in plan.tensor_parallel_plan.items():
        module = profile.modules.get(path)
        inside = units is None or any(path == u or path.startswith(u + ".") for u in units)
        if module is not None and inside:
            # backward rows reduce input gradients, in the dtype of the input (fp32 after an fp32-state neuron)
            rows = [r for r in STYLES[name].collectives(module, n, t, itemsize) if r[1] != "backward"]
            rows += [r for r in STYLES[name].collectives(module, n, t, module.in_itemsize or itemsize)
                     if r[1] == "backward"]
            for kind, phase, count, nbytes in rows:
                _add(out, ("tp", kind, phase), count, nbytes)


def _add(out, key: Row, count: int, nbytes: int) -> None:
    if count:
        out[key][0] += count
        out[key][1] += nbytes


def step_collectives(plan: SNNDistributedPlan, params: Sequence[Param], profile: ModelProfile,
                     time_steps: int, itemsize: int, timeline=None) -> List[dict]:
    """Rows ``mesh_dim, kind, phase, count, bytes`` of one step on each rank (all ranks alike); none
    on a mesh dim of one rank (a collective over a group of one moves nothing: a one-rank plan
    communicates nothing). ``timeline``: the plan's ``FsdpTimeline`` of ``params``, if made already (its
    units' bytes are FSDP2's collectives')."""
    out: Dict[Row, List[int]] = defaultdict(lambda: [0, 0])
    n = plan.per_rank_batch
    if plan.uses_ddp:
        buckets = ddp_buckets(params, profile.grad_ready_order)
        _add(out, ("dp", Collective.ALL_REDUCE, "backward"), len(buckets), ddp_reduce_bytes(params, sum(buckets), plan))
        if plan.uses_zero:
            _add(out, ("dp", Collective.BROADCAST, "optimizer"), len(params), sum(p.numel * p.itemsize for p in params))
    if plan.uses_tp:
        _tp(out, plan, profile, n, time_steps, itemsize)
    if plan.uses_fsdp:
        _fsdp(out, plan, params, profile, time_steps, timeline)
    return [dict(mesh_dim=d, kind=k, phase=p, count=c, bytes=b) for (d, k, p), (c, b) in out.items()
            if plan.dim_size(d) > 1]


def stage_tp_rows(plan: SNNDistributedPlan, profile: ModelProfile, units: Sequence[str], n: int, t: int,
                  itemsize: int) -> List[dict]:
    """Rows ``kind, phase, count, bytes`` (phase ``forward`` / ``backward``) of the tensor-parallel collectives
    one micro-batch of ``n`` samples issues inside a pipeline stage of ``units`` (mode ``pp_tp``)."""
    out: Dict[Row, List[int]] = defaultdict(lambda: [0, 0])
    _tp(out, plan, profile, n, t, itemsize, units)
    return [dict(kind=k, phase=p, count=c, bytes=b) for (_, k, p), (c, b) in out.items()]


def pipeline_tp_collectives(plan: SNNDistributedPlan, profile: ModelProfile, units: Sequence[str], t: int,
                            itemsize: int) -> List[dict]:
    """Rows ``mesh_dim, kind, phase, count, bytes`` of each pp rank's tensor-parallel collectives over a step
    of a 3-D plan: its stages' rows (:func:`stage_tp_rows`) for every micro-batch, the phase naming its stages
    (:func:`~..instruments.tables.tp_phase`); none without tp."""
    if plan.tp_size == 1:
        return []
    stages = stage_units(units, check_pp_model(plan, units))
    spec, micro = plan.pp_schedule_spec, plan.pp_microbatches
    out = []
    for pp_rank in range(plan.pp_size):
        own = spec.rank_stages(pp_rank, plan.pp_size, plan.pp_virtual_stages)
        acc: Dict[str, List[int]] = defaultdict(lambda: [0, 0])
        for s in own:
            for row in stage_tp_rows(plan, profile, stages[s], plan.per_rank_batch // micro, t, itemsize):
                acc[row["kind"]][0] += row["count"] * micro
                acc[row["kind"]][1] += row["bytes"] * micro
        out += [dict(mesh_dim="tp", kind=k, phase=tp_phase(own), count=c, bytes=b) for k, (c, b) in acc.items()]
    return out
