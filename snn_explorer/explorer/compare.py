"""The side-by-side comparison: one column per plan, numbers from the estimator's tables."""
from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import pandas as pd

from ..core import SNNDistributedPlan
from ..estimator import PlanEstimate

#: Per-rank memory components (each row holds the largest value over the plan's ranks).
MEMORY_ROWS = ("params_bytes", "grads_bytes", "optimizer_bytes", "buffers_bytes", "activations_bytes",
               "neuron_state_bytes", "transient_bytes")
#: Numeric rows where the smallest value is best (highlighted).
BEST_LOW = MEMORY_ROWS + ("peak_bytes_max", "comm_bytes_per_step", "wire_bytes_per_step", "collectives_per_step",
                          "step_time_s",
                          "bubble_fraction")
#: Numeric rows where the largest value is best (highlighted). Every other row is never highlighted.
BEST_HIGH = ("samples_per_s",)
TEXT_ROWS = ("objective", "mode", "mesh", "optimizer_strategy", "memopt_level", "batch", "batch_per_rank",
             "time_steps", "rationale", "notes", "verdict", "hardware")
#: ``comm_bytes_per_step``: the collectives' buffers, summed; ``wire_bytes_per_step``: what each rank sends on the
#: wire for them, by the algorithm its backend runs (:mod:`snn_explorer.estimator.timing.wire_bytes`).
COMPARE_ROWS = TEXT_ROWS + MEMORY_ROWS + ("peak_bytes_max", "comm_bytes_per_step", "wire_bytes_per_step",
                                          "collectives_per_step",
                                          "step_time_s", "samples_per_s", "fits_budget")
#: Rows added after :data:`COMPARE_ROWS` when a compared plan is a pipeline (a plan without one: "" and 0).
PIPELINE_ROWS = ("pipeline", "bubble_fraction")
#: The row added after ``mesh`` when a compared plan trains in half precision (each plan's ``Precision.label``).
PRECISION_ROW = "precision"
#: The prefix of a styled comparison's table id; the rest is a digest of the table (see :func:`table_uuid`).
STYLER_UUID = "snn-compare"
#: The style of a best cell.
BEST_CSS = "font-weight: bold; background-color: #d4edda"


def mesh_text(plan: SNNDistributedPlan) -> str:
    return " x ".join(f"{n}={s}" for n, s in zip(plan.mesh_dim_names, plan.mesh_shape))


def pipeline_text(plan: SNNDistributedPlan) -> str:
    """``1f1b m=8`` (``interleaved m=8 v=2``): a pipeline's schedule, micro-batches and virtual stages."""
    if not plan.uses_pp:
        return ""
    virtual = f" v={plan.pp_virtual_stages}" if plan.pp_virtual_stages > 1 else ""
    return f"{plan.pp_schedule} m={plan.pp_microbatches}{virtual}"


def plan_label(plan: SNNDistributedPlan) -> str:
    """``dp+zero dp=4``, ``fsdp2+reshard dp=4``, ``pp pp=2 x dp=2 1f1b m=8``: the plan's
    :attr:`~snn_explorer.core.SNNDistributedPlan.label` (the Fit table names plans by it too)."""
    return plan.label


def unique_labels(plans: Sequence[SNNDistributedPlan]) -> list:
    """``plan_label`` of each plan, numbered ``#1 ...`` so that equal-looking plans stay apart."""
    return [f"#{i + 1} {plan_label(p)}" for i, p in enumerate(plans)]


def _column(est: PlanEstimate, budget: Optional[int]) -> dict:
    p, per_rank = est.plan, est.per_rank
    col = dict(objective=p.objective, mode=p.mode, mesh=mesh_text(p), optimizer_strategy=p.optimizer_strategy,
               memopt_level=p.memopt_level, batch=p.batch_size, batch_per_rank=p.per_rank_batch,
               time_steps=est.time_steps, rationale=" ".join(p.rationale), notes=" ".join(_notes(est)),
               verdict=est.verdict, hardware=est.hardware.name if est.hardware is not None else "",
               precision=p.precision.label)
    col.update({name: int(per_rank[name].max()) for name in MEMORY_ROWS})
    col.update(peak_bytes_max=est.peak_bytes, comm_bytes_per_step=est.comm_bytes,
               wire_bytes_per_step=est.wire_bytes,
               collectives_per_step=int(est.collectives["count"].sum()) if len(est.collectives) else 0,
               step_time_s=est.step_time_s, samples_per_s=est.samples_per_s,
               fits_budget="" if budget is None else ("yes" if est.peak_bytes <= budget else "no"),
               pipeline=pipeline_text(p) + (f" stages {p.pp_layout}" if p.pp_layout else ""),
               bubble_fraction=est.bubble_fraction)
    return col


def _notes(est: PlanEstimate) -> list:
    """The plan's notes, then the estimate's (what its numbers hide, with their cost)."""
    return list(est.plan.notes) + list(est.notes)


