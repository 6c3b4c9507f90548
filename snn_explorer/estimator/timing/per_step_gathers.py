"""FSDP2 on a per-step model: the all-gathers it repeats at every time step, counted and costed.

An SNN that calls its layers once per time step calls each FSDP2 unit ``T`` times per step. FSDP2
frees a unit's gathered parameters after each call's backward (and, resharding after forward, after
each call's forward), so the next call gathers them again: a step runs up to ``2 T`` all-gathers per
unit where a model that calls each unit once runs one or two. The estimate's collectives hold them
already (:mod:`.collectives`); this names them in a note with their count, bytes and time.
"""
from __future__ import annotations

from typing import Optional

import pandas as pd

from ...core import SNNDistributedPlan
from ...core.common import Collective
from .placement import group_size, spans_nodes


def _gathers(collectives: pd.DataFrame) -> pd.DataFrame:
    return collectives[(collectives["mesh_dim"] == "dp") & (collectives["kind"] == Collective.ALL_GATHER)]


def per_step_gather_note(plan: SNNDistributedPlan, collectives: pd.DataFrame, once: pd.DataFrame, hardware,
                         t: int) -> Optional[str]:
    """The note on FSDP2's repeated all-gathers, or None where there are none.

    ``collectives``: the step's rows at ``t`` time steps (with ``wire_bytes``); ``once``: the same plan's rows
    with every unit called once (the step at ``T = 1``: one gather per unit and pass)."""
    if not plan.uses_fsdp or plan.dp_size < 2:
        return None
    now, base = _gathers(collectives), _gathers(once)
    extra = int(now["count"].sum()) - int(base["count"].sum())
    if extra <= 0:
        return None
    extra_bytes = float(now["bytes"].sum() - base["bytes"].sum())
    wire = float(now["wire_bytes"].sum()) * extra_bytes / max(1.0, float(now["bytes"].sum()))
    p = group_size(plan, "dp", Collective.ALL_GATHER)
    seconds = hardware.collective_time(Collective.ALL_GATHER, p, extra_bytes, extra,
                                       spans_nodes(plan, "dp", hardware, p))
    when = "after every call's forward and backward" if plan.reshard_after_forward else "after every call's backward"
    fix = ("; keeping gathered parameters (memopt_level=0) removes the forward's re-gathers" if plan.reshard_after_forward
           else "; only a model that runs all its time steps inside one call of each unit avoids them")
    return (f"FSDP2 gathers again at every time step: the model calls its units once per time step (T={t}) and "
            f"FSDP2 frees a unit's gathered parameters {when}, so a step runs {int(now['count'].sum())} all-gathers "
            f"where one call per unit would run {int(base['count'].sum())}: {extra} more, "
            f"{wire / 2 ** 20:.2f} MiB more on the wire per rank, about {seconds * 1e3:.3g} ms of collective time on "
            f"{hardware.name} (partly hidden behind compute where the device overlaps){fix}")
