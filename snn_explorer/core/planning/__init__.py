"""From an analysis to a plan: pipeline layout and schedules, recommendation, plan types, planner."""

from .options import PlanOptions, check_options, split_options
from .pipeline_plan import balanced_layout, check_pp_model, layout_text, resolve_layout, stage_units, whole_cuts
from .pipeline_schedules import SCHEDULES, PipelineSchedule, Span, idle_fraction, needs, passes, replay, schedule_of
from .plan_types import DistributedFeatureSet, SNNDistributedPlan, topology_problem
from .planner import plan
from .recommend import (
    NEURON_BACKENDS,
    SNN_DISTRIBUTED_PREFERENCES,
    StrategyRecommendation,
    check_backend,
    neuron_backend_arg,
    recommend_snn_distributed_strategy,
)

__all__ = [
    "NEURON_BACKENDS",
    "DistributedFeatureSet",
    "PipelineSchedule",
    "PlanOptions",
    "SCHEDULES",
    "SNNDistributedPlan",
    "SNN_DISTRIBUTED_PREFERENCES",
    "Span",
    "StrategyRecommendation",
    "balanced_layout",
    "check_backend",
    "check_options",
    "check_pp_model",
    "idle_fraction",
    "layout_text",
    "needs",
    "neuron_backend_arg",
    "passes",
    "plan",
    "recommend_snn_distributed_strategy",
    "replay",
    "resolve_layout",
    "schedule_of",
    "split_options",
    "stage_units",
    "topology_problem",
    "whole_cuts",
]
