"""The module tree as a DataFrame: what each module is, holds, and gets under a TP layout."""
from __future__ import annotations

from typing import Mapping, Optional

import pandas as pd
from torch import nn

from ..core import SNNDistributedAnalysis
from ..core.model import CONV_TYPES, state_description
from ..core.tp import STYLES

MODULE_COLUMNS = ("path", "type", "depth", "params", "stateful", "snn_library", "state", "tp_candidate", "tp_style",
                  "sharded_dim", "not_candidate_because")


def _why_not(module: nn.Module, path: str, candidates: set, convs: set, roots_note: str) -> str:
    if path in candidates:
        return ""
    if path in convs:
        return "convolution: channel TP needs allow_experimental_conv_tp=True"
    if isinstance(module, nn.Linear):
        return f"outside the TP roots {roots_note}"
    if isinstance(module, CONV_TYPES):
        return f"outside the TP roots {roots_note}"
    return "not a Linear layer"


def _divisibility(analysis: SNNDistributedAnalysis, path: str, style: str, tp_size: int) -> str:
    """Which size of ``path`` its ``style`` cannot split over ``tp_size`` ranks ('' when all divide)."""
    if tp_size <= 1 or style not in STYLES:
        return ""
    if STYLES[style].kind_problem(analysis, path):
        return STYLES[style].kind_problem(analysis, path)
    bad = [(attr, size) for _, attr, size in STYLES[style].sizes(analysis, path) if size % tp_size]
    return f"tp={tp_size} does not divide {bad[0][0]}={bad[0][1]}" if bad else ""


def modules_table(model: nn.Module, analysis: SNNDistributedAnalysis,
                  tp_plan: Optional[Mapping[str, str]] = None, tp_size: int = 1) -> pd.DataFrame:
    """One row per module (the root excluded), in ``named_modules`` order.

    ``params`` counts the module's own parameters (not its children's); ``state`` says which
    state a module keeps between calls and where it lives (``stateful`` modules are reset before
    every batch; a membrane passed by the model's forward needs no reset). ``tp_style`` and
    ``sharded_dim`` come from ``tp_plan`` (path -> style); ``not_candidate_because`` says why a
    module is not a TP candidate, or which size ``tp_size`` fails to divide.
    """
    tp_plan = dict(tp_plan or {})
    library = dict(analysis.snn_libraries)
    candidates = set(analysis.tensor_parallel_candidate_names)
    convs = set(analysis.unsupported_tensor_parallel_names)
    roots_note = str(list(analysis.tensor_parallel_roots or ()))
    rows = []
    for path, module in model.named_modules():
        if not path:
            continue
        style = tp_plan.get(path, "")
        why = _why_not(module, path, candidates, convs, roots_note)
        if path in candidates or style:
            why = _divisibility(analysis, path, style, tp_size)
        rows.append((path, type(module).__name__, path.count(".") + 1,
                     sum(p.numel() for p in module.parameters(recurse=False)), path in library,
                     library.get(path, ""), state_description(module), path in candidates, style, STYLES[style].label if style in STYLES else "", why))
    return pd.DataFrame(rows, columns=MODULE_COLUMNS)


def candidates_table(modules: pd.DataFrame) -> pd.DataFrame:
    """The TP candidates of a :func:`modules_table`, renumbered from 0."""
    return modules[modules["tp_candidate"]].reset_index(drop=True)
