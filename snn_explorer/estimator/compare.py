"""compare_estimate(): an estimate and a measurement of the same plan side by side."""
from __future__ import annotations

from typing import Dict

import numpy as np
import pandas as pd

from .instruments.tables import COLLECTIVE_COLUMNS, PER_RANK_COLUMNS, TIME_COLUMNS
from .measurement import PlanMeasurement
from .plan_estimate import PlanEstimate

_KEYS = ["mesh_dim", "kind", "phase"]


def _rel(est: pd.Series, meas: pd.Series) -> pd.Series:
    est, meas = est.astype(float), meas.astype(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = (est - meas) / meas.abs()
    return rel.where(meas != 0, np.where(est == 0, 0.0, np.inf)).where(meas.notna())


def compare_estimate(estimate: PlanEstimate, measurement: PlanMeasurement) -> Dict[str, pd.DataFrame]:
    """``{"per_rank": ..., "collectives": ..., "time": ...}``: per column ``<col>_est``, ``<col>_meas``, ``<col>_rel_err``.

    Relative errors are ``(estimate - measured) / measured`` (0 when both are 0, NaN where the
    quantity was not measured). Collectives are matched on ``mesh_dim, kind, phase``; a row one
    side lacks counts as zero there.
    """
    if estimate.plan != measurement.plan:
        raise ValueError(f"the estimate is of {estimate.plan!r} but the measurement of {measurement.plan!r}")
    per_rank = estimate.per_rank.merge(measurement.per_rank, on="rank", suffixes=("_est", "_meas"))
    out = per_rank[["rank"]].copy()
    for col in PER_RANK_COLUMNS[1:]:
        out[f"{col}_est"], out[f"{col}_meas"] = per_rank[f"{col}_est"], per_rank[f"{col}_meas"]
        out[f"{col}_rel_err"] = _rel(per_rank[f"{col}_est"], per_rank[f"{col}_meas"])
    columns = list(COLLECTIVE_COLUMNS)  # the estimate's wire bytes have no measured side
    coll = estimate.collectives[columns].merge(measurement.collectives[columns], on=_KEYS, how="outer",
                                               suffixes=("_est", "_meas"))
    coll = coll.fillna({c: 0 for c in coll.columns if c not in _KEYS})
    comm = coll[_KEYS].copy()
    for col in COLLECTIVE_COLUMNS[3:]:
        comm[f"{col}_est"] = coll[f"{col}_est"].astype(int)
        comm[f"{col}_meas"] = coll[f"{col}_meas"].astype(int)
        comm[f"{col}_rel_err"] = _rel(coll[f"{col}_est"], coll[f"{col}_meas"])
    times = estimate.time.merge(measurement.time, on="rank", suffixes=("_est", "_meas"))
    timing = times[["rank"]].copy()
    for col in TIME_COLUMNS[1:]:
        timing[f"{col}_est"], timing[f"{col}_meas"] = times[f"{col}_est"], times[f"{col}_meas"]
        timing[f"{col}_rel_err"] = _rel(times[f"{col}_est"], times[f"{col}_meas"])
    return {"per_rank": out, "collectives": comm.sort_values(_KEYS).reset_index(drop=True), "time": timing}
