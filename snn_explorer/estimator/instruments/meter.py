"""StorageMeter: live tensor-storage bytes and their peak, per dispatched op, in O(outputs) each.

Counts like torch's ``MemTracker`` on CPU (each untyped storage once, ``size * element_size``,
released when the storage object is freed) but keeps only the total and its peak: MemTracker also
updates a peak per tracked module on every op, which makes a step cost O(ops x modules) and the
profile of a 10 000-module model take minutes. ``tests/unit/test_estimate_meter.py`` checks that both
report the same peak.
"""
from __future__ import annotations

import weakref
from typing import Dict, Iterable

import torch

from ...compat import DispatchMode, is_traceable_wrapper_subclass_type, tree_leaves


class StorageMeter(DispatchMode):
    """Use as a context manager; ``track`` tensors that exist before it (parameters, inputs)."""

    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._bytes: Dict[int, int] = {}  # id(storage) -> bytes counted
        self._refs: Dict[int, weakref.ref] = {}

    def track(self, tensors: Iterable) -> None:
        """Count the storages of ``tensors`` (already allocated) as live memory."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._see(t)
        self.peak = max(self.peak, self.current)

    def restart_peak(self) -> int:
        """The peak so far; the peak then restarts from the current bytes."""
        peak, self.peak = self.peak, self.current
        return peak

    def _see(self, t: torch.Tensor) -> None:
        if t.device.type == "meta" or not hasattr(t, "untyped_storage"):
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. sparse)
            return
        key, nbytes = id(st), st.nbytes()
        old = self._bytes.get(key)
        if old is None:
            self._refs[key] = weakref.ref(st, lambda _, k=key: self._free(k))
        self._bytes[key] = nbytes
        self.current += nbytes - (old or 0)

    def _free(self, key: int) -> None:
        self.current -= self._bytes.pop(key, 0)
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # let subclasses (DTensor) desugar to local ops first
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._see(t)
        if self.current > self.peak:
            self.peak = self.current
        return out
