"""Model-family knowledge as data: family names, FSDP2 shard units."""
from .families import FAMILIES, fsdp_units, resolve_family

__all__ = ["FAMILIES", "resolve_family", "fsdp_units"]
