"""Pickling what a rank runs: cloudpickle, keeping file names so remote tracebacks stay readable.

cloudpickle >= 3 renames the file of by-value code to ``<dynamic-code>``; here each code object
gets its real file name back on load (through ``operator.methodcaller``, so ranks import nothing
of ours), and source lines held only in memory (notebook cells) travel along for ``linecache``.
"""
from __future__ import annotations

import io
import linecache
import operator
import os
import types
from typing import Any, Dict, List, Tuple

import cloudpickle

from ..compat_elastic import CODE_REDUCE
from ..core.model import registered_stateful


class _Code:
    """Pickles as cloudpickle's own reconstruction of ``code`` (the loaded object is the code)."""

    def __init__(self, code: types.CodeType):
        self.code = code

    def __reduce__(self):
        return CODE_REDUCE(self.code)


class _Pickler(cloudpickle.Pickler):
    def __init__(self, file):
        super().__init__(file, protocol=cloudpickle.DEFAULT_PROTOCOL)
        self.filenames = set()

    def reducer_override(self, obj):
        if isinstance(obj, types.CodeType):
            self.filenames.add(obj.co_filename)
            return operator.methodcaller("replace", co_filename=obj.co_filename), (_Code(obj),)
        return super().reducer_override(obj)


def _memory_sources(filenames) -> Dict[str, List[str]]:
    """Source lines that exist only in this process's linecache (e.g. notebook cells)."""
    out = {}
    for name in filenames:
        if not os.path.exists(name):
            lines = linecache.getlines(name)
            if lines:
                out[name] = lines
    return out


def dumps(fn, args: Tuple, kwargs: Dict[str, Any]) -> bytes:
    """The payload a rank loads: ``(fn, args, kwargs, register_stateful registrations)`` and the
    in-memory sources."""
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    pickler.dump((fn, args, kwargs, registered_stateful()))
    return cloudpickle.dumps((buf.getvalue(), _memory_sources(pickler.filenames)))
