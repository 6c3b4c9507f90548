"""Per-rank memory and communication estimates of distribution plans, and their measurement.

``plan.batch_size`` and ``example_input`` are always the global batch of one optimizer step,
which the data-parallel ranks of a plan split between them.
"""
from .calibration import calibrate
from .compare import compare_estimate
from .hardware import HardwareProfile, hardware_profile, hardware_profiles
from .enumerate import PlanList, enumerate_plans
from .plan_estimate import COLLECTIVE_COLUMNS, PER_RANK_COLUMNS, PlanEstimate, estimate, estimate_all
from .measurement import PlanMeasurement, measure, measure_many
from .pipeline_estimate import balanced_pp_plan, bubble_fraction
from .profile import ModelProfile, model_profile
from .recorder import CollectiveRecorder
from .step_time import TIME_COLUMNS

__all__ = ["COLLECTIVE_COLUMNS", "PER_RANK_COLUMNS", "TIME_COLUMNS", "CollectiveRecorder", "HardwareProfile",
           "ModelProfile", "PlanEstimate", "PlanList", "PlanMeasurement", "balanced_pp_plan", "bubble_fraction",
           "calibrate", "compare_estimate", "hardware_profile", "hardware_profiles", "enumerate_plans", "estimate",
           "estimate_all", "measure",
           "measure_many", "model_profile"]
