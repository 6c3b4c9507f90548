"""snn_explorer: analyze, plan and apply distribution strategies for spiking neural networks.

The top level is the notebook's face: the verbs (analyze, plan, apply, estimate, measure,
fit_budget, launch_plan, export_job, ...), the types they take and return, and the options objects
(``PlanOptions``, ``LaunchOptions``, ``ExportOptions``). Constants stay in their modules
(``snn_explorer.core.common.MODES``, ``snn_explorer.core.model.TIME_MAJOR``, ...).

Every public name is reachable as ``snn_explorer.<name>`` and is the function or class itself;
no subpackage shares a name with one (the estimator lives in ``snn_explorer.estimator``, the
launcher in ``snn_explorer.launcher``).
"""
import importlib

from .core import (
    CheckpointError,
    DataLayout,
    DistributedFeatureSet,
    PlanOptions,
    Precision,
    SNNDistributedAnalysis,
    SNNDistributedPlan,
    SNNDistributedRuntime,
    SNNDistributedTopology,
    StrategyRecommendation,
    analyze,
    apply,
    check_checkpoint,
    find_time_step_module,
    latest_checkpoint,
    plan,
    preflight,
    recommend_snn_distributed_strategy,
    register_stateful,
    unregister_stateful,
)

__version__ = "0.1.0"

__all__ = ["CheckpointError", "DataLayout", "DistributedFeatureSet", "PlanOptions", "Precision", "SNNDistributedAnalysis",
         "SNNDistributedPlan", "SNNDistributedRuntime", "SNNDistributedTopology", "StrategyRecommendation", "analyze",
         "apply", "check_checkpoint", "find_time_step_module", "latest_checkpoint", "plan", "preflight",
         "recommend_snn_distributed_strategy", "register_stateful", "unregister_stateful"]

# Loaded on first use, so that launched ranks do not pay for pandas / ipywidgets imports.
_LAZY = {
    **{name: "snn_explorer.estimator" for name in ("enumerate_plans", "estimate", "estimate_all", "measure",
                                                   "measure_many", "compare_estimate", "PlanEstimate",
                                                   "PlanMeasurement", "calibrate", "HardwareProfile",
                                                   "hardware_profile", "hardware_profiles", "balanced_pp_plan",
                                                   "fit_budget", "FitResult", "plan_estimator")},
    **{name: "snn_explorer.launcher" for name in ("launch", "launch_plan", "export_job", "report", "LaunchError",
                                                  "LaunchResult", "TrainResult", "LaunchOptions", "ExportOptions")},
    "Explorer": "snn_explorer.explorer",
    "RankPool": "snn_explorer.ranks",
}
__all__ += list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'snn_explorer' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
