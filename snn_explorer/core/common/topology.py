"""Named device-mesh dimensions: validation and ordering."""
from __future__ import annotations

import math
import numbers
import reprlib
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Optional

from .validate import positive_int

#: Dimension names that lead the mesh order (the dims the modes use), outermost first: pipeline
#: stages, then data replicas, then tensor-parallel peers innermost (neighbouring ranks, as
#: torchtitan orders them); others follow in insertion order.
LEADING_DIMS = ("pp", "dp", "tp")
#: The most ranks a topology may have: estimates, plans and meshes are sized for at most this many.
MAX_WORLD_SIZE = 2 ** 16


def _as_size(name: str, value: Any) -> int:
    """Return ``value`` as a positive int, accepting integral floats such as ``2.0``."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, float)):
        raise TypeError(
            f"topology dim {name!r} has size {value!r} of type {type(value).__name__}; "
            "expected a positive int (integral floats like 2.0 are accepted)"
        )
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ValueError(f"topology dim {name!r} has non-integral size {value!r}; expected a positive int")
        value = int(value)
    value = int(value)
    if value <= 0:
        raise ValueError(f"topology dim {name!r} has size {value}; sizes must be >= 1")
    return value


@dataclass(frozen=True)
class SNNDistributedTopology:
    """Named mesh dimensions (e.g. ``{"dp": 2, "tp": 2}``) whose sizes multiply to ``world_size``."""
    world_size: int
    _items: tuple = ()

    def __init__(self, dims: Mapping[str, Any], world_size: Optional[int] = None):
        if not isinstance(dims, Mapping):
            raise TypeError(f"topology dims must be a mapping name -> size, got {type(dims).__name__}: {dims!r}")
        if not dims:
            raise ValueError("topology dims are empty; give at least one dim, e.g. {'dp': 1}")
        items = []
        for name, size in dims.items():
            if not isinstance(name, str):
                raise TypeError(f"topology dim names must be strings, got {name!r} ({type(name).__name__})")
            if not name.strip():
                raise ValueError(f"topology dim names must be non-empty, got {name!r}")
            items.append((name, _as_size(name, size)))
        product = math.prod(size for _, size in items)
        if product > MAX_WORLD_SIZE:
            raise ValueError(f"topology dims {dict(items)} make {product} ranks, more than the largest supported "
                             f"world size MAX_WORLD_SIZE={MAX_WORLD_SIZE}")
        if world_size is None:
            world_size = product
        else:
            world_size = _as_size("world_size", world_size)
            if world_size != product:
                raise ValueError(
                    f"topology dims {dict(items)} multiply to {product}, but world_size={world_size}"
                )
        object.__setattr__(self, "world_size", world_size)
        object.__setattr__(self, "_items", tuple(items))

    @classmethod
    def from_mapping(cls, dims: Mapping[str, Any], world_size: Optional[int] = None) -> "SNNDistributedTopology":
        """Build a topology from ``{name: size}``; the world size defaults to the product of sizes."""
        return cls(dims, world_size)

    @classmethod
    def coerce(cls, value: Any) -> "SNNDistributedTopology":
        """Accept a topology, a mapping, or an int world size (a pure ``dp`` topology)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return cls({"dp": value})
        return cls(value)

    @property
    def dims(self) -> Mapping[str, int]:
        """Read-only mapping name -> size, in the order given."""
        return MappingProxyType(dict(self._items))

    @property
    def ordered_dim_names(self) -> tuple:
        names = [name for name, _ in self._items]
        lead = [n for n in LEADING_DIMS if n in names]
        return tuple(lead + [n for n in names if n not in LEADING_DIMS])

    @property
    def mesh_shape(self) -> tuple:
        dims = dict(self._items)
        return tuple(dims[n] for n in self.ordered_dim_names)

    def size(self, name: str) -> int:
        """Size of dim ``name``, 1 when the dim is absent."""
        return dict(self._items).get(name, 1)

    def to_dict(self) -> dict:
        return {"dims": dict(self._items), "world_size": self.world_size}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SNNDistributedTopology":
        if not isinstance(data, Mapping):
            raise TypeError(f"a serialised topology must be a mapping {{'dims': ..., 'world_size': ...}}, "
                            f"got {type(data).__name__}: {reprlib.repr(data)}")
        extra = sorted(set(data) - {"dims", "world_size"}, key=str)
        if "dims" not in data or extra:
            problem = f"has unknown key(s) {extra}" if extra else "lacks the key 'dims'"
            raise ValueError(f"serialised topology {problem}; expected the keys 'dims' (name -> size) and "
                             "optionally 'world_size'")
        return cls(data["dims"], data.get("world_size"))

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in self._items)
        return f"SNNDistributedTopology({dims}; world_size={self.world_size})"


def dp_tp_splits(world_size: int) -> List[Dict[str, int]]:
    """Every way to split ``world_size`` ranks into dp x tp, tp ascending, size-1 dims left out
    (``[{"dp": 4}, {"dp": 2, "tp": 2}, {"tp": 4}]`` for 4; ``[{"dp": 1}]`` for 1)."""
    world_size = positive_int("world_size", world_size)
    out = []
    for tp in range(1, world_size + 1):
        if world_size % tp == 0:
            dims = {n: s for n, s in (("dp", world_size // tp), ("tp", tp)) if s > 1}
            out.append(dims or {"dp": 1})
    return out
