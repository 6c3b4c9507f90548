"""What makes a checkpoint directory trustworthy before any byte of it is used: every file's
checksum and size, no entry reached through a symlink or lying outside the folder, and every
manifest field of the type the reader expects (checked before it is read, as safetensors checks
its header). No process group needed; a caller may split the files among ranks (``share``).

Checksums are BLAKE2b (``hashlib``, 128-bit digests), or xxHash's XXH3-128 when the ``xxhash``
package is installed (several times faster on large shards); the manifest records which, and a
reader without ``xxhash`` refuses an xxHash checkpoint saying so.
"""
from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple


class CheckpointError(ValueError):
    """A directory that is not a complete checkpoint of this model, or one that cannot be written."""

try:  # optional: a faster non-cryptographic hash for large checkpoints
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None

#: Bytes read per call while hashing a file.
CHUNK = 1 << 22
HASHES: Dict[str, Callable[[], Any]] = {"blake2b-128": lambda: hashlib.blake2b(digest_size=16)}
if _xxhash is not None:  # pragma: no cover - depends on the environment
    HASHES["xxh3-128"] = _xxhash.xxh3_128


def default_hash() -> str:
    """The algorithm new checkpoints record: xxHash when installed, else BLAKE2b."""
    return "xxh3-128" if "xxh3-128" in HASHES else "blake2b-128"


def open_entry(path: Path) -> int:
    """An open descriptor of the regular file ``path``, never through a symlink (refused)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        if path.is_symlink():
            raise CheckpointError(f"checkpoint {path.parent} refused: {path.name} is a symlink (to "
                                  f"{os.readlink(path)!r}); a checkpoint holds its own files only") from None
        raise CheckpointError(f"checkpoint {path.parent}: cannot open {path.name} ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"checkpoint {path.parent} refused: {path.name} is not a regular file")
    return fd


def file_digest(path: Path, algorithm: str) -> Tuple[int, str]:
    """``(size, hex digest)`` of the regular file ``path`` (opened without following a symlink)."""
    if algorithm not in HASHES:
        need = " (pip install xxhash)" if algorithm.startswith("xxh") else ""
        raise CheckpointError(f"checkpoint {path.parent} is checksummed with {algorithm!r}, which this "
                              f"installation cannot compute{need}; it knows {sorted(HASHES)}")
    hasher, size = HASHES[algorithm](), 0
    with os.fdopen(open_entry(path), "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            hasher.update(block)
            size += len(block)
    return size, hasher.hexdigest()


def file_table(directory: Path, algorithm: str) -> Dict[str, Dict[str, Any]]:
    """``name -> {"size", "hash"}`` of every regular file directly in ``directory`` (a freshly
    written checkpoint: a symlink or a sub-folder there is an error)."""
    out = {}
    for entry in sorted(directory.iterdir()):
        size, digest = file_digest(entry, algorithm)
        out[entry.name] = {"size": size, "hash": digest}
    return out


def inside(directory: Path, name: Any) -> Path:
    """``directory / name`` for a plain file name of the folder; CheckpointError for anything else
    (a path, ``..``, a symlink, a missing file)."""
    if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name or "\\" in name:
        raise CheckpointError(f"checkpoint {directory} refused: its manifest lists {name!r}, which is not a file "
                              "name of the checkpoint's own folder")
    file = directory / name
    if file.is_symlink():
        raise CheckpointError(f"checkpoint {directory} refused: {name} is a symlink (to {os.readlink(file)!r}); a "
                              "checkpoint holds its own files only")
    if not file.is_file():
        raise CheckpointError(f"checkpoint {directory} is incomplete: {name} is missing")
    return file


def verify_files(directory: Path, files: Dict[str, dict], algorithm: str,
                 share: Optional[Tuple[int, int]] = None) -> None:
    """Every listed file present, a regular file of ``directory``, of its recorded size; and, for
    the files of ``share = (index, count)`` (every ``count``-th from ``index``; all without it),
    of its recorded checksum (``(0, 0)``: none). CheckpointError naming the first file that differs."""
    for i, (name, entry) in enumerate(sorted(files.items())):
        file = inside(directory, name)
        size = file.lstat().st_size
        if size != entry["size"]:
            raise CheckpointError(f"checkpoint {directory} is damaged: {name} has {size} bytes, the manifest says "
                                  f"{entry['size']} (truncated or modified)")
        if share is None or (share[1] > 0 and i % share[1] == share[0]):
            _, digest = file_digest(file, algorithm)
            if digest != entry["hash"]:
                raise CheckpointError(f"checkpoint {directory} is damaged: {name} does not match its {algorithm} "
                                      f"checksum (its bytes changed after the save: a disk or copy error, or an "
                                      "edit); restore it or use an older checkpoint")


# ---- manifest fields --------------------------------------------------------------------------------
def _field(manifest: dict, key: str, check: Callable[[Any], bool], expected: str, where: Path) -> Any:
    if key not in manifest:
        raise CheckpointError(f"{where}: manifest field {key!r} is missing (expected {expected})")
    value = manifest[key]
    if not check(value):
        raise CheckpointError(f"{where}: manifest field {key!r} is {type(value).__name__} {value!r:.80}; "
                              f"expected {expected}")
    return value


def _int(v: Any, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _tensor_entry(v: Any) -> bool:
    return (isinstance(v, dict) and isinstance(v.get("dtype"), str) and isinstance(v.get("shape"), list)
            and all(_int(d, 0) for d in v["shape"]))


def _file_entry(v: Any) -> bool:
    return isinstance(v, dict) and _int(v.get("size"), 0) and isinstance(v.get("hash"), str)


def _optimizer_entry(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and isinstance(v.get("class"), str)
                         and isinstance(v.get("param_groups"), list)
                         and all(isinstance(g, dict) for g in v["param_groups"]))


def check_fields(manifest: dict, where: Path) -> None:
    """Every field :func:`read_manifest`'s callers use, of its type; CheckpointError naming the field."""
    _field(manifest, "torch_version", lambda v: isinstance(v, str), "a string", where)
    _field(manifest, "world_size", lambda v: _int(v, 1), "a positive int", where)
    _field(manifest, "step", lambda v: _int(v, 0), "a non-negative int", where)
    _field(manifest, "plan", lambda v: isinstance(v, dict), "an object (the plan's fields)", where)
    _field(manifest, "tensors", lambda v: isinstance(v, dict) and all(
        isinstance(k, str) and _tensor_entry(t) for k, t in v.items()),
        'an object: tensor path -> {"shape": [ints >= 0], "dtype": str}', where)
    _field(manifest, "files", lambda v: isinstance(v, dict) and all(
        isinstance(k, str) and _file_entry(f) for k, f in v.items()),
        'an object: file name -> {"size": int >= 0, "hash": str}', where)
    _field(manifest, "hash_algorithm", lambda v: isinstance(v, str), "a string", where)
    _field(manifest, "finite", lambda v: isinstance(v, bool), "true or false", where)
    _field(manifest, "optimizer", _optimizer_entry,
           'null or {"class": str, "param_groups": [objects]}', where)
    _field(manifest, "loss_scaler", lambda v: v is None or isinstance(v, dict), "null or an object", where)
    if "extra" not in manifest:
        raise CheckpointError(f"{where}: manifest field 'extra' is missing (expected any JSON value, null included)")
