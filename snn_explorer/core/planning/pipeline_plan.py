"""Pipeline-parallel plan facts: the model's cuttable sequence, stage layouts, schedules, checks.

A stage is a run of consecutive *pipeline units* (``core.model.units``). Which pp rank
holds which of the ``pp * V`` stages, and every other fact of a schedule, is the schedule object's
(``core.pipeline_schedules``).
"""
from __future__ import annotations

import numbers
from typing import Any, Optional, Sequence, Tuple

from ..common.modes import names_text
from ..model.units import TIME_LOOP_HINT
from ..tp.styles import SHARDED, STYLES

# ---- layouts ------------------------------------------------------------------------------------

def layout_text(counts: Sequence[int]) -> str:
    """Unit counts per stage as the plan stores them: ``"3|4"``."""
    return "|".join(str(int(c)) for c in counts)


def layout_counts(layout: str) -> Tuple[int, ...]:
    """``"3|4"`` -> ``(3, 4)``; a ValueError names a malformed layout."""
    try:
        counts = tuple(int(part) for part in layout.split("|"))
    except ValueError:
        counts = ()
    if not counts or any(c < 1 for c in counts):
        raise ValueError(f"pp_layout={layout!r} must be unit counts per stage, each >= 1, joined by '|' "
                         "(e.g. '3|4'), or module paths where stages 2.. begin")
    return counts


