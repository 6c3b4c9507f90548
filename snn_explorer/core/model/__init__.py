"""What a model is: its walk, neurons, structure, layouts, attention, dataflow, families and analysis."""

from .analysis import LinearShape, SNNDistributedAnalysis, analyze, shared_parameters
from .families import fsdp_units, resolve_family
from .layouts import BATCH_MAJOR, PER_STEP, TIME_MAJOR, DataLayout, detect_layout, fixed_loop_error, layout_of
from .model_memo import structure_key
from .module_copy import copy_along, deep_copy_module, modules_copied, root_over_children
from .neurons import (
    detached_copy,
    is_stateful,
    register_stateful,
    registered_stateful,
    reset_all,
    restore_stateful,
    shared_storage_copy,
    snn_library,
    state_description,
    state_tensors,
    stateful_modules,
    tensors_with_history,
    unregister_stateful,
)
from .structure import CONV_TYPES
from .units import TIME_LOOP_HINT, TIME_LOOP_SIGNS, pipeline_units, trainable_units
from .walk import memo, modules_by_name, one_walk

__all__ = [
    "BATCH_MAJOR",
    "CONV_TYPES",
    "DataLayout",
    "LinearShape",
    "PER_STEP",
    "SNNDistributedAnalysis",
    "TIME_LOOP_HINT",
    "TIME_LOOP_SIGNS",
    "TIME_MAJOR",
    "analyze",
    "copy_along",
    "deep_copy_module",
    "detached_copy",
    "detect_layout",
    "fixed_loop_error",
    "fsdp_units",
    "is_stateful",
    "layout_of",
    "memo",
    "modules_by_name",
    "modules_copied",
    "one_walk",
    "pipeline_units",
    "register_stateful",
    "registered_stateful",
    "reset_all",
    "resolve_family",
    "restore_stateful",
    "root_over_children",
    "shared_parameters",
    "shared_storage_copy",
    "snn_library",
    "state_description",
    "state_tensors",
    "stateful_modules",
    "structure_key",
    "tensors_with_history",
    "trainable_units",
    "unregister_stateful",
]
