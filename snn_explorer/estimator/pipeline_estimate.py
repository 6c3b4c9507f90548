"""Estimates of a pipeline plan (mode ``pp``) from the model's profile.

Per rank: the parameters, gradients and optimizer state of its own stages; the activations of the
micro-batches its schedule holds at once (:func:`in_flight`), each from the profile's per-module
bytes saved for backward at the micro-batch size; one micro-batch's neuron state; the step's
input (first stage) with the contiguous copy of each micro-batch in flight, torch's receive buffers
(one per micro-batch and stage input / output gradient) and the last stage's outputs kept for the
merge. Traffic: per stage boundary between two ranks, one activation send forward and one gradient send
backward per micro-batch (the boundary module's output at the micro-batch size), the loss
broadcast from the last stage, and with dp one all-reduce of each rank's stage gradients.
:func:`bubble_fraction` is the schedule's idle share, for a step-time model to use.
"""
from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import pandas as pd

from ..core.pipeline_plan import check_pp_model, stage_units
from ..core.pipeline_schedules import schedule_of
from .sharding import buffer_bytes, optimizer_temporaries, rank_bytes

PIPELINE_COLUMNS = ("pp_rank", "stages", "units", "microbatches_in_flight", "bubble_fraction")


def bubble_fraction(schedule: str, pp: int, micro: int, virtual: int = 1) -> float:
    """The share of a step each rank idles under ``schedule`` (a ``pp_schedule`` name), stages costing
    alike (see ``core.pipeline_schedules``)."""
    return schedule_of(schedule).bubble_fraction(pp, micro, virtual)


def in_flight(schedule: str, pp: int, pp_rank: int, micro: int, virtual: int = 1) -> int:
    """Stage forwards whose activations rank ``pp_rank`` holds at once under ``schedule`` (a
    ``pp_schedule`` name; see ``core.pipeline_schedules``)."""
    return schedule_of(schedule).in_flight(pp, pp_rank, micro, virtual)


def _under(name: str, units: Sequence[str]) -> bool:
    return any(name == u or name.startswith(u + ".") for u in units)


def _stage_costs(profile, stages, n: int, t: int) -> List[Tuple[float, float, float, float]]:
    """(saved, state, input elements, output elements) of each stage for ``n`` samples, ``t`` steps."""
    out = []
    for units in stages:
        mods = [m for name, m in profile.modules.items() if name and _under(name, units)]
        saved = sum(m.saved(n, t) for m in mods)
        state = sum(m.state(n, t) for m in mods)
        out.append((saved, state, profile.modules[units[0]].in_elems(n, t), profile.modules[units[-1]].out_elems(n, t)))
    return out


