"""matplotlib charts of estimates: fixed size, no pyplot state, each returns a Figure that displays
itself (:class:`~snn_explorer.explorer.figure.ChartFigure`)."""
from __future__ import annotations

from typing import Optional, Sequence

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ..estimator import PlanEstimate
from .compare import MEMORY_ROWS, unique_labels
from .figure import new_figure, wrapped

FIGSIZE = (9.0, 4.5)
MIB = 2 ** 20


def _figure():
    fig = new_figure(FIGSIZE)
    return fig, fig.add_subplot()


def _plan_ticks(ax, positions, labels) -> None:
    """Plan labels under ``positions``, level, wrapped to the room a plan has (8 plans side by side)."""
    size = 8 if len(labels) <= 4 else 7
    ax.set_xticks(positions, wrapped(labels, max(6, 96 // max(1, len(labels)))), fontsize=size)


def _budget_line(ax, memory_budget: Optional[int], vertical: bool = False) -> None:
    """The memory budget (bytes per device) as a dashed red line, when one is given."""
    if memory_budget is None:
        return
    line = ax.axvline if vertical else ax.axhline
    line(memory_budget / MIB, color="red", linestyle="--", linewidth=1, label=f"budget {memory_budget / MIB:.4g} MiB")


def _labels(estimates, labels):
    return list(labels) if labels is not None else unique_labels([e.plan for e in estimates])


def _empty(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} to show", ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


#: Legend words of the memory chart that need their definition beside them.
MEMORY_LEGEND = {"transient_bytes": "transient (DDP buckets, FSDP2 gather / reduce buffers:\nalive in one phase only)"}
PEAK_LEGEND = ("peak: persistent + the largest phase\n(the stack adds every part; they are\nnever all alive at once, "
               "so it can\nreach above the peak)")


def memory_chart(estimates: Sequence[PlanEstimate], labels: Optional[Sequence[str]] = None,
                 memory_budget: Optional[int] = None) -> Figure:
    """Stacked per-rank memory breakdown: a group of bars per plan, one bar per rank, one
    segment per :data:`~snn_explorer.explorer.compare.MEMORY_ROWS` component; ``x`` marks each rank's
    peak; a dashed line the ``memory_budget`` (bytes per device) when given."""
    fig, ax = _figure()
    if not estimates:
        _empty(ax, "plans")
        return fig
    labels, colors = _labels(estimates, labels), [f"C{i}" for i in range(len(MEMORY_ROWS))]
    ticks, x, top = [], 0.0, 0.0
    for est in estimates:
        ranks = est.per_rank
        xs = [x + i for i in range(len(ranks))]
        bottom = [0.0] * len(ranks)
        for name, color in zip(MEMORY_ROWS, colors):
            values = (ranks[name] / MIB).tolist()
            ax.bar(xs, values, bottom=bottom, width=0.8, color=color,
                   label=MEMORY_LEGEND.get(name, name.removesuffix("_bytes")) if est is estimates[0] else None)
            bottom = [b + v for b, v in zip(bottom, values)]
        top = max([top, *bottom, *(ranks["peak_bytes"] / MIB)])
        ax.scatter(xs, ranks["peak_bytes"] / MIB, marker="x", color="black",
                   label=PEAK_LEGEND if est is estimates[0] else None, zorder=3)
        ticks.append(x + (len(ranks) - 1) / 2)
        x += len(ranks) + 1
    _plan_ticks(ax, ticks, labels)
    _budget_line(ax, memory_budget)
    ax.set_ylim(0, 1.08 * max(top, memory_budget / MIB if memory_budget else 0.0) or 1.0)  # no bar clipped
    ax.set_ylabel("MiB per rank")
    ax.set_title("memory per rank (one bar per rank; x: estimated peak)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


#: What :func:`comm_chart` can show: the column of the collectives table, the axis label and the title.
COMM_MEASURES = {
    "wire": ("wire_bytes", "MiB sent on the wire per step, per rank",
             "communication per step: bytes each rank sends on the wire (by algorithm)"),
    "buffer": ("bytes", "MiB of collective buffers per step, per rank",
               "communication per step: the buffers handed to the collectives (their sizes, not the traffic)"),
}


def _traffic(est: PlanEstimate, column: str) -> pd.Series:
    c = est.collectives
    if not len(c):
        return pd.Series(dtype=float)
    return c.assign(key=c["mesh_dim"] + " " + c["kind"]).groupby("key")[column].sum() / MIB


def comm_chart(estimates: Sequence[PlanEstimate], labels: Optional[Sequence[str]] = None,
               measure: str = "wire") -> Figure:
    """Communication per step and rank, one stacked bar per plan, a segment per mesh dim x collective:
    ``measure="wire"`` the bytes each rank sends on the wire (the algorithm's share of each buffer: ring
    all-reduce ``2 (p - 1) / p``, all-gather ``(p - 1) / p``, ...), ``"buffer"`` the buffers the collectives
    are handed. The title and the axis say which."""
    if measure not in COMM_MEASURES:
        raise ValueError(f"measure={measure!r}; expected one of {tuple(COMM_MEASURES)}")
    column, ylabel, title = COMM_MEASURES[measure]
    fig, ax = _figure()
    if not estimates:
        _empty(ax, "plans")
        return fig
    labels = _labels(estimates, labels)
    table = pd.DataFrame([_traffic(e, column) for e in estimates], index=labels).fillna(0.0)
    bottom = [0.0] * len(labels)
    for i, key in enumerate(sorted(table.columns)):
        ax.bar(range(len(labels)), table[key].tolist(), bottom=bottom, color=f"C{i}", label=key)
        bottom = [b + v for b, v in zip(bottom, table[key])]
    _plan_ticks(ax, range(len(labels)), labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(table.columns):
        ax.legend(fontsize=7)
    return fig


def pareto_front(points: Sequence[tuple]) -> list:
    """Indices of the points ``(memory, time)`` no other point beats on both, by memory."""
    front = [i for i, (m, c) in enumerate(points)
             if not any((m2 <= m and c2 <= c) and (m2, c2) != (m, c) for m2, c2 in points)]
    return sorted(front, key=lambda i: points[i])


def coinciding(points: Sequence[tuple], labels: Sequence[str], digits: int = 3) -> list:
    """``((x, y), [labels])`` per distinct point (to ``digits`` significant digits), so plans that
    land on one point share one annotation instead of printing over each other."""
    groups: dict = {}
    for label, (x, y) in zip(labels, points):
        key = (float(f"{x:.{digits}g}"), float(f"{y:.{digits}g}"))
        groups.setdefault(key, ((x, y), []))[1].append(label)
    return list(groups.values())


#: The parts of a predicted step, as the time table names them, and their labels.
TIME_PARTS = (("compute_s", "compute"), ("exposed_comm_s", "exposed communication"), ("bubble_s", "pipeline bubble"))


def step_time_parts(est: PlanEstimate) -> pd.Series:
    """The step-time bar of one plan, from its time table: the slowest rank's row; for a pipeline (whose ranks
    end the step together, each idle a different share of it) the mean over the ranks, so the bubble bar is the
    ranks' mean idle time and compute + communication + bubble is the step."""
    table = est.time
    if est.plan.uses_pp:
        return table[[c for c, _ in TIME_PARTS] + ["step_s"]].mean()
    return table.loc[table["step_s"].idxmax()]


def step_time_chart(estimates: Sequence[PlanEstimate], labels: Optional[Sequence[str]] = None,
                    measured: Optional[Sequence[Optional[float]]] = None) -> Figure:
    """Predicted step time per plan, one bar split into compute / exposed communication / pipeline bubble
    (:func:`step_time_parts`: the slowest rank; a pipeline's ranks on average, the bubble its own segment);
    ``measured`` (seconds, None where not measured) adds a black mark per plan."""
    fig, ax = _figure()
    if not estimates:
        _empty(ax, "plans")
        return fig
    labels = _labels(estimates, labels)
    rows = [step_time_parts(e) for e in estimates]
    bottom = [0.0] * len(rows)
    for i, (column, name) in enumerate(TIME_PARTS):
        values = [1e3 * r[column] for r in rows]
        ax.bar(range(len(rows)), values, bottom=bottom, color=f"C{i}", label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    if measured is not None:
        shown = [(i, 1e3 * m) for i, m in enumerate(measured) if m is not None]
        ax.scatter([i for i, _ in shown], [m for _, m in shown], marker="_", s=900, color="black",
                   label="measured", zorder=3)
    _plan_ticks(ax, range(len(rows)), labels)
    ax.set_ylabel("ms per step")
    ax.set_ylim(0, 1.12 * max(bottom + [1e3 * m for m in (measured or []) if m is not None]) or 1.0)
    hardware = estimates[0].hardware
    pipelines = " (pipelines: mean over ranks)" if any(e.plan.uses_pp for e in estimates) else " (slowest rank)"
    ax.set_title("predicted step time" + (f" on {hardware.name}" if hardware is not None else "") + pipelines)
    legend = ax.legend(fontsize=7)
    for handle in legend.legend_handles:  # the measured mark, 900 pt² on the bars, stays beside its word
        if hasattr(handle, "set_sizes"):
            handle.set_sizes([60])
    return fig


def pareto_chart(estimates: Sequence[PlanEstimate], labels: Optional[Sequence[str]] = None,
                 memory_budget: Optional[int] = None) -> Figure:
    """Peak memory (max over ranks) against predicted step time, a colour and a Pareto front per
    world size (plans on different rank counts do not compete); ``memory_budget`` a dashed line."""
    fig, ax = _figure()
    if not estimates:
        _empty(ax, "plans")
        return fig
    labels = _labels(estimates, labels)
    points = [(e.peak_bytes / MIB, 1e3 * e.step_time_s) for e in estimates]
    worlds = sorted({e.plan.world_size for e in estimates})
    for i, world in enumerate(worlds):
        mine = [j for j, e in enumerate(estimates) if e.plan.world_size == world]
        ranks = f"{world} rank{'s' * (world > 1)}"
        ax.scatter([points[j][0] for j in mine], [points[j][1] for j in mine], color=f"C{i}", label=ranks)
        front = [mine[k] for k in pareto_front([points[j] for j in mine])]
        ax.plot([points[j][0] for j in front], [points[j][1] for j in front], "-", color=f"C{i}",
                label=f"Pareto front, {ranks}")
    for (m, c), names in coinciding(points, labels):
        ax.annotate("\n".join(names), (m, c), textcoords="offset points", xytext=(4, 4), fontsize=7)
    _budget_line(ax, memory_budget, vertical=True)
    ax.set_xlabel("peak MiB per rank (max over ranks)")
    ax.set_ylabel("predicted ms per step")
    ax.set_title("memory vs step time")
    ax.legend(fontsize=7)
    return fig


def mesh_chart(layout: pd.DataFrame, plan, module: str) -> Figure:
    """The mesh as a dp x tp grid of ranks; each cell lists the slice of ``module``'s parameters
    it holds (a :func:`~snn_explorer.explorer.layout.shard_layout` table)."""
    dp, tp = plan.world_size // plan.tp_size, plan.tp_size
    fig = new_figure((FIGSIZE[0], max(FIGSIZE[1], 1.8 * dp + 0.6)))
    ax = fig.add_subplot()
    fontsize = mesh_fontsize(dp, tp)
    for rank, group in layout.groupby("rank", sort=True):
        d, t = divmod(int(rank), tp)
        text = "\n".join(f"{r.param} {r.held}" for r in group.itertuples()) or "(no parameters)"
        whole = (group["held"] == "whole").all()
        ax.add_patch(_cell(t, dp - 1 - d, "#e8e8e8" if whole else f"C{t % 10}"))
        ax.text(t + 0.5, dp - 1 - d + 0.5, f"rank {rank} (dp {d}, tp {t})\n{text}", ha="center",
                va="center", fontsize=fontsize)
    if layout.empty:
        for rank in range(plan.world_size):
            d, t = divmod(rank, tp)
            ax.add_patch(_cell(t, dp - 1 - d, "#e8e8e8"))
            ax.text(t + 0.5, dp - 1 - d + 0.5, f"rank {rank}\n(no parameters)", ha="center", va="center",
                    fontsize=fontsize)
    ax.set_xlim(0, tp)
    ax.set_ylim(0, dp)
    ax.set_axis_off()
    ax.set_title(f"{module}: what each rank holds ({plan.mode}, dp={dp} x tp={tp})", fontsize=12)
    return fig


def mesh_fontsize(dp: int, tp: int) -> float:
    """Cell text size: 11 pt for the few-rank meshes notebooks show, smaller as columns multiply."""
    return max(6.0, min(11.0, 40.0 / tp))


def _cell(x: int, y: int, color: str):
    return Rectangle((x + 0.03, y + 0.03), 0.94, 0.94, facecolor=color, alpha=0.35, edgecolor="black")


def activation_curve_chart(curve: pd.DataFrame, title: str = "") -> Figure:
    """Activation memory of one rank against time steps, a line per checkpointing granularity
    (a table from :func:`~snn_explorer.estimator.activation_curve`)."""
    fig, ax = _figure()
    for name, rows in curve.groupby("plan", sort=False):
        ax.plot(rows["time_steps"], rows["activations_bytes"] / MIB, marker="o", label=f"checkpointing: {name}")
    ax.set_xlabel("time steps T")
    ax.set_ylabel("MiB per rank")
    ax.set_title(title or "activation memory against time steps")
    ax.legend()
    return fig
