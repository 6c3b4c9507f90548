"""The analyze / plan / apply core: no UI, no process management."""
from .analysis import LinearShape, SNNDistributedAnalysis, analyze
from .checkpoint import CheckpointError, check_checkpoint, latest_checkpoint
from .distribute import apply, preflight
from .layouts import BATCH_MAJOR, PER_STEP, TIME_MAJOR, DataLayout
from .memory_levers import ACTIVATION_CHECKPOINTING, find_time_step_module
from .modes import MODES
from .neurons import register_stateful, unregister_stateful
from .plan_types import DistributedFeatureSet, SNNDistributedPlan
from .planner import plan
from .precision import PRECISIONS, Precision
from .recommend import BACKENDS, SNN_DISTRIBUTED_PREFERENCES, StrategyRecommendation, recommend_snn_distributed_strategy
from .runtime import SNNDistributedRuntime
from .styles import TP_STYLES
from .topology import SNNDistributedTopology

__all__ = [
    "ACTIVATION_CHECKPOINTING", "BACKENDS", "BATCH_MAJOR", "CheckpointError", "DataLayout", "MODES", "PER_STEP",
    "PRECISIONS", "Precision", "TIME_MAJOR", "SNN_DISTRIBUTED_PREFERENCES", "TP_STYLES",
    "DistributedFeatureSet", "LinearShape", "SNNDistributedAnalysis", "SNNDistributedPlan", "SNNDistributedRuntime",
    "SNNDistributedTopology", "StrategyRecommendation", "analyze", "apply", "check_checkpoint",
    "find_time_step_module", "latest_checkpoint", "plan", "preflight", "recommend_snn_distributed_strategy",
    "register_stateful", "unregister_stateful",
]
