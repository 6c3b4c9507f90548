"""Argument checks shared by every layer: one message shape, the bad value named."""
from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, Optional


def positive_int(name: str, value: Any, *, maximum: Optional[int] = None, what: str = "") -> int:
    """``value`` if it is an int >= 1 (bools refused), else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int{_what(what)}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={value!r} is above the largest supported value {maximum}{_what(what)}")
    return int(value)


def positive_number(name: str, value: Any, *, what: str = "", allow_none: bool = False) -> Optional[float]:
    """``value`` if it is a finite real number > 0 (bools and NaN refused), else ValueError."""
    if value is None and allow_none:
        return None
    ok = (not isinstance(value, bool) and isinstance(value, numbers.Real)
          and math.isfinite(value) and value > 0)
    if not ok:
        tail = " or None" if allow_none else ""
        raise ValueError(f"{name}={value!r} must be a finite positive number{_what(what)}{tail}")
    return float(value)


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


#: Default of a deprecated keyword: tells "not given" from any value.
UNSET = _Unset()


def renamed_keyword(name: str, value: Any, default: Any, old_name: str, old_value: Any, what: str = "") -> Any:
    """``value`` of keyword ``name``, or that of its deprecated old name (with a DeprecationWarning)."""
    if old_value is UNSET:
        return value
    if value != default:
        raise TypeError(f"give {name}={value!r} or the deprecated {old_name}={old_value!r}, not both")
    warnings.warn(f"the keyword {old_name}= is deprecated; use {name}={_what(what)}", DeprecationWarning,
                  stacklevel=3)
    return old_value


def _what(what: str) -> str:
    return f" ({what})" if what else ""
