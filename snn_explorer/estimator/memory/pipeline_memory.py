"""Estimates of a pipeline plan (mode ``pp``) from the model's profile.

Per rank: the parameters, gradients and optimizer state of its own stages; the step's input (first
stage) and labels (last stage); torch's receive buffers (one per micro-batch and stage input /
output gradient). The rest of the peak comes from walking the rank's forwards and backwards in the
order torch's schedule runs them (:func:`rank_order`) over what one micro-batch of each stage
allocates, measured on the profile's model copy (:mod:`.stage_memory`: bytes its forward leaves
for backward and its output, its backward's peak with and without gradients allocated, its input
gradient, its neuron state), keeping what torch's schedule code still references (:func:`_walk`);
after the schedule, the merge of the last stage's outputs, dp's flat gradient copy and the
optimizer step's scratch. ``activations_bytes`` is the most bytes saved for backward at once over
that walk (a received input and the parameters left out, as measure() leaves them out). Traffic: per stage boundary, one activation send forward and
one gradient send backward per micro-batch (the boundary module's output at the micro-batch size),
the loss broadcast from the last stage, and with dp one all-reduce of each rank's stage gradients.

Under FSDP2 (modes ``pp_fsdp2``, ``pp_fsdp2_tp``) the parameters, gradients and optimizer state counted
statically are the rank's dp shards (per dp role, as for ``fsdp2``); each stage gathers its units' parameters at its
first forward and keeps them through every micro-batch (``reshard_after_forward=False``; torch's stage skips the
reshard and the gradient sync on all backwards but the last), so the walk holds them from there, beside the
unsharded gradients the backwards accumulate; after the schedule each FSDP2 group reduce-scatters once (its input
beside the rest), then the gathered parameters and unsharded gradients are freed and the sharded gradients stay.
Traffic over dp: one all-gather and one reduce-scatter per FSDP2 group (the plan's units in the stage, and the
stage module's own root group) per step, however many micro-batches.
:func:`bubble_fraction` is the schedule's idle share, for a step-time model to use.
"""
from __future__ import annotations

import dataclasses
from typing import Collection, Dict, List, NamedTuple, Sequence, Tuple

import pandas as pd

from ...core.common import Collective
from ...core.planning import PipelineSchedule, check_pp_model, schedule_of, stage_units
from ..instruments.tables import boundary_phase, gather_phase, reduce_phase
from .sharding import (
    buffer_bytes,
    ddp_reduce_bytes,
    dp_roles,
    fsdp_group_sizes,
    fsdp_groups,
    optimizer_temporaries,
    rank_bytes,
    reduce_itemsize,
)
from .stage_memory import measure_stages

PIPELINE_COLUMNS = ("pp_rank", "stages", "units", "microbatches_in_flight", "bubble_fraction")


def bubble_fraction(schedule: str, pp: int, micro: int, virtual: int = 1) -> float:
    """The share of a step each rank idles under ``schedule`` (a ``pp_schedule`` name), stages costing
    alike (see ``core.pipeline_schedules``)."""
    return schedule_of(schedule).bubble_fraction(pp, micro, virtual)


def in_flight(schedule: str, pp: int, pp_rank: int, micro: int, virtual: int = 1) -> int:
    """Stage forwards whose activations rank ``pp_rank`` holds at once under ``schedule`` (a
    ``pp_schedule`` name; see ``core.pipeline_schedules``)."""
    return schedule_of(schedule).in_flight(pp, pp_rank, micro, virtual)


def _walk(schedule: PipelineSchedule, order, runs, last_stage: int, micro: int) -> Tuple[int, int, int]:
    """(peak, bytes left at the end, most bytes saved for backward at once) that the schedule adds to a
    rank's static bytes, walking its actions in torch's order (``runs``: :class:`~.stage_memory.StageMemory`
    by stage).

    A forward adds its stage's ``kept`` bytes (and, the first time, the neuron state the stage then
    keeps); a backward frees them, peaking at its measured backward peak, and the stage's first one
    allocates its gradients; a zero-bubble input backward (``I``) peaks likewise but frees nothing,
    its weight backward (``W``) frees the micro-batch's bytes and allocates the gradients. What
    torch's schedule still references after a backward stays: the last stage's outputs
    (``output_chunks``, merged after the schedule into one more copy); under GPipe and the
    multi-stage schedules every tensor sent, until the step ends (``fwd_sends_to_wait`` /
    ``bwd_sends_to_wait``, ``send_ops``: the gloo work objects hold their tensors); under 1F1B the
    first micro-batch's output until the cool-down (``send_work``) and each input gradient until
    the next backward has ended (``bwd_sends``).
    """
    keeps_sends = schedule.keeps_sent_tensors
    cur = peak = act = most_act = sent = gin_before = first_out = 0
    started, with_grads = set(), set()
    backwards, warm = 0, next(i for i, action in enumerate(order) if action[0] in "BI")
    for kind, s, mb in order:
        r = runs[s]
        if kind == "F":
            cur += 0 if s in started else r.held
            started.add(s)
            peak = max(peak, cur + r.forward)
            cur, act = cur + r.kept, act + r.saved
            most_act = max(most_act, act)
            continue
        if kind == "W":
            peak = max(peak, cur + (0 if s in with_grads else r.grads))
            cur, act = cur - r.kept + (0 if s in with_grads else r.grads), act - r.saved
            with_grads.add(s)
            continue
        peak = max(peak, cur - r.kept + (r.backward_next if s in with_grads else r.backward_first))
        if kind == "B":
            cur, act = cur - r.kept + (0 if s in with_grads else r.grads), act - r.saved
            with_grads.add(s)
        backwards += 1
        cur += r.output if s == last_stage else 0
        if keeps_sends:
            held = (0 if s == last_stage else r.output) + r.grad_input
            cur, sent = cur + held, sent + held
            continue
        cur, gin_before = cur - gin_before + r.grad_input, r.grad_input
        if mb == 0 and warm > 1 and s != last_stage:
            cur, first_out = cur + r.output, r.output
        if backwards == micro - warm + 1:
            cur, first_out = cur - first_out, 0
    left = cur - sent - gin_before - first_out
    if last_stage in started:  # the merge of the last stage's outputs
        merged = micro * runs[last_stage].output
        peak, left = max(peak, left + merged), left + merged
    return peak, left, most_act


