"""Plain-data conversion of the core's frozen dataclasses (JSON-safe; never pickle)."""
from __future__ import annotations

import json
import reprlib
from dataclasses import fields
from types import MappingProxyType
from typing import Any, Mapping

_SCALARS = frozenset((str, int, float, bool, type(None)))


def to_plain(value: Any) -> Any:
    """Recursively turn tuples, mappings and objects with ``to_dict`` into JSON-safe data."""
    if type(value) in _SCALARS:  # exactly these types (no ``to_dict``): the common case, without the ABC checks
        return value
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, (Mapping, MappingProxyType)):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [to_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot serialise {type(value).__name__} value {value!r} to JSON")


def dataclass_dict(obj: Any, kind: str) -> dict:
    """``{"kind": kind, field: plain value, ...}`` for a dataclass instance."""
    data = {"kind": kind}
    for f in fields(obj):
        if not f.name.startswith("_"):
            data[f.name] = to_plain(getattr(obj, f.name))
    return data


def check_kind(data: Mapping[str, Any], kind: str) -> dict:
    """Validate the ``kind`` tag of serialised data and return a mutable copy without it."""
    if not isinstance(data, Mapping):
        raise TypeError(f"expected a mapping for {kind}, got {type(data).__name__}")
    found = data.get("kind", kind)
    if found != kind:
        raise ValueError(f"expected serialised {kind!r}, got kind={found!r}")
    out = dict(data)
    out.pop("kind", None)
    return out


def tuplify(value: Any) -> Any:
    """Lists (nested) back to tuples, for frozen fields read from JSON."""
    if isinstance(value, list):
        return tuple(tuplify(v) for v in value)
    return value


def dumps(obj: Any) -> str:
    return json.dumps(to_plain(obj), sort_keys=True)


def string_tuple(owner: str, name: str, value: Any, *, optional: bool = False) -> Any:
    """``value`` (a list or tuple of strings) as a tuple; a bare string is refused, not split."""
    if value is None and optional:
        return None
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{owner}.{name} must be a list of strings{' or None' if optional else ''}, got "
                        f"{type(value).__name__}: {reprlib.repr(value)}")
    for item in value:
        if not isinstance(item, str):
            raise TypeError(f"{owner}.{name} must hold strings only, got {type(item).__name__}: {reprlib.repr(item)}")
    return tuple(value)


def check_keys(data: Mapping[str, Any], kind: str, required: tuple, allowed: tuple) -> None:
    """Refuse serialised ``kind`` data that lacks a required key or has one the type does not know."""
    missing = [k for k in required if k not in data]
    unknown = sorted((str(k) for k in data if k not in allowed))
    if missing or unknown:
        problem = f"lacks the key(s) {missing}" if missing else f"has unknown key(s) {unknown}"
        raise ValueError(f"serialised {kind} {problem}; required: {list(required)}, accepted: {list(allowed)}")


def loads(text: str) -> Any:
    """``json.loads`` whose too-deep nesting is a ValueError, not a RecursionError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("the JSON is nested too deeply to parse (a plan or analysis nests a few levels "
                         "at most)") from None