def even_layout(units: int, stages: int) -> Tuple[int, ...]:
    """``units`` split into ``stages`` consecutive runs whose sizes differ by at most one."""
    return tuple(units // stages + (1 if s < units % stages else 0) for s in range(stages))


def balanced_layout(costs: Sequence[float], stages: int, eligible: Optional[Sequence[bool]] = None,
                    cuts: Optional[Sequence[bool]] = None) -> Tuple[int, ...]:
    """Consecutive runs of ``costs`` (one per unit) in ``stages`` stages minimising the largest stage's
    total cost (exact, by dynamic programming over cut points); ties keep stages even in count. With
    ``eligible`` (one flag per unit) every stage holds an eligible unit; with ``cuts`` (one flag per unit)
    a stage may end only after a flagged unit (:func:`whole_cuts`); ValueError when none can."""
    n = len(costs)
    cut_ok = [True] * n if cuts is None else [bool(c) for c in cuts]
    if stages > n:
        raise ValueError(f"{n} pipeline unit(s) cannot fill {stages} stages")
    prefix, marks = [0.0], [0]
    for c, ok in zip(costs, eligible if eligible is not None else [True] * n):
        prefix.append(prefix[-1] + float(c))
        marks.append(marks[-1] + bool(ok))
    inf = float("inf")
    # best[s][i]: (least largest stage cost of the first i units in s stages, its last cut j)
    best = [[(inf, 0)] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0)
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            options = [(max(best[s - 1][j][0], prefix[i] - prefix[j]), abs(i - j - n / stages), j)
                       for j in range(s - 1, i) if best[s - 1][j][0] < inf and marks[i] > marks[j]
                       and (i == n or cut_ok[i - 1])]
            if options:
                cost, _, cut = min(options)
                best[s][i] = (cost, cut)
    if best[stages][n][0] == inf:
        where = "" if cuts is None else (f" and end after a unit whose output tensor parallelism leaves whole "
                                         f"({sum(cut_ok)} of them): use fewer pp stages or a smaller tp")
        raise ValueError(f"{n} pipeline unit(s), {marks[-1]} of them eligible, cannot be cut into {stages} stages "
                         f"that each hold an eligible one{where}")
    counts, i = [], n
    for s in range(stages, 0, -1):
        cut = best[s][i][1]
        counts.append(i - cut)
        i = cut
    return tuple(reversed(counts))


def resolve_layout(layout: Any, units: Sequence[str], stages: int) -> Tuple[int, ...]:
    """``layout`` (``"3|4"``, counts, or the module paths where stages 2.. begin) as unit counts
    checked against the model's ``units`` and ``stages``; None: :func:`even_layout`."""
    if layout is None or layout == "":
        return even_layout(len(units), stages)
    if isinstance(layout, str) and not layout.replace("|", "").isdigit():
        layout = [p for p in layout.replace("|", ",").split(",") if p]
    if isinstance(layout, str):
        counts = layout_counts(layout)
    elif all(isinstance(c, numbers.Integral) and not isinstance(c, bool) for c in layout):
        counts = layout_counts(layout_text(layout))
    else:
        starts = [units.index(p) if p in units else None for p in layout]
        if None in starts or starts != sorted(set(starts)) or 0 in starts:
            raise ValueError(f"pp_layout={list(layout)!r} must name, in order, the pipeline units where stages "
                             f"2.. begin; the model's units are {list(units)}")
        bounds = [0] + starts + [len(units)]
        counts = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    if len(counts) != stages or sum(counts) != len(units):
        raise ValueError(f"pp_layout={layout_text(counts)!r} has {len(counts)} stage(s) of {sum(counts)} unit(s), "
                         f"but the plan needs {stages} stage(s) covering the model's {len(units)} pipeline "
                         f"units {list(units)}")
    return counts


def stage_units(units: Sequence[str], counts: Sequence[int]) -> Tuple[Tuple[str, ...], ...]:
    """The units of each stage, in stage order."""
    out, start = [], 0
    for c in counts:
        out.append(tuple(units[start:start + c]))
        start += c
    return tuple(out)


# ---- checks -----------------------------------------------------------------------------------------

def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return int(value)


def check_pp_fields(plan) -> dict:
    """The plan's pp fields checked against each other and its batch (plan time, before any model).

    Returns them normalised; ValueError names the numbers that do not fit.
    """
    fields = dict(pp_schedule=plan.pp_schedule, pp_microbatches=plan.pp_microbatches,
                  pp_virtual_stages=plan.pp_virtual_stages, pp_layout=plan.pp_layout)
    if not plan.uses_pp:
        if fields != dict(pp_schedule=None, pp_microbatches=None, pp_virtual_stages=1, pp_layout=""):
            set_ = {k: v for k, v in fields.items() if v not in (None, 1, "")}
            raise ValueError(f"pipeline fields {set_} are only used by {names_text(lambda m: m.pp)}; leave them unset for "
                             f"mode {plan.mode!r}")
        return fields
    pp, schedule = plan.pp_size, plan.pp_schedule_spec
    m = _count("pp_microbatches", plan.pp_microbatches)
    v = _count("pp_virtual_stages", plan.pp_virtual_stages)
    schedule.check_stages(v)
    if plan.per_rank_batch % m:
        raise ValueError(f"pp_microbatches={m} does not divide the per-rank batch {plan.per_rank_batch} "
                         f"(batch_size={plan.batch_size} / dp={plan.dp_size}); use a divisor of it")
    if m < pp * v:
        raise ValueError(f"pp_microbatches={m} is fewer than pp * virtual stages = {pp} * {v} = {pp * v}: some "
                         f"stage would have no micro-batch to run; use at least {pp * v}")
    schedule.check_micro(pp, m)
    layout = plan.pp_layout
    if not isinstance(layout, str):
        raise TypeError(f"pp_layout must be a string such as '3|4' (or '' for an even split), got {layout!r}")
    if layout and len(layout_counts(layout)) != pp * v:
        raise ValueError(f"pp_layout={layout!r} has {len(layout_counts(layout))} stage(s), but pp * virtual "
                         f"stages = {pp} * {v} = {pp * v}")
    return dict(fields, pp_microbatches=m, pp_virtual_stages=v)


def units_problem(units: Sequence[str], problem: str, stages: int, what: str) -> Optional[str]:
    """Why a model with pipeline ``units`` cannot be cut into ``stages`` stages (``what`` names them), or None."""
    if not units:
        if problem.endswith(TIME_LOOP_HINT):  # it says what to do
            return f"mode 'pp' needs a model whose forward chains its top-level modules, but {problem}"
        return (f"mode 'pp' needs a model whose forward chains its top-level modules, but {problem}; write the "
                "model as an nn.Sequential (nested Sequentials are cut further) or a module whose forward is "
                "self.c(self.b(self.a(x)))")
    if stages > len(units):
        return (f"{what} = {stages} stages, but the model has only {len(units)} pipeline unit(s) {list(units)}; "
                f"use at most {len(units)} stages")
    return None


def _check_ranks_train(plan, units: Sequence[str], counts: Sequence[int], trainable: Sequence[str]) -> None:
    """ValueError when a pp rank's stages hold no trainable parameter (its optimizer would have none)."""
    runs = stage_units(units, counts)
    spec = plan.pp_schedule_spec
    for rank in range(plan.pp_size):
        own = spec.rank_stages(rank, plan.pp_size, plan.pp_virtual_stages)
        held = [u for s in own for u in runs[s]]
        if not any(u in trainable for u in held):
            raise ValueError(f"pp_layout {layout_text(counts)!r} leaves pp rank {rank} (stage(s) {list(own)}: {held}) "
                             f"without a trainable parameter, so it would have nothing to train; the units "
                             f"holding parameters are {list(trainable)}: use fewer stages or a layout that "
                             "gives every rank one of them")


def check_pp_model(plan, units: Sequence[str], problem: str = "", shared: Sequence[Sequence[str]] = (),
                   trainable: Optional[Sequence[str]] = None) -> Tuple[int, ...]:
    """The plan's stage layout as unit counts; ValueError when the model cannot be cut as it asks,
    when a tied parameter (``shared``: groups of parameter paths) would be split over stages, or when
    a rank's stages hold none of the ``trainable`` units (None: not checked)."""
    stages = plan.pp_stages
    why = units_problem(units, problem, stages, f"pp={plan.pp_size} x virtual stages {plan.pp_virtual_stages}")
    if why:
        raise ValueError(why)
    counts = resolve_layout(plan.pp_layout, units, stages)
    if trainable is not None:
        _check_ranks_train(plan, units, counts, trainable)
    check_tp_boundaries(plan.tensor_parallel_plan, units, counts)
    stage_of = {u: s for s, run in enumerate(stage_units(units, counts)) for u in run}
    for group in shared:
        owners = {s for path in group for u, s in stage_of.items() if path.startswith(u + ".")}
        if len(owners) > 1:
            raise ValueError(f"the tied parameter {list(group)} would be split over pipeline stages {sorted(owners)}, "
                             "whose copies would train apart; choose a pp_layout that keeps its modules in one stage")
    return counts


def whole_cuts(tp_plan, units: Sequence[str]) -> Tuple[bool, ...]:
    """Per unit: whether its output is whole under ``tp_plan`` (path -> style name, in module order), so
    a pipeline stage may end after it (a tensor-parallel shard cannot be sent)."""
    return tuple(state != SHARDED for state, _ in _unit_states(tp_plan, units))


def _unit_states(tp_plan, units: Sequence[str]):
    """Per unit: (the sharding of its output, the styled path that set it). A style that takes and gives
    the same sharding (a neuron keeping local state) passes its input's on."""
    state, setter, out = None, None, []
    for unit in units:
        for path, name in tp_plan.items():
            style, inside = STYLES[name], path == unit or path.startswith(unit + ".")
            if inside and (style.takes != style.gives or state is None):
                state, setter = style.gives, path
        out.append((state, setter))
    return out


def check_tp_boundaries(tp_plan, units: Sequence[str], counts: Sequence[int]) -> None:
    """ValueError when a stage would end on a tensor-parallel shard (a column-split layer whose row-split
    partner sits in the next stage): a stage sends whole tensors. ``tp_plan``: path -> style name, in
    module order (the planner's)."""
    if not tp_plan:
        return
    boundaries = _boundaries(counts)
    for k, (state, setter) in enumerate(_unit_states(tp_plan, units)):
        if k in boundaries and state == SHARDED:
            raise ValueError(f"the pipeline stage ending with unit {units[k]!r} would send a tensor-parallel shard: "
                             f"{setter!r} ({tp_plan[setter]}) gives a sharded output that a layer of the next "
                             f"stage gathers; choose a pp_layout whose stages end after a whole-output layer "
                             f"(stage boundaries now after units {[units[b] for b in boundaries]})")


def _boundaries(counts: Sequence[int]) -> Tuple[int, ...]:
    """Indices of the units that end a stage (all but the last stage's)."""
    ends, total = [], 0
    for c in counts[:-1]:
        total += c
        ends.append(total - 1)
    return tuple(ends)


def recommend_pipeline(batch_size: int, world_size: int) -> Optional[Tuple[int, int]]:
    """``(virtual stages V, micro-batches m)`` for ``batch_size`` on a ``world_size``-stage pipeline, or
    None: V = 2 when the batch is >= 2 * world, 1 when >= world; m = the largest divisor of the batch in
    ``[world * V, min(batch, 4 * world * V)]``."""
    if batch_size >= 2 * world_size:
        virtual = 2
    elif batch_size >= world_size:
        virtual = 1
    else:
        return None
    micro = microbatches_for(batch_size, world_size * virtual)
    return None if micro is None else (virtual, micro)


def microbatches_for(batch_size: int, stages: int) -> Optional[int]:
    """The largest divisor of ``batch_size`` in ``[stages, min(batch_size, 4 * stages)]``, or None."""
    return next((m for m in range(min(batch_size, 4 * stages), stages - 1, -1) if batch_size % m == 0), None)
