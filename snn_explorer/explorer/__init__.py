"""The notebook layer: the Explorer object, its tables, charts and ipywidgets UI over the core's plain data.

Only :class:`Explorer` loads eagerly; the table, chart and estimator modules (pandas, matplotlib)
load on first use, so ``import snn_explorer`` stays light on every launched rank.
"""
from importlib import import_module

from .explorer import Explorer

_LAZY = {
    "COMPARE_ROWS": "compare", "compare_table": "compare", "style_compare": "compare",
    "FIGSIZE": "charts", "comm_chart": "charts", "memory_chart": "charts", "mesh_chart": "charts",
    "pareto_chart": "charts", "pareto_front": "charts", "step_time_chart": "charts", "pipeline_chart": "pipeline_view",
    "shard_layout": "layout", "MODULE_COLUMNS": "modules", "candidates_table": "modules", "modules_table": "modules",
    "analysis_table": "tables", "plans_table": "tables",
}

__all__ = ["Explorer", *sorted(_LAZY)]


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
