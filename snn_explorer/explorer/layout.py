"""Which rank holds which slice of a module's parameters under a plan (plain data for the mesh chart)."""
from __future__ import annotations

import pandas as pd
from torch import nn

from ..core import SNNDistributedPlan

LAYOUT_COLUMNS = ("rank", "dp_rank", "tp_rank", "param", "full_shape", "held")


def _tp_slice(style: str, leaf: str, shape: tuple, tp: int, tp_rank: int) -> tuple:
    """(dim, start, stop) of the TP shard, or None when the tensor is whole on every TP rank."""
    if tp <= 1 or not shape:
        return None
    if style in ("colwise", "colwise_gather", "conv_colwise") or (style == "norm_local" and leaf in ("weight", "bias")):
        dim = 0
    elif style in ("rowwise", "conv_rowwise") and leaf == "weight" and len(shape) > 1:
        dim = 1
    else:
        return None
    size = shape[dim] // tp
    return dim, tp_rank * size, (tp_rank + 1) * size


def _text(ranges: dict, shape: tuple) -> str:
    parts = [f"{ranges[d][0]}:{ranges[d][1]}" if d in ranges else ":" for d in range(len(shape))]
    return "[" + ", ".join(parts) + "]" if ranges else "whole"


def shard_layout(model: nn.Module, plan: SNNDistributedPlan, module: str) -> pd.DataFrame:
    """One row per rank x parameter of ``module``: the slice ``held`` (``whole`` or ``[rows, cols]``).

    TP splits a dim by the module's style; FSDP2 then splits dim 0 of each TP-local tensor over
    the dp ranks (padded chunks, as ``fully_shard`` does); DDP and ZeRO keep whole parameters.
    """
    modules = dict(model.named_modules())
    if module not in modules:
        raise KeyError(f"{module!r} is not a module of the model")
    params = [(n, tuple(p.shape)) for n, p in modules[module].named_parameters(recurse=False)]
    style = plan.tensor_parallel_plan.get(module, "") if plan.tp_size > 1 else ""
    fsdp = plan.uses_fsdp
    rows = []
    for rank in range(plan.world_size):
        dp_rank, tp_rank = divmod(rank, plan.tp_size)
        for leaf, shape in params:
            ranges = {}
            tp = _tp_slice(style, leaf, shape, plan.tp_size, tp_rank)
            if tp:
                ranges[tp[0]] = (tp[1], tp[2])
            if fsdp and plan.dp_size > 1:
                start, stop = ranges.get(0, (0, shape[0]))
                chunk = -(-(stop - start) // plan.dp_size)
                lo = min(stop, start + dp_rank * chunk)
                ranges[0] = (lo, min(stop, lo + chunk))
            rows.append((rank, dp_rank, tp_rank, leaf, "x".join(map(str, shape)), _text(ranges, shape)))
    return pd.DataFrame(rows, columns=LAYOUT_COLUMNS)