def _shared_notes(estimates: Sequence[PlanEstimate], data: dict) -> None:
    """Each column's ``notes`` without the notes every compared plan has (said once per column as a count,
    so a row of several plans does not repeat the same paragraphs in every column)."""
    if len(estimates) < 2:
        return
    shared = set.intersection(*(set(_notes(e)) for e in estimates))
    if not shared:
        return
    for column, est in zip(data.values(), estimates):
        own = [n for n in _notes(est) if n not in shared]
        column["notes"] = " ".join(own + [f"[{len(shared)} note(s) shared by every plan: compare one plan to read them]"])


def compare_table(estimates: Sequence[PlanEstimate], labels: Optional[Sequence[str]] = None,
                  memory_budget: Optional[int] = None) -> pd.DataFrame:
    """Rows :data:`COMPARE_ROWS` (with :data:`PRECISION_ROW` when a plan trains in half precision, and
    :data:`PIPELINE_ROWS` when a plan is a pipeline), one column per estimate (labelled ``labels`` or
    ``#i mode mesh``)."""
    labels = list(labels) if labels is not None else unique_labels([e.plan for e in estimates])
    if len(labels) != len(estimates) or len(set(labels)) != len(labels):
        raise ValueError(f"need one distinct label per estimate, got {labels!r} for {len(estimates)} estimates")
    data = {label: _column(e, memory_budget) for label, e in zip(labels, estimates)}
    _shared_notes(estimates, data)
    rows = COMPARE_ROWS + (PIPELINE_ROWS if any(e.plan.uses_pp for e in estimates) else ())
    if any(e.plan.precision.mixed for e in estimates):
        at = rows.index("mesh") + 1
        rows = rows[:at] + (PRECISION_ROW,) + rows[at:]
    return pd.DataFrame(data, index=list(rows), columns=labels, dtype=object)


def best_columns(table: pd.DataFrame, row: str) -> list:
    """The columns holding the best value of numeric ``row`` (smallest for :data:`BEST_LOW`, largest
    for :data:`BEST_HIGH`; ties all best); none for another row, a non-numeric cell, or all equal."""
    if row not in BEST_LOW + BEST_HIGH or row not in table.index:
        return []
    values = pd.to_numeric(table.loc[row], errors="coerce")
    if values.isna().any() or values.nunique() < 2:
        return []
    best = values.max() if row in BEST_HIGH else values.min()
    return list(values.index[values == best])


def table_uuid(table: pd.DataFrame) -> str:
    """``snn-compare-<digest>``: the Styler's table id, a digest of ``table``'s labels and cells, so
    that two comparisons on one page (or in two open notebooks) never share an id, and so never
    each other's cell styles, while one table renders to the same HTML on every run."""
    text = repr((list(table.index), list(table.columns), [[str(v) for v in row] for row in table.values]))
    return f"{STYLER_UUID}-{hashlib.sha1(text.encode()).hexdigest()[:12]}"


def format_bytes(n) -> str:
    if not isinstance(n, (int, float)):
        return str(n)
    if abs(n) >= 2 ** 20:
        return f"{n / 2 ** 20:.2f} MiB"
    return f"{n / 2 ** 10:.1f} KiB" if abs(n) >= 2 ** 10 else f"{n} B"


def format_seconds(s) -> str:
    if not isinstance(s, (int, float)):
        return str(s)
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def _is_bytes_row(row: str) -> bool:
    return "_bytes" in row


def readable(table: pd.DataFrame, max_text: int = 0) -> pd.DataFrame:
    """A copy with byte rows in B / KiB / MiB; ``max_text`` > 0 cuts long text cells (terminals)."""
    out = table.copy()
    for row in table.index:
        if _is_bytes_row(row):
            out.loc[row] = [format_bytes(v) for v in table.loc[row]]
        elif row == "step_time_s":
            out.loc[row] = [format_seconds(v) for v in table.loc[row]]
        elif row == "bubble_fraction":
            out.loc[row] = [f"{v:.1%}" if isinstance(v, (int, float)) else str(v) for v in table.loc[row]]
        elif row == "samples_per_s":
            out.loc[row] = [f"{v:.4g}" if isinstance(v, (int, float)) else str(v) for v in table.loc[row]]
        elif max_text and row in ("rationale", "notes", "verdict"):
            out.loc[row] = [v if len(str(v)) <= max_text else str(v)[:max_text - 3] + "..." for v in table.loc[row]]
    return out


def best_styles(table: pd.DataFrame) -> pd.DataFrame:
    """:data:`BEST_CSS` on each row's best cells (:func:`best_columns`), "" elsewhere."""
    best = pd.DataFrame("", index=table.index, columns=table.columns)
    for row in table.index:
        for col in best_columns(table, row):
            best.loc[row, col] = BEST_CSS
    return best


def style_compare(table: pd.DataFrame):
    """A Styler of :func:`readable` with each row's best value in bold green, its id unique to the
    table (:func:`table_uuid`), scrolling sideways rather than growing wider than its page."""
    best = best_styles(table)
    styler = readable(table).style.set_uuid(table_uuid(table)).apply(lambda _: best, axis=None)
    return styler.set_table_styles([
        {"selector": "", "props": "display: block; max-width: 100%; overflow-x: auto"},
        {"selector": "td", "props": "text-align: left; min-width: 7em; max-width: 16em; white-space: normal"}])
