"""What a memory-budget fit (:func:`~snn_explorer.estimator.fit_budget`) shows: the fastest fitting plan
and its levers, every candidate with why it lost and what its lever bought, and peak against step time
with the Pareto front. Everything here reads the fit's own table; nothing is estimated again."""
from __future__ import annotations

import html
import re

import pandas as pd
from matplotlib.figure import Figure

from ..estimator import FitOutcome, FitResult
from .charts import FIGSIZE, MIB
from .compare import format_bytes, format_seconds
from .figure import new_figure

#: How each outcome is drawn: (label, colour, marker).
OUTCOME_STYLE = {FitOutcome.CHOSEN: ("chosen", "C2", "*"), FitOutcome.SLOWER: ("fits, slower", "C0", "o"),
                 FitOutcome.OVER_BUDGET: ("over budget", "C3", "x"),
                 FitOutcome.LEVER_NO_GAIN: ("lever raises the peak: dropped", "C7", "v")}
#: The columns of :func:`fit_table`.
FIT_VIEW_COLUMNS = ("plan", "levers", "peak", "lever saves", "step time", "lever time", "outcome", "why")


def fit_summary(result: FitResult) -> str:
    """One line: the chosen plan, its levers, its peak against the budget, its step time, the search."""
    e, row = result.estimate, result.table.iloc[0]
    levers = row["levers"] if row["levers"] != "-" else "no memory lever"
    return (f"fastest plan within {format_bytes(result.memory_budget)} per rank: {row['plan']} ({levers}), "
            f"peak {format_bytes(e.peak_bytes)}, {format_seconds(e.step_time_s)} per step on {e.hardware.name}; "
            f"{len(result.table)} candidates searched in {result.search_s:.2f} s")


def fit_summary_html(result: FitResult) -> str:
    return f"<p><b>{html.escape(fit_summary(result))}</b></p>"


def _saves(row) -> str:
    """What the row's lever bought: the peak without it minus the peak with it (blank without a lever)."""
    if row["levers"] == "-" or pd.isna(row["peak_bytes"]) or pd.isna(row["unlevered_peak_bytes"]):
        return ""
    return format_bytes(int(row["unlevered_peak_bytes"] - row["peak_bytes"]))


_RAW_BYTES = re.compile(r"\b(\d+) B\b")


def readable_why(text: str) -> str:
    """``why`` with its raw byte counts (``peak 123456 B``) in the units the table's other cells use."""
    return _RAW_BYTES.sub(lambda m: format_bytes(int(m.group(1))), text)


def fit_table(result: FitResult) -> pd.DataFrame:
    """Every candidate (the chosen first), bytes and seconds readable: ``lever saves`` is the peak its
    lever took off the same plan without it (negative: it added), ``lever time`` what it adds per step."""
    t = result.table
    out = pd.DataFrame({
        "plan": t["plan"], "levers": t["levers"],
        "peak": [format_bytes(int(v)) if pd.notna(v) else "not estimated" for v in t["peak_bytes"]],
        "lever saves": [_saves(row) for _, row in t.iterrows()],
        "step time": [format_seconds(v) if pd.notna(v) else "" for v in t["step_time_s"]],
        "lever time": [format_seconds(v) if lv != "-" and pd.notna(v) and pd.notna(s) else ""
                       for v, lv, s in zip(t["lever_time_s"], t["levers"], t["step_time_s"])],
        "outcome": [str(o) for o in t["outcome"]], "why": [readable_why(str(w)) for w in t["why"]]})
    return out[list(FIT_VIEW_COLUMNS)]


def fit_chart(result: FitResult) -> Figure:
    """Estimated peak per rank against predicted step time of every estimated candidate, by outcome;
    the Pareto front (:attr:`FitResult.pareto`) as a line, the budget as a dashed line, the chosen plan named."""
    fig = new_figure(FIGSIZE)
    ax = fig.add_subplot()
    t = result.table.dropna(subset=["peak_bytes", "step_time_s"])
    for outcome, (label, color, marker) in OUTCOME_STYLE.items():
        mine = t[t["outcome"] == outcome]
        if len(mine):
            ax.scatter(mine["peak_bytes"] / MIB, mine["step_time_s"] * 1e3, color=color, marker=marker,
                       s=120 if outcome == FitOutcome.CHOSEN else 30, label=label, zorder=3)
    front = result.pareto
    ax.plot(front["peak_bytes"] / MIB, front["step_time_s"] * 1e3, "-", color="C1", label="Pareto front", zorder=2)
    ax.axvline(result.memory_budget / MIB, color="red", linestyle="--", linewidth=1,
               label=f"budget {result.memory_budget / MIB:.4g} MiB")
    chosen = result.table.iloc[0]
    ax.annotate(chosen["plan"], (chosen["peak_bytes"] / MIB, chosen["step_time_s"] * 1e3), textcoords="offset points",
                xytext=(6, 6), fontsize=8)
    ax.set_xlabel("estimated peak MiB per rank")
    ax.set_ylabel("predicted ms per step")
    ax.set_title(f"plans and levers for {result.plan.world_size} ranks: peak vs step time")
    ax.legend(fontsize=7)
    return fig
