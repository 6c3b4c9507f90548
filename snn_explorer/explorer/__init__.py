"""The notebook layer: tables (and, later, widgets and charts) over the core's plain data."""
from .tables import analysis_table, plans_table

__all__ = ["analysis_table", "plans_table"]