def under(name: str, units: Collection[str]) -> bool:
    """Whether ``name`` is one of ``units`` or inside one; a set of units is looked up by the dotted prefixes of
    ``name`` (a stage of a deep model holds thousands of units)."""
    if not isinstance(units, (set, frozenset)):
        return any(name == u or name.startswith(u + ".") for u in units)
    if name in units:
        return True
    cut = name.rfind(".")
    while cut > 0:
        if name[:cut] in units:
            return True
        cut = name.rfind(".", 0, cut)
    return False


def _stage_costs(profile, stages, n: int, t: int) -> List[Tuple[float, float]]:
    """(input elements, output elements) of each stage for ``n`` samples, ``t`` steps."""
    return [(profile.modules[units[0]].in_elems(n, t), profile.modules[units[-1]].out_elems(n, t)) for units in stages]


class StageShards(NamedTuple):
    """One pipeline stage's FSDP2 groups over dp (modes ``pp_fsdp2``, ``pp_fsdp2_tp``), per step."""

    gathered: int  # bytes its units gather, held from its first forward to the step's reduce
    largest_reduce: int  # the largest reduce-scatter input of its groups
    groups: int  # one all-gather and one reduce-scatter of each per step
    reduced: int  # bytes all its groups reduce-scatter


def _fsdp_stages(plan, mine, stages, own) -> Dict[int, StageShards]:
    """:class:`StageShards` of each of a pp rank's own stages (``mine``: the rank's parameters)."""
    out = {}
    for s in own:
        units = set(stages[s])
        groups = list(fsdp_groups([p for p in mine if under(p.name, units)]).values())  # '': the stage root
        sizes = [fsdp_group_sizes(g, plan.dp_size, reduce_itemsize(plan)) for g in groups]
        reduced = [scatter for _, _, _, scatter in sizes]
        out[s] = StageShards(gathered=sum(gather for _, gather, _, _ in sizes),
                             largest_reduce=max(reduced, default=0), groups=len(groups), reduced=sum(reduced))
    return out


def _fsdp_collectives(fsdp: Dict[int, StageShards], own) -> List[dict]:
    """The dp rows of a pp rank's FSDP2 stages (:func:`_fsdp_stages`) over one step."""
    count = sum(fsdp[s].groups for s in own)
    return [dict(mesh_dim="dp", kind=Collective.ALL_GATHER, count=count, bytes=sum(fsdp[s].gathered for s in own),
                 phase=gather_phase(own)),
            dict(mesh_dim="dp", kind=Collective.REDUCE_SCATTER, count=count, bytes=sum(fsdp[s].reduced for s in own),
                 phase=reduce_phase(own))]


def _after_schedule(plan, left: int, runs, own, fsdp, mine, dp_rank: int, optimizer: str, grads: int) -> int:
    """Bytes above the static ones after the schedule: dp's flat gradient copy (``pp``, ``pp_tp``) or FSDP2's
    reduce-scatter of each group (its input beside the unsharded gradients, which it then frees with the gathered
    parameters, leaving the sharded gradients ``grads``), then the optimizer step's scratch."""
    scratch = optimizer_temporaries(mine, plan, dp_rank * plan.tp_size, optimizer)
    if not plan.uses_fsdp:
        return left + max(grads if plan.dp_size > 1 else 0, scratch)
    reduce = max(fsdp[s].largest_reduce for s in own) if own else 0
    resharded = left - sum(fsdp[s].gathered + runs[s].grads for s in own) + grads
    return max(left + reduce, resharded + scratch)


