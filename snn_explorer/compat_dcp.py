"""DCP's ``.metadata`` read without running code from it: the private torch names of checkpoint loading.

torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle.load``: a
crafted file runs any callable it names. The unpickler here resolves only the classes DCP writes
for tensor checkpoints and torch's dtypes; anything else is refused, before it is built.
``BytesStorageMetadata`` is refused too: torch reads a "bytes" entry with
``torch.load(weights_only=False)``. Checked at import like :mod:`.compat`.
"""
from __future__ import annotations

import collections as _collections
import io as _io
import pickle as _pickle
import re as _re
from pathlib import PurePath as _PurePath
from typing import Any

import torch
import torch.distributed.checkpoint as _dcp
from torch.distributed.checkpoint import metadata as _dcp_metadata

from .compat import _require

_DCP_STORAGE_INFO = _require("torch.distributed.checkpoint.filesystem", "_StorageInfo")
_METADATA_NAMES = ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                   "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
#: (module, name) -> the object a DCP metadata pickle may name; nothing else resolves.
_METADATA_GLOBALS = {("torch.distributed.checkpoint.metadata", n): _require("torch.distributed.checkpoint.metadata",
                                                                              n, callable_=False)
                     for n in _METADATA_NAMES}
_METADATA_GLOBALS.update({
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _DCP_STORAGE_INFO,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _require("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"): _PurePath, ("pathlib", "WindowsPath"): _PurePath,
    ("pathlib", "PurePosixPath"): _PurePath, ("pathlib", "PureWindowsPath"): _PurePath,
    ("collections", "OrderedDict"): _collections.OrderedDict,
})


class UnsafeCheckpointError(_pickle.UnpicklingError):
    """A checkpoint file names something that is not checkpoint data; it was not loaded."""


class _MetadataUnpickler(_pickle.Unpickler):
    """Resolves only the names of :data:`_METADATA_GLOBALS` and torch's dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        found = _METADATA_GLOBALS.get((module, name))
        if found is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            found = getattr(torch, name)
        if found is None:
            raise UnsafeCheckpointError(
                f"it names {module}.{name}, which is not a class of DCP tensor metadata; refused before anything "
                "was built (a pickle calls whatever it names)")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError("it holds a persistent reference, which DCP metadata never does")


def read_dcp_metadata(file) -> Any:
    """DCP's ``Metadata`` from ``file`` (a path), unpickled with :class:`_MetadataUnpickler` and checked:
    every entry a tensor, every storage a plain file name in the same folder. Raises
    :class:`UnsafeCheckpointError` saying why otherwise."""
    where = str(file)
    with open(file, "rb") as fh:
        data = fh.read()
    try:
        metadata = _MetadataUnpickler(_io.BytesIO(data)).load()
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{where} was not loaded: {exc}") from None
    except Exception as exc:  # a damaged pickle: any error the unpickler meets
        raise UnsafeCheckpointError(f"{where} is not readable DCP metadata ({type(exc).__name__}: {exc})") from None
    _check_metadata(where, metadata)
    return metadata


def _check_metadata(where: str, metadata: Any) -> None:
    if not isinstance(metadata, _dcp_metadata.Metadata):
        raise UnsafeCheckpointError(f"{where} holds a {type(metadata).__name__}, not DCP Metadata")
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(entries, dict) or not all(isinstance(v, _dcp_metadata.TensorStorageMetadata)
                                                for v in entries.values()):
        raise UnsafeCheckpointError(f"{where} describes entries that are not tensors (snn_explorer checkpoints hold "
                                    "tensors only)")
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise UnsafeCheckpointError(f"{where} has no storage table")
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(info, _DCP_STORAGE_INFO) or not isinstance(name, str) or "/" in name or "\\" in name \
                or name in ("", ".", "..") or not name.endswith(".distcp"):
            raise UnsafeCheckpointError(f"{where} points at storage {name!r}, not a .distcp file of its own folder")


#: torch's ``weights_only`` refusal, from its first words to its closing link (its advice in between).
_TORCH_REFUSAL = _re.compile(r"Weights only load failed\..*?(torch\.load\.html\.?|$)", _re.DOTALL)
_ADVICE_LINE = _re.compile(r"^.*(weights_only`? (set to `?False|=False)|safe_globals).*$\n?", _re.MULTILINE)


def without_unsafe_advice(text: str) -> str:
    """``text`` (an error message that may quote torch's ``weights_only`` refusal) without torch's
    advice to retry with ``weights_only=False`` or to allow-list the global: either would run the
    code the file names. What the file named (``posix.system``) is kept."""
    def refusal(match) -> str:
        named = _re.search(r"GLOBAL (\S+)", match.group(0))
        what = f"it names {named.group(1)}, which is not tensor data" if named else "it is not plain tensor data"
        return f"Weights only load failed: {what}; nothing in it was run or loaded"
    return _ADVICE_LINE.sub("", _TORCH_REFUSAL.sub(refusal, text))


class SafeFileSystemReader(_dcp.FileSystemReader):
    """torch's FileSystemReader with :func:`read_dcp_metadata` in place of ``pickle.load``. Tensors
    themselves are read by torch with ``torch.load(weights_only=True)`` (no code runs)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("rank") is not None:
            raise UnsafeCheckpointError("per-rank DCP metadata is not part of snn_explorer checkpoints")
        metadata = read_dcp_metadata(_PurePath(str(self.path)) / ".metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = _dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata
