"""Vocabulary shared by every core group: names, validation, serialization, topology, modes, precision."""

from .collectives import TIMED, Collective
from .modes import MODE_TABLE, MODES, mode_of, names_text
from .precision import FP32, PRECISIONS, Precision, precision_of
from .serialize import loads
from .topology import LEADING_DIMS, MAX_WORLD_SIZE, SNNDistributedTopology, dp_tp_splits
from .validate import (
    UNSET,
    check_batch_tensor,
    check_dtype,
    check_instance,
    non_negative_int,
    positive_int,
    positive_number,
    renamed_keyword,
)
from .vocabulary import Checkpointing, Vocabulary
from .young_objects import collector_paused, new_objects_collected

__all__ = [
    "Checkpointing",
    "Collective",
    "FP32",
    "LEADING_DIMS",
    "MAX_WORLD_SIZE",
    "MODES",
    "MODE_TABLE",
    "PRECISIONS",
    "Precision",
    "SNNDistributedTopology",
    "TIMED",
    "UNSET",
    "Vocabulary",
    "check_batch_tensor",
    "check_dtype",
    "check_instance",
    "collector_paused",
    "dp_tp_splits",
    "loads",
    "mode_of",
    "names_text",
    "new_objects_collected",
    "non_negative_int",
    "positive_int",
    "positive_number",
    "precision_of",
    "renamed_keyword",
]
