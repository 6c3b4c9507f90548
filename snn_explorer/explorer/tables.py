"""pandas tables of analyses and plans; deterministic, so notebooks regression-test cleanly."""
from __future__ import annotations

from typing import Sequence

import pandas as pd

from ..core import SNNDistributedAnalysis, SNNDistributedPlan
from ..core.tp import STYLES

#: Why an snntorch neuron created with ``init_hidden=False`` is a neuron but not stateful.
EXPLICIT_NOTE = ("neuron without module state: snntorch init_hidden=False, forward passes the membrane "
                 "(spk, mem = lif(x, mem)); nothing to reset between batches")


def analysis_table(analysis: SNNDistributedAnalysis) -> pd.DataFrame:
    """One row per stateful module (neurons, dropout masks), snntorch neuron whose membrane forward
    passes (not stateful, said in its note), TP candidate or unsupported conv, in model order."""
    library = dict(analysis.snn_libraries)
    shapes = {s.name: s for s in analysis.linear_shapes}
    rows = []
    explicit = set(analysis.explicit_state_names)
    names = list(dict.fromkeys(analysis.memory_module_names + analysis.tensor_parallel_candidate_names
                               + analysis.unsupported_tensor_parallel_names + analysis.explicit_state_names))
    for name in names:
        shape = shapes.get(name)
        note = "conv: experimental TP only" if name in analysis.unsupported_tensor_parallel_names else ""
        rows.append({
            "path": name,
            "stateful": name in library,
            "snn_library": library.get(name, "snntorch" if name in explicit else ""),
            "tp_candidate": shape is not None,
            "in_features": shape.in_features if shape else None,
            "out_features": shape.out_features if shape else None,
            "note": EXPLICIT_NOTE if name in explicit else note,
        })
    table = pd.DataFrame(rows, columns=["path", "stateful", "snn_library", "tp_candidate", "in_features",
                                        "out_features", "note"])
    return table.astype({"in_features": "Int64", "out_features": "Int64"})  # integers, <NA> where none


def plans_table(plans: Sequence[SNNDistributedPlan]) -> pd.DataFrame:
    """One row per plan: mode, mesh, optimizer sharding, per-rank batch, TP layout, notes."""
    rows = []
    for p in plans:
        styles = list(p.tensor_parallel_plan.values())
        rows.append({
            "objective": p.objective,
            "mode": p.mode,
            "mesh": " x ".join(f"{n}={s}" for n, s in zip(p.mesh_dim_names, p.mesh_shape)),
            "optimizer_strategy": p.optimizer_strategy,
            "memopt_level": p.memopt_level,
            "batch_per_rank": p.per_rank_batch,
            "tp_sharded_linears": sum(STYLES[s].shards_parameters for s in styles),
            "fsdp_units": len(p.fsdp_units),
            "notes": " ".join(p.notes),
        })
    return pd.DataFrame(rows)