def pipeline_rows(plan, profile, units: Sequence[str], params, t: int, itemsize: int, optimizer: str,
                  measure=measure_stages):
    """(per-rank rows, collective rows, pipeline table) of a pp plan (``measure``: how the stages are measured,
    :func:`~.stage_memory.measure_stages` or its GPU trace)."""
    counts = check_pp_model(plan, units)
    stages = stage_units(units, counts)
    micro, n_micro = plan.pp_microbatches, plan.per_rank_batch // plan.pp_microbatches
    schedule = plan.pp_schedule_spec
    costs = _stage_costs(profile, stages, n_micro, t)
    runs = measure(profile, stages, n_micro, t, micro, plan.tensor_parallel_plan, plan.tp_size)
    last, has_labels = plan.pp_stages - 1, profile.labels is not None
    rows: Dict[Tuple[int, int], dict] = {}
    table, collectives = [], []
    roles = dp_roles(params, plan)
    for pp_rank in range(plan.pp_size):
        own = schedule.rank_stages(pp_rank, plan.pp_size, plan.pp_virtual_stages)
        own_units = [u for s in own for u in stages[s]]
        lookup = set(own_units)
        mine = [p for p in params if under(p.name, lookup)]
        fsdp = _fsdp_stages(plan, mine, stages, own) if plan.uses_fsdp else {}
        walked = [dataclasses.replace(r, held=r.held + fsdp[s].gathered) if s in fsdp else r for s, r in enumerate(runs)]
        buffers = buffer_bytes([b for b in profile.buffers if under(b[0], lookup)], profile.dtype, plan)
        flying = schedule.in_flight(plan.pp_size, pp_rank, micro, plan.pp_virtual_stages)
        order = schedule.rank_actions(plan.pp_size, micro, plan.pp_virtual_stages)[pp_rank]
        schedule_peak, left, activations = _walk(schedule, order, walked, last, micro)
        state = sum(runs[s].held for s in own)
        recv = sum(micro * itemsize * ((costs[s][0] if s else 0) + (costs[s][1] if s < last else 0))
                   for s in own)
        inputs = profile.input_bytes(plan.per_rank_batch, t) if 0 in own else 0
        labels = plan.per_rank_batch * profile.labels.element_size() if last in own and has_labels else 0
        for dp_rank in roles:
            b = rank_bytes(mine, plan, dp_rank * plan.tp_size, optimizer)
            after = _after_schedule(plan, left, runs, own, fsdp, mine, dp_rank, optimizer, b["grads_bytes"])
            static = b["params_bytes"] + b["optimizer_bytes"] + buffers + recv + inputs + labels
            rows[pp_rank, dp_rank] = dict(**b, buffers_bytes=buffers, activations_bytes=round(activations),
                                          neuron_state_bytes=round(state), transient_bytes=round(recv + inputs),
                                          peak_bytes=round(static + max(schedule_peak, after)))
        table.append(dict(pp_rank=pp_rank, stages=",".join(map(str, own)), units=", ".join(own_units),
                          microbatches_in_flight=flying,
                          bubble_fraction=schedule.bubble_fraction(plan.pp_size, micro, plan.pp_virtual_stages)))
        if plan.uses_fsdp:
            collectives += _fsdp_collectives(fsdp, own) if plan.dp_size > 1 else []
        elif plan.dp_size > 1:
            collectives.append(dict(mesh_dim="dp", kind=Collective.ALL_REDUCE, count=1, phase=reduce_phase(own),
                                    bytes=ddp_reduce_bytes(mine, rows[pp_rank, roles[0]]["grads_bytes"], plan)))
    rank_of = lambda s: schedule.rank_of(s, plan.pp_size, plan.pp_virtual_stages)
    for s in (s for s in range(plan.pp_stages - 1) if rank_of(s) != rank_of(s + 1)):  # V: one boundary is local
        nbytes = round(costs[s][1] * itemsize)
        for phase in (boundary_phase("forward", s, s + 1), boundary_phase("backward", s + 1, s)):
            collectives.append(dict(mesh_dim="pp", kind=Collective.SEND, phase=phase, count=micro, bytes=micro * nbytes))
    # the loss is broadcast in its dtype promoted with fp32 (a bf16 / fp16 loss would lose digits)
    collectives.append(dict(mesh_dim="pp", kind=Collective.BROADCAST, phase="loss", count=1, bytes=max(itemsize, 4)))
    per_rank = [dict(rank=r, **rows[_row_of(r, plan, roles)]) for r in range(plan.world_size)]
    return per_rank, collectives, pd.DataFrame(table, columns=list(PIPELINE_COLUMNS))


def _row_of(rank: int, plan, roles: Sequence[int]) -> Tuple[int, int]:
    """(pp rank, dp role) of global ``rank`` (mesh order pp, dp, tp): the role is the last of ``roles`` (dp ranks
    holding the same shards from there on, :func:`~.sharding.dp_roles`) at or below its dp coordinate."""
    dp_rank = rank // plan.tp_size % plan.dp_size
    return rank // (plan.dp_size * plan.tp_size), max(r for r in roles if r <= dp_rank)
