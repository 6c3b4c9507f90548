"""The analyze / plan / apply core: no UI, no process management."""
from .checkpoints.checkpoint import CheckpointError, check_checkpoint, latest_checkpoint
from .common.modes import MODES
from .common.precision import PRECISIONS, Precision
from .common.topology import SNNDistributedTopology
from .distribute import apply, preflight
from .levers.memory_levers import ACTIVATION_CHECKPOINTING, find_time_step_module
from .model.analysis import LinearShape, SNNDistributedAnalysis, analyze
from .model.layouts import BATCH_MAJOR, PER_STEP, TIME_MAJOR, DataLayout
from .model.neurons import register_stateful, unregister_stateful
from .planning.plan_types import DistributedFeatureSet, SNNDistributedPlan
from .planning.planner import plan
from .planning.recommend import (
    BACKENDS,
    SNN_DISTRIBUTED_PREFERENCES,
    StrategyRecommendation,
    recommend_snn_distributed_strategy,
)
from .runtime import SNNDistributedRuntime
from .tp.styles import TP_STYLES

__all__ = [
    "ACTIVATION_CHECKPOINTING", "BACKENDS", "BATCH_MAJOR", "CheckpointError", "DataLayout", "MODES", "PER_STEP",
    "PRECISIONS", "Precision", "TIME_MAJOR", "SNN_DISTRIBUTED_PREFERENCES", "TP_STYLES",
    "DistributedFeatureSet", "LinearShape", "SNNDistributedAnalysis", "SNNDistributedPlan", "SNNDistributedRuntime",
    "SNNDistributedTopology", "StrategyRecommendation", "analyze", "apply", "check_checkpoint",
    "find_time_step_module", "latest_checkpoint", "plan", "preflight", "recommend_snn_distributed_strategy",
    "register_stateful", "unregister_stateful",
]
