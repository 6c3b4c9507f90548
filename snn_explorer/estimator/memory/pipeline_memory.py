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
:func:`bubble_fraction` is the schedule's idle share, for a step-time model to use.
"""
from __future__ import annotations

from typing import Collection, Dict, List, Sequence, Tuple

import pandas as pd

from ...core.collectives import Collective
from ...core.pipeline_plan import check_pp_model, stage_units
from ...core.pipeline_schedules import PipelineSchedule, schedule_of
from ..instruments.tables import boundary_phase, reduce_phase
from .sharding import buffer_bytes, optimizer_temporaries, rank_bytes
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


def pipeline_rows(plan, profile, units: Sequence[str], params, t: int, itemsize: int, optimizer: str):
    """(per-rank rows, collective rows, pipeline table) of a pp plan."""
    counts = check_pp_model(plan, units)
    stages = stage_units(units, counts)
    micro, n_micro = plan.pp_microbatches, plan.per_rank_batch // plan.pp_microbatches
    schedule = plan.pp_schedule_spec
    costs = _stage_costs(profile, stages, n_micro, t)
    runs = measure_stages(profile, stages, n_micro, t, micro, plan.tensor_parallel_plan, plan.tp_size)
    last, has_labels = plan.pp_stages - 1, profile.labels is not None
    rows: Dict[int, dict] = {}
    table, collectives = [], []
    for pp_rank in range(plan.pp_size):
        own = schedule.rank_stages(pp_rank, plan.pp_size, plan.pp_virtual_stages)
        own_units = [u for s in own for u in stages[s]]
        lookup = set(own_units)
        mine = [p for p in params if under(p.name, lookup)]
        b = rank_bytes(mine, plan, 0, optimizer)
        buffers = buffer_bytes([b for b in profile.buffers if under(b[0], lookup)], profile.dtype, plan)
        flying = schedule.in_flight(plan.pp_size, pp_rank, micro, plan.pp_virtual_stages)
        order = schedule.rank_actions(plan.pp_size, micro, plan.pp_virtual_stages)[pp_rank]
        schedule_peak, left, activations = _walk(schedule, order, runs, last, micro)
        state = sum(runs[s].held for s in own)
        recv = sum(micro * itemsize * ((costs[s][0] if s else 0) + (costs[s][1] if s < last else 0))
                   for s in own)
        inputs = profile.input_bytes(plan.per_rank_batch, t) if 0 in own else 0
        # after the schedule: dp's flat copy of the gradients, then the optimizer step's scratch
        after = left + max(b["grads_bytes"] if plan.dp_size > 1 else 0, optimizer_temporaries(mine, plan, 0, optimizer))
        labels = plan.per_rank_batch * profile.labels.element_size() if last in own and has_labels else 0
        static = b["params_bytes"] + b["optimizer_bytes"] + buffers + recv + inputs + labels
        peak = static + max(schedule_peak, after)
        rows[pp_rank] = dict(**b, buffers_bytes=buffers, activations_bytes=round(activations),
                             neuron_state_bytes=round(state), transient_bytes=round(recv + inputs),
                             peak_bytes=round(peak))
        table.append(dict(pp_rank=pp_rank, stages=",".join(map(str, own)), units=", ".join(own_units),
                          microbatches_in_flight=flying,
                          bubble_fraction=schedule.bubble_fraction(plan.pp_size, micro, plan.pp_virtual_stages)))
        if plan.dp_size > 1:
            collectives.append(dict(mesh_dim="dp", kind=Collective.ALL_REDUCE, count=1, bytes=b["grads_bytes"],
                                    phase=reduce_phase(own)))
    rank_of = lambda s: schedule.rank_of(s, plan.pp_size, plan.pp_virtual_stages)
    for s in (s for s in range(plan.pp_stages - 1) if rank_of(s) != rank_of(s + 1)):  # V: one boundary is local
        nbytes = round(costs[s][1] * itemsize)
        for phase in (boundary_phase("forward", s, s + 1), boundary_phase("backward", s + 1, s)):
            collectives.append(dict(mesh_dim="pp", kind=Collective.SEND, phase=phase, count=micro, bytes=micro * nbytes))
    # the loss is broadcast in its dtype promoted with fp32 (a bf16 / fp16 loss would lose digits)
    collectives.append(dict(mesh_dim="pp", kind=Collective.BROADCAST, phase="loss", count=1, bytes=max(itemsize, 4)))
    per_rank = [dict(rank=r, **rows[r // (plan.dp_size * plan.tp_size)]) for r in range(plan.world_size)]  # pp, dp, tp
    return per_rank, collectives, pd.DataFrame(table, columns=list(PIPELINE_COLUMNS))
