"""Tensor parallelism: the style of each layer, its torch implementation, and the per-layer TP plan."""

from .channel_styles import head_aligned_rows
from .styles import STYLES, TP_STYLES, TPStyle, style_of
from .tp_plan import check_tp_plan, default_tp_plan

__all__ = ["STYLES", "TPStyle", "TP_STYLES", "check_tp_plan", "default_tp_plan", "head_aligned_rows", "style_of"]
