"""Per-rank memory, communication and step-time estimates of distribution plans, and their measurement.

``plan.batch_size`` and ``example_input`` are always the global batch of one optimizer step,
which the data-parallel ranks of a plan split between them.

Layers, each importing only from those before it: ``instruments`` (meters, recorders, counters,
isolation) <- ``profile`` (what one run of the model measures) <- ``memory`` and ``timing`` (shard
arithmetic, peaks; hardware, compute, collectives, step and pipeline time) <- ``calibration`` and
``measurement`` <- ``plan_estimate``, ``pp_layout``, ``enumerate``, ``compare``, ``budget_fit`` (the public face).
"""
from .budget_fit import FitOutcome, FitResult, fit_budget, plan_estimator
from .calibration import cached_hardware, calibrate, default_hardware
from .compare import compare_estimate
from .enumerate import PlanList, enumerate_plans
from .instruments.progress_hook import ProgressHook
from .instruments.recorder import CollectiveRecorder
from .instruments.tables import COLLECTIVE_COLUMNS, PER_RANK_COLUMNS, TIME_COLUMNS
from .measurement import FakeRankStep, PlanMeasurement, measure, measure_many, record_rank_step
from .memory.activation_curve import activation_curve
from .memory.pipeline_memory import bubble_fraction
from .plan_estimate import PlanEstimate, estimate, estimate_all
from .pp_layout import balanced_pp_plan
from .profile import ModelProfile, model_profile
from .timing import HardwareProfile, hardware_profile, hardware_profiles
from .timing.step_time import fastest_first

__all__ = ["COLLECTIVE_COLUMNS", "PER_RANK_COLUMNS", "TIME_COLUMNS", "CollectiveRecorder", "HardwareProfile",
           "FakeRankStep", "FitOutcome", "FitResult", "ModelProfile", "ProgressHook", "PlanEstimate", "PlanList", "PlanMeasurement",
           "activation_curve", "balanced_pp_plan", "bubble_fraction", "cached_hardware", "calibrate", "compare_estimate",
           "default_hardware", "enumerate_plans", "estimate", "estimate_all", "fastest_first", "fit_budget",
           "plan_estimator",
           "hardware_profile", "hardware_profiles", "measure", "measure_many", "model_profile", "record_rank_step"]
