"""The analyze / plan / apply core: no UI, no process management.

Grouped by concept, in layers; a module imports only from its own group and the groups listed
before it (``tests/unit/test_layers.py`` checks it):

1. ``common``: vocabulary, validation, serialization, collectives, topology, modes, precision;
2. ``model``: what a model is (walk, module copies, neurons, structure, layouts, attention, dataflow,
   families, pipeline units) and its ``analyze``;
3. ``tp``: tensor-parallel styles, their torch implementation, the per-layer TP plan;
4. ``levers``: memory levers (activation checkpointing, blocks, time chunks, offload, spike compression);
5. ``planning``: pipeline layout and schedules, the recommendation, plan types and ``plan``;
6. ``parallelize``: one function per parallelism, sharding a model in place;
7. ``checkpoints``: distributed checkpoint files, integrity, lock, save and load;
8. ``runtime`` (the object ``apply`` returns), then ``distribute`` (``apply`` and ``preflight``).

Each group's ``__init__`` lists its public names in ``__all__``; code outside ``core`` imports them
from the group package (``from snn_explorer.core.tp import STYLES``).
"""
from .checkpoints import CheckpointError, check_checkpoint, latest_checkpoint
from .common import Precision, SNNDistributedTopology
from .distribute import apply, preflight
from .levers import find_time_step_module
from .model import DataLayout, LinearShape, SNNDistributedAnalysis, analyze, register_stateful, unregister_stateful
from .planning import (
                       DistributedFeatureSet,
    PlanOptions,
                       SNNDistributedPlan,
                       StrategyRecommendation,
                       plan,
                       recommend_snn_distributed_strategy,
)
from .runtime import SNNDistributedRuntime

__all__ = [
    "CheckpointError", "DataLayout", "DistributedFeatureSet", "LinearShape", "PlanOptions", "Precision", "SNNDistributedAnalysis",
    "SNNDistributedPlan", "SNNDistributedRuntime", "SNNDistributedTopology", "StrategyRecommendation", "analyze",
    "apply", "check_checkpoint", "find_time_step_module", "latest_checkpoint", "plan", "preflight",
    "recommend_snn_distributed_strategy", "register_stateful", "unregister_stateful",
]
