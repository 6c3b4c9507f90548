"""The public surface: every ``snn_explorer.__all__`` name is the object itself, whatever was imported first."""
from __future__ import annotations

import inspect
import json
import os
import pkgutil
import subprocess
import sys
import types

import snn_explorer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Runs in a fresh interpreter: reads every public name before and after importing every subpackage
# and module of the package, and reports what each one is.
PROBE = r"""
import importlib, inspect, json, pkgutil, sys, types
import snn_explorer as se

def kind(value):
    if isinstance(value, types.ModuleType):
        return "module " + value.__name__
    if inspect.isclass(value):
        return "class"
    if callable(value):
        return "function"
    return "value " + type(value).__name__

first = {name: kind(getattr(se, name)) for name in sys.argv[1:] or se.__all__}
modules = sorted(m.name for m in pkgutil.walk_packages(se.__path__, "snn_explorer."))
for name in modules:
    importlib.import_module(name)
after = {name: kind(getattr(se, name)) for name in se.__all__}
print(json.dumps({"first": first, "after": after, "modules": modules}))
"""


def _probe(*names):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", PROBE, *names], capture_output=True, text=True, env=env,
                         timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_public_name_is_the_object_in_a_fresh_interpreter():
    report = _probe()
    assert set(report["first"]) == set(snn_explorer.__all__)
    for phase in ("first", "after"):
        modules = {n: k for n, k in report[phase].items() if k.startswith("module")}
        assert not modules, f"{phase}: public names that are modules: {modules}"
    assert report["first"] == report["after"]
    assert report["after"]["estimate"] == report["after"]["launch"] == "function"
    assert report["after"]["Explorer"] == "class"


def test_a_function_read_first_is_still_the_function_after_its_subpackage_loads():
    """``se.estimate`` read before ``snn_explorer.estimator`` is imported, and after."""
    report = _probe("estimate", "launch", "measure")
    assert report["first"] == {"estimate": "function", "launch": "function", "measure": "function"}
    assert report["after"]["estimate"] == "function"


def test_no_module_of_the_package_shares_a_name_with_a_public_function():
    names = {m.name.rsplit(".", 1)[-1]
             for m in pkgutil.walk_packages(snn_explorer.__path__, "snn_explorer.")}
    callables = {n for n in snn_explorer.__all__ if callable(getattr(snn_explorer, n))}
    assert "estimator" in names and "launcher" in names  # the walk sees the subpackages
    assert not names & callables, f"modules named like public functions: {sorted(names & callables)}"


def test_public_callables_are_documented():
    for name in snn_explorer.__all__:
        value = getattr(snn_explorer, name)
        if inspect.isfunction(value) or inspect.isclass(value):
            assert inspect.getdoc(value), f"snn_explorer.{name} has no docstring"
            assert not isinstance(value, types.ModuleType)


#: The public face, exactly: the notebook verbs, the types they take and return, the options objects.
FACE = {
    "verbs": ["analyze", "plan", "apply", "preflight", "recommend_snn_distributed_strategy", "estimate", "estimate_all",
              "enumerate_plans", "compare_estimate", "plan_estimator", "balanced_pp_plan", "measure", "measure_many",
              "fit_budget", "calibrate", "hardware_profile", "hardware_profiles", "launch", "launch_plan", "export_job",
              "report", "check_checkpoint", "latest_checkpoint", "find_time_step_module", "register_stateful",
              "unregister_stateful"],
    "types": ["SNNDistributedAnalysis", "SNNDistributedPlan", "SNNDistributedRuntime", "SNNDistributedTopology",
              "DistributedFeatureSet", "StrategyRecommendation", "DataLayout", "Precision", "HardwareProfile",
              "PlanEstimate", "PlanMeasurement", "FitResult", "LaunchResult", "TrainResult", "LaunchError",
              "CheckpointError", "Explorer", "RankPool"],
    "options": ["PlanOptions", "LaunchOptions", "ExportOptions"],
}


def test_the_public_face_is_exactly_the_verbs_and_types():
    listed = FACE["verbs"] + FACE["types"] + FACE["options"]
    assert len(set(listed)) == len(listed)
    assert sorted(snn_explorer.__all__) == sorted(listed)


def test_no_constant_on_the_public_face():
    assert [n for n in snn_explorer.__all__ if n.isupper()] == []
    for name in ("MODES", "TP_STYLES", "PRECISIONS", "TIME_MAJOR", "BACKENDS", "NEURON_BACKENDS"):
        assert not hasattr(snn_explorer, name), name
    from snn_explorer.core.common import MODES
    from snn_explorer.core.planning import NEURON_BACKENDS
    from snn_explorer.ranks import COMM_BACKENDS
    assert "tp" in MODES and "torch" in NEURON_BACKENDS and "gloo" in COMM_BACKENDS


def test_step_time_names_are_public():
    for name in ("calibrate", "HardwareProfile", "hardware_profile", "hardware_profiles"):
        assert name in snn_explorer.__all__, name
    assert isinstance(snn_explorer.hardware_profile("H100-SXM"), snn_explorer.HardwareProfile)
    assert "A100-SXM-80GB" in snn_explorer.hardware_profiles()


MAX_PARAMETERS = 12


def _callables():
    """Every public function of the face, and every public method of its classes (``__init__`` of the
    value types aside: a dataclass takes one argument per field)."""
    for name in snn_explorer.__all__:
        value = getattr(snn_explorer, name)
        if inspect.isfunction(value):
            yield name, value
        elif inspect.isclass(value):
            for attr, member in vars(value).items():
                if not attr.startswith("_") and inspect.isfunction(member):
                    yield f"{name}.{attr}", member


def test_no_public_function_takes_more_than_twelve_parameters():
    counts = {name: len([p for p in inspect.signature(fn).parameters if p not in ("self", "cls")])
              for name, fn in _callables()}
    assert {"plan", "launch_plan", "export_job", "measure", "Explorer.make_plan"} <= set(counts)
    assert {name: n for name, n in counts.items() if n > MAX_PARAMETERS} == {}


def test_options_objects_carry_the_settings_and_bad_values_fail_at_plan_time():
    import pytest

    from snn_explorer.zoo import build

    analysis = snn_explorer.analyze(build("mlp").model)
    with pytest.raises(TypeError, match="PlanOptions has no field"):
        snn_explorer.PlanOptions().replace(pp_shedule="1f1b")
    with pytest.raises(TypeError, match="must be a PlanOptions"):
        snn_explorer.plan(analysis=analysis, objective="speed", topology={"dp": 2}, batch_size=8,
                          options={"pp_schedule": "1f1b"})
    with pytest.raises(ValueError, match="checkpoint_every"):
        snn_explorer.plan(analysis=analysis, objective="memory", topology={"dp": 2}, batch_size=8,
                          options=snn_explorer.PlanOptions(checkpoint_every=0))
    made = snn_explorer.plan(analysis=analysis, objective="speed", topology={"dp": 2}, batch_size=8, mode="dp",
                             options=snn_explorer.PlanOptions(precision="fp32"))
    assert made.mode == "dp" and made.precision.name == "fp32"
    with pytest.raises(TypeError, match="must be a LaunchOptions"):
        snn_explorer.launch_plan(build("mlp").model, made, print, options=snn_explorer.ExportOptions())
