"""Which rank holds which slice of a module's parameters under a plan (plain data for the mesh chart)."""
from __future__ import annotations

import pandas as pd
from torch import nn

from ..core import SNNDistributedPlan
from ..core.tp import STYLES

LAYOUT_COLUMNS = ("rank", "dp_rank", "tp_rank", "param", "full_shape", "held")


def _ranges(indices) -> str:
    """Sorted indices as ``a:b`` ranges joined by ``+`` (``0:4+8:12``)."""
    parts, start = [], None
    for i, index in enumerate(indices):
        if start is None:
            start = index
        if i + 1 == len(indices) or indices[i + 1] != index + 1:
            parts.append(f"{start}:{index + 1}")
            start = None
    return "+".join(parts)


def _text(held: dict, shape: tuple) -> str:
    if not held:
        return "whole"
    text = {d: h if isinstance(h, str) else _ranges(sorted(h)) for d, h in held.items()}
    return "[" + ", ".join(text.get(d, ":") for d in range(len(shape))) + "]"


def shard_layout(model: nn.Module, plan: SNNDistributedPlan, module: str) -> pd.DataFrame:
    """One row per rank x parameter of ``module``: the slice ``held`` (``whole`` or ``[rows, cols]``,
    each a ``+``-joined list of ``start:stop`` ranges in the model's index order).

    TP splits a dim by the module's style (head-aligned rows for fused q/k/v); FSDP2 then splits dim 0 of each TP-local tensor over
    the dp ranks (padded chunks, as ``fully_shard`` does); DDP and ZeRO keep whole parameters.
    """
    if plan.uses_pp:
        raise ValueError(f"the shard layout covers dp x tp meshes, but the plan cuts the model into pipeline stages "
                         f"(pp={plan.pp_size}); the pipeline chart shows which stage and rank hold each module")
    modules = dict(model.named_modules())
    if module not in modules:
        raise KeyError(f"{module!r} is not a module of the model")
    params = [(n, tuple(p.shape)) for n, p in modules[module].named_parameters(recurse=False)]
    style = STYLES.get(plan.tensor_parallel_plan.get(module)) if plan.tp_size > 1 else None
    fsdp = plan.uses_fsdp
    rows = []
    for rank in range(plan.world_size):
        dp_rank, tp_rank = divmod(rank, plan.tp_size)
        for leaf, shape in params:
            held = {}
            tp = style.held(leaf, shape, plan.tp_size, tp_rank) if style is not None else None
            if tp:
                held[tp[0]] = tp[1]
            if fsdp and plan.dp_size > 1 and shape:
                local = held.get(0, list(range(shape[0])))  # FSDP2 chunks dim 0 of the TP-local tensor
                chunk = -(-len(local) // plan.dp_size)
                part = local[dp_rank * chunk:(dp_rank + 1) * chunk]
                held[0] = part or f"{local[-1] + 1}:{local[-1] + 1}"  # a rank past the last chunk: empty
            rows.append((rank, dp_rank, tp_rank, leaf, "x".join(map(str, shape)), _text(held, shape)))
    return pd.DataFrame(rows, columns=LAYOUT_COLUMNS)
