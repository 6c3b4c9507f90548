"""One module per parallelism, each a function that shards a model in place (``apply_ddp``,
``apply_fsdp2``, ``apply_tp``, ``apply_pp``, activation checkpointing); :func:`~..distribute.apply`
composes them as a plan says."""

from .checkpointing import (
    apply_activation_checkpointing,
    block_segments,
    checkpoint_blocks,
    checkpoint_time_chunks,
    checkpointed_paths,
    region_starts,
    repeated_blocks,
)
from .fsdp import fsdp_units_of, norm_layer_paths
from .mesh import comm_backend_for, default_device_type, device_type_for
from .mixed_precision import LossScaler, autocast_forward, hold_neuron_state
from .pipeline import PipelineStageModule, StageConfig, build_stage
from .saved_ops import TORCHTITAN_OPS

__all__ = [
    "LossScaler",
    "PipelineStageModule",
    "StageConfig",
    "TORCHTITAN_OPS",
    "apply_activation_checkpointing",
    "autocast_forward",
    "block_segments",
    "build_stage",
    "checkpoint_blocks",
    "checkpoint_time_chunks",
    "checkpointed_paths",
    "comm_backend_for",
    "default_device_type",
    "device_type_for",
    "fsdp_units_of",
    "hold_neuron_state",
    "norm_layer_paths",
    "region_starts",
    "repeated_blocks",
]
