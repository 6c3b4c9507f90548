"""Meta-device operator outputs remembered by what decides them: the operator and its arguments' metadata.

A meta tensor has no data, so an operator that mutates nothing and returns new storages (no alias of an
argument) gives outputs whose sizes, strides and dtypes follow from its arguments' sizes, strides, dtypes,
offsets and its other arguments alone. Many of torch's meta kernels are Python reference implementations
(``torch._refs``: 1-2 ms per call here), and a traced step runs the same operators at the same shapes on every
time step and in every estimate of the model: :class:`MetaOutputs` runs each such call once and afterwards
makes empty tensors of the remembered layout. An operator is remembered only after its first output has been
checked to be what an empty tensor of that layout is (offset 0, a storage of exactly that size, new storages
only); anything else (a view, an in-place operator, a symbolic size, an argument of an unknown type) runs as is.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ...compat import returns_fresh_tensors

#: Entries kept before the memo starts again (each holds a few tuples of ints).
MAX_ENTRIES = 65536
#: Plain argument types whose value (with its type: 1, 1.0 and True are different arguments) enters the key.
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _key_of(value: Any) -> Any:
    """A hashable key for one argument; None where the argument cannot be keyed."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "meta" or type(value) is not torch.Tensor or value.layout is not torch.strided:
            return None
        return ("T", tuple(value.shape), value.stride(), value.dtype, value.storage_offset())
    if isinstance(value, _PLAIN):
        return (type(value), value)
    if isinstance(value, (list, tuple)):
        keys = tuple(_key_of(v) for v in value)
        return None if any(k is None for k in keys) else (type(value), keys)
    if isinstance(value, dict):
        keys = tuple((k, _key_of(v)) for k, v in sorted(value.items()))
        return None if any(k is None for _, k in keys) else ("D", keys)
    return None


def _layout_of(out: Any, inputs: set) -> Any:
    """The remembered form of an output: its tensors as (sizes, strides, dtype); None where an empty tensor of
    that layout would differ from it (an offset, a larger storage, an input's storage, two outputs sharing one)."""
    if isinstance(out, torch.Tensor):
        if type(out) is not torch.Tensor or out.device.type != "meta" or out.layout is not torch.strided \
                or out.storage_offset() != 0:
            return None
        st = out.untyped_storage()
        if id(st) in inputs:
            return None
        inputs.add(id(st))
        shape, stride = tuple(out.shape), out.stride()
        twin = torch.empty_strided(shape, stride, dtype=out.dtype, device="meta")
        return ("T", shape, stride, out.dtype) if twin.untyped_storage().nbytes() == st.nbytes() else None
    if isinstance(out, (list, tuple)):
        parts = [_layout_of(o, inputs) for o in out]
        return None if any(p is None for p in parts) else (type(out), tuple(parts))
    return ("V", out) if isinstance(out, _PLAIN) else None


def _made(layout: Any) -> Any:
    kind, *rest = layout
    if kind == "T":
        shape, stride, dtype = rest
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    if kind == "V":
        return rest[0]
    return kind(_made(part) for part in rest[0])


def _input_storages(value: Any, into: set) -> set:
    if isinstance(value, torch.Tensor):
        into.add(id(value.untyped_storage()))
    elif isinstance(value, (list, tuple)):
        for v in value:
            _input_storages(v, into)
    elif isinstance(value, dict):
        for v in value.values():
            _input_storages(v, into)
    return into


class MetaOutputs:
    """Runs meta operators, each call with new metadata once (module doc); the same memo serves every trace."""

    def __init__(self):
        self._layouts: dict = {}
        self._fresh: dict = {}  # operator -> whether it may be remembered (its schema, read once)
        self.hits = 0

    def key(self, func, args, kwargs) -> Optional[tuple]:
        """The memo's key of one call, None where it is not remembered."""
        fresh = self._fresh.get(func)
        if fresh is None:
            fresh = self._fresh[func] = func.namespace == "aten" and not func.is_view and returns_fresh_tensors(func)
        keyed = _key_of((args, kwargs)) if fresh else None
        return None if keyed is None else (func, torch.get_default_dtype(), keyed)

    def run(self, func, args, kwargs) -> Any:
        """``func(*args, **kwargs)``, or new empty tensors of its remembered outputs' layout."""
        key = self.key(func, args, kwargs)
        layout = self._layouts.get(key, False) if key is not None else None
        if layout:
            self.hits += 1
            return _made(layout)
        out = func(*args, **kwargs)
        if key is not None and layout is False:
            if len(self._layouts) >= MAX_ENTRIES:
                self._layouts.clear()
            self._layouts[key] = _layout_of(out, _input_storages((args, kwargs), set()))
        return out


#: The process's memo (outputs depend on the call alone, so every trace shares it).
META_OUTPUTS = MetaOutputs()
