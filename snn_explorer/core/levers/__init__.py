"""Memory levers: activation checkpointing, blocks and time chunks, offload, spike compression."""

from .activation_offload import check_activation_offload_device, offload_hooks
from .block_choice import block_choice_applies, choose_blocks, with_blocks
from .chunk_choice import choose_chunks, chunk_choice_applies, chunked
from .memory_levers import (
    ACTIVATION_CHECKPOINTING,
    activation_offload_variants,
    check_cpu_offload_device,
    checkpointing_variants,
    copy_without_levers,
    find_time_step_module,
    fsdp_offload_variants,
    lever_label,
    lever_variants,
    objective_checkpoints,
    remembered,
    spike_compression_variants,
)
from .spike_compression import (
    SpikePacker,
    apply_spike_compression,
    is_binary,
    pack_bits,
    packable,
    spike_packer,
    unpack_bits,
)

__all__ = [
    "ACTIVATION_CHECKPOINTING",
    "SpikePacker",
    "activation_offload_variants",
    "apply_spike_compression",
    "block_choice_applies",
    "check_activation_offload_device",
    "check_cpu_offload_device",
    "checkpointing_variants",
    "choose_blocks",
    "choose_chunks",
    "chunk_choice_applies",
    "chunked",
    "copy_without_levers",
    "find_time_step_module",
    "fsdp_offload_variants",
    "is_binary",
    "lever_label",
    "lever_variants",
    "objective_checkpoints",
    "offload_hooks",
    "pack_bits",
    "packable",
    "remembered",
    "spike_compression_variants",
    "spike_packer",
    "unpack_bits",
    "with_blocks",
]
