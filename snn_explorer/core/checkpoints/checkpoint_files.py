"""A checkpoint directory on disk: its manifest, the checks that it is complete and safe to read,
the atomic publication of a finished write, and a run's directory of step checkpoints.

Nothing here unpickles with plain ``pickle``: DCP's ``.metadata`` is read by
:func:`snn_explorer.compat_dcp.read_dcp_metadata`, which resolves only DCP's metadata classes.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Dict, Optional, Tuple

from ...compat_dcp import UnsafeCheckpointError, read_dcp_metadata
from ..planning.plan_types import SNNDistributedPlan
from ..tp.styles import STYLES
from .checkpoint_integrity import CheckpointError, check_fields, default_hash, file_table, open_entry, verify_files

FORMAT = "snn_explorer.checkpoint"
#: 2: every file's size and checksum (``files``: name -> {"size", "hash"}, ``hash_algorithm``) and ``finite``.
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
DCP_METADATA = ".metadata"
PARTIAL_SUFFIX = ".partial"
STEP_PREFIX = "step-"


# ---- write --------------------------------------------------------------------------------------------
def partial_path(path: Path) -> Path:
    """The hidden sibling a checkpoint is written into before it is renamed to ``path``."""
    return path.parent / f".{path.name}{PARTIAL_SUFFIX}"


def check_target(path: Path, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise CheckpointError(f"{path} already exists; pass overwrite=True to replace it (or choose another path)")
    if path.exists() and not (path / MANIFEST).is_file():
        raise CheckpointError(f"{path} exists and is not a checkpoint (no {MANIFEST}); refusing to replace it")
    if path.parent.exists() and not path.parent.is_dir():
        raise CheckpointError(f"the parent {path.parent} of the checkpoint is a file, not a directory")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_manifest(tmp: Path, manifest: dict) -> None:
    manifest["hash_algorithm"] = default_hash()
    manifest["files"] = file_table(tmp, manifest["hash_algorithm"])
    with open(tmp / MANIFEST, "w") as fh:
        json.dump(manifest, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())


def publish(tmp: Path, path: Path, manifest: dict) -> None:
    """Rank 0, after every rank wrote its shards: add the manifest, then move the finished
    directory into place (a rename: ``path`` is either the old checkpoint or the new one)."""
    _write_manifest(tmp, manifest)
    _fsync_dir(tmp)
    old = path.parent / f".{path.name}.replaced"
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
    tmp.rename(path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


# ---- read and check -----------------------------------------------------------------------------------
def _load_manifest(path: Path) -> dict:
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: the directory does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a checkpoint directory")
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise CheckpointError(f"{path} is not a complete snn_explorer checkpoint: it has no {MANIFEST} "
                              "(an unfinished write, or another program's directory)")
    try:
        with os.fdopen(open_entry(manifest_file), "rb") as fh:
            manifest = json.loads(fh.read())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{manifest_file} is not readable JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_file} is not an snn_explorer checkpoint manifest "
                              f"(format={manifest.get('format') if isinstance(manifest, dict) else None!r}, "
                              f"expected {FORMAT!r})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {manifest.get('format_version')!r}; this "
                              f"snn_explorer reads version {FORMAT_VERSION} (version 1 recorded no checksums: "
                              "load it with the snn_explorer that wrote it and save it again)")
    check_fields(manifest, path)
    return manifest


def read_manifest(path, verify: bool = True, share: Optional[Tuple[int, int]] = None) -> dict:
    """The manifest of the checkpoint at ``path``, after checking that the directory is a complete
    checkpoint of this format: every manifest field of its type, every file present, a regular
    file of the folder (no symlink) of its recorded size and (``verify``) checksum, and DCP
    metadata holding only tensor metadata (read without running code). ``share=(i, n)`` checksums
    every ``n``-th file from ``i`` only (the ranks of a load split the work). No process group needed."""
    path = Path(path)
    manifest = _load_manifest(path)
    files = manifest["files"]
    if DCP_METADATA not in files:
        raise CheckpointError(f"checkpoint {path} lists no {DCP_METADATA} file; it was not written by save_checkpoint")
    verify_files(path, files, manifest["hash_algorithm"], share if verify else (0, 0))
    saved_tensor_metadata(path, files)
    return manifest


def saved_tensor_metadata(path: Path, files: Optional[dict] = None) -> Dict[str, object]:
    """DCP key -> TensorStorageMetadata of the checkpoint at ``path``, read safely; every storage
    file it points at must be one the manifest lists (``files``)."""
    try:
        metadata = read_dcp_metadata(Path(path) / DCP_METADATA)
    except (UnsafeCheckpointError, OSError) as exc:
        raise CheckpointError(f"checkpoint {path} refused: {exc}") from None
    if files is not None:
        unlisted = sorted({i.relative_path for i in metadata.storage_data.values()} - set(files))
        if unlisted:
            raise CheckpointError(f"checkpoint {path} refused: its {DCP_METADATA} points at {unlisted[:3]}, which "
                                  f"{MANIFEST} does not list")
    return dict(metadata.state_dict_metadata)


def model_mismatch(manifest: dict, shapes: Dict[str, Tuple[Tuple[int, ...], str]]) -> Optional[str]:
    """Why the checkpoint's tensors are not this model's (None when path, shape and dtype all agree)."""
    saved = {p: (tuple(t["shape"]), t["dtype"]) for p, t in manifest["tensors"].items()}
    missing = sorted(set(shapes) - set(saved))
    unknown = sorted(set(saved) - set(shapes))
    differ = [f"{p}: checkpoint {saved[p][0]} {saved[p][1]}, model {shapes[p][0]} {shapes[p][1]}"
              for p in shapes if p in saved and saved[p] != shapes[p]]
    parts = []
    if missing:
        parts.append(f"tensors of the model not in the checkpoint: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unknown:
        parts.append(f"tensors in the checkpoint not in the model: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    if differ:
        parts.append("shapes or dtypes differ: " + "; ".join(differ[:5]) + (" ..." if len(differ) > 5 else ""))
    return ("the checkpoint is of another model: " + "; ".join(parts)) if parts else None


def reshard_problem(manifest: dict, plan: SNNDistributedPlan) -> Optional[str]:
    """Why ``plan`` cannot hold the checkpoint's tensors (a TP split that does not divide a saved
    dim); None when it can. Plan time: no process group needed."""
    tensors = manifest["tensors"]
    for module_path, style_name in plan.tensor_parallel_plan.items():
        for name, dim in STYLES[style_name].split.items():
            saved = tensors.get(f"{module_path}.{name}" if module_path else name)
            if saved and saved["shape"] and saved["shape"][dim] % plan.tp_size:
                return (f"the plan's tp={plan.tp_size} cannot reshard {module_path}.{name} of shape "
                        f"{tuple(saved['shape'])} (dim {dim} is not divisible by {plan.tp_size})")
    return None


# ---- a directory of step checkpoints --------------------------------------------------------------------
def step_path(directory, step: int) -> Path:
    """Where a run's checkpoint of ``step`` lives in ``directory``: ``step-000042``."""
    return Path(directory) / f"{STEP_PREFIX}{step:06d}"


def latest_checkpoint(directory, verify: bool = True) -> Optional[Path]:
    """The checkpoint of the highest step in ``directory`` whose weights are finite; None if none.
    Unfinished writes (hidden ``.partial`` directories, a step directory without manifest) are
    never taken, nor one saved with non-finite values (``allow_non_finite=True``: passed over for
    the one before). A step directory whose manifest is there but whose files are damaged (size,
    ``verify``: checksum) or unsafe raises CheckpointError naming it (it is not passed over for an
    older one in silence)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    steps = sorted((p for p in directory.iterdir() if p.name.startswith(STEP_PREFIX)
                    and p.name[len(STEP_PREFIX):].isdigit() and (p / MANIFEST).is_file()),
                   key=lambda p: int(p.name[len(STEP_PREFIX):]))
    for candidate in reversed(steps):
        if read_manifest(candidate, verify=verify)["finite"]:
            return candidate
    return None
