"""The timeline of a pipeline schedule per rank, and the stage layout over the model's units.

The timeline replays each rank's order of micro-batch forwards (F) and backwards (B) with stages
costing alike (a backward twice a forward) and each action waiting for the one it needs (F of
stage s after F of stage s-1; B of stage s after B of stage s+1): the gaps are the bubbles.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from matplotlib.figure import Figure

from ..core.pipeline_plan import even_layout, layout_counts, stage_units

#: Time of one micro-batch's forward and backward through one stage, in forward units.
COST = {"F": 1.0, "B": 2.0}


def rank_actions(schedule: str, pp: int, pp_rank: int, micro: int) -> List[Tuple[str, int]]:
    """``[("F" | "B", micro-batch), ...]`` in the order one rank runs them (GPipe: every forward,
    then every backward; 1F1B: ``pp - 1 - rank`` forwards, then one forward and one backward in
    turn, then the remaining backwards)."""
    if schedule == "gpipe":
        return [("F", i) for i in range(micro)] + [("B", i) for i in range(micro)]
    if schedule != "1f1b":
        raise NotImplementedError(f"the timeline of pp_schedule={schedule!r} may come later; "
                                  "it is drawn for 'gpipe' and '1f1b'")
    warmup = min(micro, pp - 1 - pp_rank)
    out = [("F", i) for i in range(warmup)]
    forward, backward = warmup, 0
    while backward < micro:
        if forward < micro:
            out.append(("F", forward))
            forward += 1
        out.append(("B", backward))
        backward += 1
    return out


def timeline(schedule: str, pp: int, micro: int) -> Dict[int, List[Tuple[str, int, float, float]]]:
    """Per rank ``(kind, micro-batch, start, end)`` of every action, replayed with :data:`COST`."""
    orders = {r: rank_actions(schedule, pp, r, micro) for r in range(pp)}
    done: Dict[Tuple[str, int, int], float] = {}
    out = {r: [] for r in range(pp)}
    position, free = {r: 0 for r in range(pp)}, {r: 0.0 for r in range(pp)}
    while any(position[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if position[r] == len(orders[r]):
                continue
            kind, i = orders[r][position[r]]
            need = ("F", r - 1, i) if kind == "F" and r else ("B", r + 1, i) if kind == "B" and r < pp - 1 else None
            if need is not None and need not in done:
                continue
            start = max(free[r], done.get(need, 0.0))
            end = start + COST[kind]
            done[(kind, r, i)], free[r] = end, end
            out[r].append((kind, i, start, end))
            position[r] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"the {schedule} order deadlocks for pp={pp}, micro-batches={micro}")
    return out


def idle_fraction(schedule: str, pp: int, micro: int) -> float:
    """The replayed timeline's idle share of all ranks' time up to the last action."""
    lines = timeline(schedule, pp, micro)
    end = max(a[3] for acts in lines.values() for a in acts)
    busy = sum(a[3] - a[2] for acts in lines.values() for a in acts)
    return 1.0 - busy / (end * pp)


def pipeline_chart(plan, units: Sequence[str]) -> Figure:
    """Top: each rank's forwards and backwards over time (gaps are bubbles). Bottom: which stage
    each of the model's pipeline ``units`` belongs to."""
    fig = Figure(figsize=(9.0, 4.5), dpi=100, layout="constrained")
    top, bottom = fig.subplots(2, 1, height_ratios=(3, 1))
    for r, acts in timeline(plan.pp_schedule, plan.pp_size, plan.pp_microbatches).items():
        for kind, i, start, end in acts:
            top.barh(r, end - start, left=start, color="C0" if kind == "F" else "C1", edgecolor="white")
            top.text((start + end) / 2, r, f"{kind}{i}", ha="center", va="center", fontsize=7, color="white")
    top.set_yticks(range(plan.pp_size), [f"rank {r}" for r in range(plan.pp_size)])
    top.invert_yaxis()
    top.set_xlabel("time (one stage forward = 1, backward = 2)")
    top.set_title(f"{plan.pp_schedule}: {plan.pp_microbatches} micro-batches on pp={plan.pp_size}, idle "
                  f"{idle_fraction(plan.pp_schedule, plan.pp_size, plan.pp_microbatches):.0%}")
    counts = layout_counts(plan.pp_layout) if plan.pp_layout else even_layout(len(units), plan.pp_stages)
    start = 0
    for s, stage in enumerate(stage_units(units, counts)):
        bottom.barh(0, len(stage), left=start, color=f"C{2 + s % 8}", edgecolor="white")
        bottom.text(start + len(stage) / 2, 0, f"stage {s} (rank {s % plan.pp_size})", ha="center", va="center",
                    fontsize=8)
        start += len(stage)
    bottom.set_xticks([i + 0.5 for i in range(len(units))], list(units), rotation=45, ha="right", fontsize=7)
    bottom.set_yticks([])
    return fig
