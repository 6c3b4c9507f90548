"""snn_explorer: analyze, plan and apply distribution strategies for spiking neural networks."""
import importlib

from .core import *  # noqa: F401,F403
from .core import __all__ as _core_all
from .explorer import Explorer

__version__ = "0.1.0"

# Loaded on first use, so that launched ranks do not pay for pandas / ipywidgets imports. The
# functions named like their subpackages stay there: ``from snn_explorer.estimate import estimate``,
# ``from snn_explorer.launch import launch``.
_LAZY = {
    **{name: "snn_explorer.estimate" for name in ("enumerate_plans", "measure", "compare_estimate",
                                                  "PlanEstimate", "PlanMeasurement")},
    **{name: "snn_explorer.launch" for name in ("launch_plan", "export_job", "report", "LaunchError",
                                                "LaunchResult", "TrainResult")},
}
__all__ = list(_core_all) + ["Explorer"] + list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'snn_explorer' has no attribute {name!r}")
