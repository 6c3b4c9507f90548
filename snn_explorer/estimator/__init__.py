"""Per-rank memory and communication estimates of distribution plans, and their measurement.

``plan.batch_size`` and ``example_input`` are always the global batch of one optimizer step,
which the data-parallel ranks of a plan split between them.
"""
from .compare import compare_estimate
from .enumerate import PlanList, enumerate_plans
from .plan_estimate import COLLECTIVE_COLUMNS, PER_RANK_COLUMNS, PlanEstimate, estimate, estimate_all
from .measurement import PlanMeasurement, measure, measure_many
from .pipeline_estimate import balanced_pp_plan, bubble_fraction
from .profile import ModelProfile, model_profile
from .recorder import CollectiveRecorder

__all__ = ["COLLECTIVE_COLUMNS", "PER_RANK_COLUMNS", "CollectiveRecorder", "ModelProfile", "PlanEstimate", "PlanList",
           "PlanMeasurement", "balanced_pp_plan", "bubble_fraction", "compare_estimate", "enumerate_plans", "estimate", "estimate_all", "measure",
           "measure_many", "model_profile"]
