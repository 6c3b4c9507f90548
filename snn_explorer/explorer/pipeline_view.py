"""The timeline of a pipeline schedule per rank, and the stage layout over the model's units.

The timeline replays each rank's order of compute actions as torch's own schedule computes it
(``PipelineSchedule.rank_actions``; forwards F, backwards B, and for zero-bubble schedules input
and weight backwards I / W), each action costing ``pipeline_schedules.COST`` and waiting for the
one it needs: the gaps are the bubbles.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

from matplotlib.figure import Figure

from ..core.planning import Span, idle_fraction, replay, resolve_layout, schedule_of, stage_units
from .figure import new_figure

#: Colour of each action kind.
COLOURS = {"F": "C0", "B": "C1", "I": "C1", "W": "C3"}


def timeline(schedule: str, pp: int, micro: int, virtual: int = 1) -> Dict[int, List[Span]]:
    """Per rank ``(kind, stage, micro-batch, start, end)`` of every action of ``schedule`` (a
    ``pp_schedule`` name) on ``pp`` ranks with ``virtual`` stages each."""
    return replay(schedule_of(schedule).rank_actions(pp, micro, virtual), pp * virtual)


#: Width of the timeline in inches per unit of schedule time (one stage forward), within these bounds.
INCHES_PER_UNIT, WIDTH = 0.25, (9.0, 24.0)
#: The narrowest action box (inches) that is labelled; narrower boxes are drawn without text.
LABEL_INCHES = 0.18


def idle_text(lines: Dict[int, List[Span]], time=None) -> str:
    """The title's idle share: with ``time`` (an estimate's per-rank time table), the ranks' bubble over their
    step time, beside the schedule's own idle share at equal stage costs; without it, the schedule's alone."""
    schedule = idle_fraction(lines)
    if time is None:
        return f"idle {schedule:.0%} (schedule at equal stage costs)"
    idle = float(time["bubble_s"].sum()) / float(time["step_s"].sum())
    return f"idle {idle:.0%} of the ranks' step time (estimate); {schedule:.0%} at equal stage costs"


def pipeline_chart(plan, units: Sequence[str], time=None) -> Figure:
    """Top: each rank's forwards and backwards over time at equal stage costs (gaps are bubbles). Bottom:
    which stage each of the model's pipeline ``units`` belongs to. ``time``: the estimate's per-rank time
    table (``bubble_s``, ``step_s``), whose idle share the title states (stages of unequal cost idle more
    than the schedule alone). The figure widens with the schedule, and boxes too narrow for text carry none,
    so that 16 and more micro-batches stay readable."""
    lines = timeline(plan.pp_schedule, plan.pp_size, plan.pp_microbatches, plan.pp_virtual_stages)
    end = max(span[-1] for spans in lines.values() for span in spans)
    width = min(WIDTH[1], max(WIDTH[0], INCHES_PER_UNIT * end))
    fig = new_figure((width, 4.5))
    top, bottom = fig.subplots(2, 1, height_ratios=(3, 1))
    several = plan.pp_virtual_stages > 1
    inches = 0.85 * width / end  # the axes take about this share of the figure's width
    for r, acts in lines.items():
        for kind, stage, i, start, end_ in acts:
            top.barh(r, end_ - start, left=start, color=COLOURS[kind], edgecolor="white")
            if (end_ - start) * inches >= LABEL_INCHES:
                top.text((start + end_) / 2, r, f"{kind}{i}" + (f"\ns{stage}" if several else ""), ha="center",
                         va="center", fontsize=6 if several else 7, color="white")
    top.set_xlim(0, end)
    top.set_yticks(range(plan.pp_size), [f"rank {r}" for r in range(plan.pp_size)])
    top.invert_yaxis()
    top.set_xlabel("time (one stage forward = 1, backward = 2" + (", input / weight backward = 1 each)"
                                                                  if plan.pp_schedule_spec.splits_backward else ")"))
    stages = f" x {plan.pp_virtual_stages} stages each" if several else ""
    top.set_title(f"{plan.pp_schedule}: {plan.pp_microbatches} micro-batches on pp={plan.pp_size}{stages}, "
                  f"{idle_text(lines, time)}", fontsize=10)
    rank_of = lambda s: plan.pp_schedule_spec.rank_of(s, plan.pp_size, plan.pp_virtual_stages)
    counts = resolve_layout(plan.pp_layout, units, plan.pp_stages)
    start = 0
    for s, stage in enumerate(stage_units(units, counts)):
        bottom.barh(0, len(stage), left=start, color=f"C{2 + s % 8}", edgecolor="white")
        bottom.text(start + len(stage) / 2, 0, f"stage {s} (rank {rank_of(s)})", ha="center", va="center",
                    fontsize=8)
        start += len(stage)
    bottom.set_xticks([i + 0.5 for i in range(len(units))], list(units), rotation=45, ha="right", fontsize=7)
    bottom.set_yticks([])
    return fig
