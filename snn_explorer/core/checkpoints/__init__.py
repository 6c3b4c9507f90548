"""Distributed checkpoints: files, integrity, the writer lock, tensors, save and load."""

from .checkpoint import (
    CheckpointError,
    check_checkpoint,
    check_plan_checkpointable,
    latest_checkpoint,
    read_manifest,
    reshard_problem,
    step_path,
)
from .checkpoint_files import saved_tensor_metadata
from .checkpoint_integrity import file_digest
from .checkpoint_lock import LOCK_NAME, CheckpointDirBusy, FolderLock

__all__ = [
    "CheckpointDirBusy",
    "CheckpointError",
    "FolderLock",
    "LOCK_NAME",
    "check_checkpoint",
    "check_plan_checkpointable",
    "file_digest",
    "latest_checkpoint",
    "read_manifest",
    "reshard_problem",
    "saved_tensor_metadata",
    "step_path",
]