def pipeline_rows(plan, profile, units: Sequence[str], params, t: int, itemsize: int, optimizer: str):
    """(per-rank rows, collective rows, pipeline table) of a pp plan."""
    counts = check_pp_model(plan, units)
    stages = stage_units(units, counts)
    micro, n_micro = plan.pp_microbatches, plan.per_rank_batch // plan.pp_microbatches
    costs = _stage_costs(profile, stages, n_micro, t)
    rows: Dict[int, dict] = {}
    table, collectives = [], []
    for pp_rank in range(plan.pp_size):
        own = plan.pp_schedule_spec.rank_stages(pp_rank, plan.pp_size, plan.pp_virtual_stages)
        own_units = [u for s in own for u in stages[s]]
        mine = [p for p in params if _under(p.name, own_units)]
        b = rank_bytes(mine, plan, 0, optimizer)
        buffers = buffer_bytes([b for b in profile.buffers if _under(b[0], own_units)], profile.dtype, plan)
        flying = in_flight(plan.pp_schedule, plan.pp_size, pp_rank, micro, plan.pp_virtual_stages)
        # the first stage's micro-batch (a strided slice of the batch) is copied contiguous and saved
        copy = costs[0][2] * itemsize if 0 in own and micro > 1 and t > 1 else 0
        activations = flying * max(costs[s][0] + (copy if s == 0 else 0) for s in own)
        state = max(costs[s][1] for s in own)
        recv = sum(micro * itemsize * ((costs[s][2] if s else 0) + (costs[s][3] if s < plan.pp_stages - 1 else 0))
                   for s in own)
        inputs = profile.input_bytes(plan.per_rank_batch, t) if 0 in own else 0
        # the last stage keeps each micro-batch's output to merge them after the schedule
        outputs = micro * costs[-1][3] * itemsize if plan.pp_stages - 1 in own else 0
        # the schedule (activations and state beside the gradients) or the optimizer step (its scratch)
        peak = sum(b.values()) + buffers + recv + inputs + outputs + max(activations + state,
                                                               optimizer_temporaries(mine, plan, 0, optimizer))
        rows[pp_rank] = dict(**b, buffers_bytes=buffers, activations_bytes=round(activations),
                             neuron_state_bytes=round(state), transient_bytes=round(recv + inputs),
                             peak_bytes=round(peak))
        table.append(dict(pp_rank=pp_rank, stages=",".join(map(str, own)), units=", ".join(own_units),
                          microbatches_in_flight=flying,
                          bubble_fraction=bubble_fraction(plan.pp_schedule, plan.pp_size, micro,
                                                          plan.pp_virtual_stages)))
        if plan.dp_size > 1:
            collectives.append(dict(mesh_dim="dp", kind="all_reduce", count=1, bytes=b["grads_bytes"],
                                    phase=f"after backward (stages {table[-1]['stages']})"))
    rank_of = lambda s: plan.pp_schedule_spec.rank_of(s, plan.pp_size, plan.pp_virtual_stages)
    for s in (s for s in range(plan.pp_stages - 1) if rank_of(s) != rank_of(s + 1)):  # V: one boundary is local
        nbytes = round(costs[s][3] * itemsize)
        for kind, phase in (("send", f"forward {s}->{s + 1}"), ("send", f"backward {s + 1}->{s}")):
            collectives.append(dict(mesh_dim="pp", kind=kind, phase=phase, count=micro, bytes=micro * nbytes))
    collectives.append(dict(mesh_dim="pp", kind="broadcast", phase="loss", count=1, bytes=itemsize))
    per_rank = [dict(rank=r, **rows[r // plan.dp_size]) for r in range(plan.world_size)]
    return per_rank, collectives, pd.DataFrame(table, columns=list(PIPELINE_COLUMNS))


def balanced_pp_plan(model, plan, example_input, labels=None):
    """``plan`` (mode ``pp``) with its ``pp_layout`` balanced by the model's profile (:func:`layout_by_profile`)."""
    import dataclasses

    from ..core.pipeline_plan import pipeline_units
    from .profile import model_profile

    if not plan.uses_pp:
        raise ValueError(f"balanced_pp_plan balances pipeline stages; {plan!r} has none")
    profile = model_profile(model, example_input, labels)
    layout = layout_by_profile(profile, plan, pipeline_units(model)[0], example_input.shape[0])
    return dataclasses.replace(plan, pp_layout=layout)


def layout_by_profile(profile, plan, units: Sequence[str], t: int) -> str:
    """A ``pp_layout`` balancing the stages by what the profile measured per unit: the bytes each unit
    saves for backward plus its parameters (memory), and its input and output elements (a proxy
    for its time, which the profile does not time), each as a share of the model's total."""
    from ..core.pipeline_plan import balanced_layout, layout_text

    n = max(1, plan.per_rank_batch // (plan.pp_microbatches or 1))
    memory, work = [], []
    for unit in units:
        mods = [m for name, m in profile.modules.items() if name and _under(name, [unit])]
        params = sum(math.prod(shape) for name, shape in profile.params if _under(name, [unit]))
        memory.append(sum(m.saved(n, t) for m in mods) + params)
        work.append(profile.modules[unit].in_elems(n, t) + profile.modules[unit].out_elems(n, t) + params)
    total_m, total_w = sum(memory) or 1.0, sum(work) or 1.0
    costs = [m / total_m + w / total_w for m, w in zip(memory, work)]
    return layout_text(balanced_layout(costs, plan.pp_stages))
