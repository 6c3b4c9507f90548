"""The notebook layer: the Explorer object, its tables, charts and ipywidgets UI over the core's plain data."""
from .charts import FIGSIZE, comm_chart, memory_chart, mesh_chart, pareto_chart, pareto_front
from .compare import COMPARE_ROWS, compare_table, style_compare
from .explorer import Explorer
from .layout import shard_layout
from .modules import MODULE_COLUMNS, candidates_table, modules_table
from .tables import analysis_table, plans_table

__all__ = ["COMPARE_ROWS", "FIGSIZE", "MODULE_COLUMNS", "Explorer", "analysis_table", "candidates_table",
           "comm_chart", "compare_table", "memory_chart", "mesh_chart", "modules_table", "pareto_chart",
           "pareto_front", "plans_table", "shard_layout", "style_compare"]
