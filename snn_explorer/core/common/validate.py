"""Argument checks shared by every layer: one message shape, the bad value named."""
from __future__ import annotations

import math
import numbers
import reprlib
import warnings
from typing import Any, Optional

import torch


def positive_int(name: str, value: Any, *, maximum: Optional[int] = None, what: str = "") -> int:
    """``value`` if it is an int >= 1 (bools refused), else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int{_what(what)}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={value!r} is above the largest supported value {maximum}{_what(what)}")
    return int(value)


def non_negative_int(name: str, value: Any, *, what: str = "") -> int:
    """``value`` if it is an int >= 0 (bools refused), else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative int{_what(what)}")
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


def check_dtype(name: str, value: Any) -> Optional[Any]:
    """``value`` if it is None or a floating-point ``torch.dtype`` (not a string), else TypeError."""
    if value is None or (isinstance(value, torch.dtype) and value.is_floating_point):
        return value
    hint = f"; write torch.{value}" if isinstance(value, str) and hasattr(torch, value) else ""
    raise TypeError(f"{name}={value!r} must be a floating-point torch.dtype such as torch.float32, "
                    f"or None{hint}")


def check_instance(name: str, value: Any, cls: type, what: str) -> Any:
    """``value`` if it is an instance of ``cls``, else TypeError naming its type and ``what`` is accepted."""
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}: {reprlib.repr(value)}")
    return value


def check_batch_tensor(name: str, value: Any, *, min_dims: int = 3):
    """A real tensor ``[T, N, ...]`` (time first, then batch) with T, N >= 1 and no grad, else an error."""
    if not isinstance(value, torch.Tensor):
        hint = " (convert it with torch.as_tensor)" if hasattr(value, "__len__") else ""
        raise TypeError(f"{name} must be a torch.Tensor [T, N, ...] (time first, then batch), got "
                        f"{type(value).__name__}{hint}")
    shape = tuple(value.shape)
    if value.device.type == "meta":
        raise ValueError(f"{name} is on the meta device (shape {shape}); give a tensor with data (CPU is fine)")
    if value.dim() < min_dims:
        raise ValueError(f"{name} has shape {shape}; expected [T, N, features...] with at least {min_dims} dims "
                         "(time first, then batch)")
    empty = [f"{label}={size}" for label, size in zip(("T", "N") + ("features",) * (len(shape) - 2), shape) if size < 1]
    if empty:
        raise ValueError(f"{name} of shape {shape} is empty ({', '.join(empty)}); every dim must be >= 1")
    if value.requires_grad:
        raise ValueError(f"{name} requires grad; pass {name}.detach() (an input batch is not a parameter)")
    return value
