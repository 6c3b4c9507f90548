"""The notebook layer: the Explorer object, its tables, charts and ipywidgets UI over the core's plain data.

It loads pandas, matplotlib, ipywidgets and the estimator when imported; ``import snn_explorer``
stays light on every launched rank because ``snn_explorer.Explorer`` imports this package on first use.
"""
from .charts import FIGSIZE, comm_chart, memory_chart, mesh_chart, pareto_chart, pareto_front, step_time_chart
from .compare import COMPARE_ROWS, compare_table, style_compare
from .explorer import Explorer
from .layout import shard_layout
from .modules import MODULE_COLUMNS, candidates_table, modules_table
from .pipeline_view import pipeline_chart
from .tables import analysis_table, plans_table

__all__ = ["COMPARE_ROWS", "Explorer", "FIGSIZE", "MODULE_COLUMNS", "analysis_table", "candidates_table",
           "comm_chart", "compare_table", "memory_chart", "mesh_chart", "modules_table", "pareto_chart",
           "pareto_front", "pipeline_chart", "plans_table", "shard_layout", "step_time_chart", "style_compare"]
