"""Explorer latency: analyze time and control change -> re-rendered comparison (not a test).

Run: ``MPLBACKEND=Agg python benchmarks/explorer_latency.py [--changes 50] [--skip-big]``

For each model: ``analyze`` time (median of 5), ``first_estimate_s`` (a fresh copy of the model:
the first ``Explorer.estimate`` of the plan the UI opens on, profile and step-time counting
included; the machine's calibration comes from its disk cache, so the three timed steps that
correct the step-time model on this machine are included too) and ``first_estimate_cpu_s``
(the CPU seconds of that estimate: what it costs, whatever other processes load the machine;
torch's one-time compiler import, which the first optimizer of any process pays, is paid before
and printed apart),
``ui_open_s`` (building the widgets and the comparison they show: only the current plan is
estimated, lazily, and on models over ``AUTO_ESTIMATE_MAX_MODULES`` modules not at all),
``estimate_click_s`` (then pressing ``estimate``: 0 when opening estimated), then 50
seeded random control changes on the UI (objective, dp x tp, mode, ZeRO gate, memory budget),
each timed from setting ``.value`` to the comparison's widget state being rewritten; median,
p95 (of 50: the third slowest) and the slowest, and how many distinct plans were estimated; then the same changes
again, every estimate cached (``cached_p95_ms``: the explorer's own re-plan and re-render). ``full_gcs_analyze`` and
``full_gcs_changes`` count the full (generation-2) garbage collections that fell in the five timed analyses and in
the 50 changes, ``full_gc_max_ms`` the longest of them.
Layouts first reached by a change are measured then, so ``change_p95_ms`` includes model runs.
Targets (issue 4): p95 <= 50 ms at ~120 modules, <= 200 ms at 10 000 modules; analyze of 10 000
modules <= 0.5 s. Targets (issue 18): ``ui_open_s`` <= 5 s at 10 000 modules, ``first_estimate_s``
<= 2 s for the ~200-module spiking transformer. The table's last line says the machine and load.

The generated models with 1 000 and 10 000 modules run with the estimator too (its profile is
linear in module count); ``--estimate-max-modules N`` leaves it out above N modules, and the
latency then covers re-planning and rendering only (the table says so).
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import platform
import random
import statistics
import time

os.environ.setdefault("MPLBACKEND", "Agg")

import pandas as pd
import torch

from snn_explorer import analyze
from snn_explorer.explorer import Explorer
from snn_explorer.zoo import Spikformer, SpikingMLP, build

CHANGES = (
    ("objective", ("speed", "memory", "capacity")),
    ("tp", (1, 2, 4)),
    ("mode", ("auto", "dp", "fsdp2", "tp", "fsdp2_tp")),
    ("zero", (True, False)),
    ("memory_budget", (0.0, 0.5, 64.0)),
)


def _generated(modules: int) -> tuple:
    """A deep all-steps SpikingMLP with about ``modules`` modules (3 per hidden layer) and its input."""
    model = SpikingMLP(in_features=16, hidden=(16,) * max(1, (modules - 5) // 3), num_classes=8,
                       stepping="all_steps")
    return model, torch.rand(2, 4, 16), None


def _models(skip_big: bool):
    for name in ("mlp", "mlp_all_steps", "vgg", "spikformer"):
        zoo = build(name)
        yield name, zoo.model, zoo.example_input, zoo.labels, zoo.family
    zoo = build("spikformer")  # the zoo's tiny Spikformer, 8 blocks deep: the ~200-module transformer
    model = Spikformer(image_size=16, patch_size=4, dim=32, depth=8, num_heads=4, num_classes=8, attn_scale=0.5)
    yield "spikformer x8 (~200 modules)", model, zoo.example_input, zoo.labels, zoo.family
    model = SpikingMLP(in_features=64, hidden=(64,) * 40, num_classes=8, stepping="all_steps")
    yield "mlp x40 (~120 modules)", model, torch.rand(4, 16, 64), None, None
    if not skip_big:
        for n in (1_000, 10_000):
            model, x, y = _generated(n)
            yield f"generated {n}", model, x, y, None


def _set(ui, control: str, value) -> None:
    if control == "zero":
        ui.gates["allow_zero_optimizer"].value = value
    elif control == "tp":
        ui.tp.value = value
    else:
        getattr(ui, control).value = value


def _latencies(ui, changes: int, seed: int = 0) -> list:
    rng, out = random.Random(seed), []
    for _ in range(changes):
        control, values = rng.choice(CHANGES)
        current = ui.gates["allow_zero_optimizer"].value if control == "zero" else getattr(ui, control).value
        value = rng.choice([v for v in values if v != current])
        before = ui.outputs["Compare"].outputs
        start = time.perf_counter()
        _set(ui, control, value)
        out.append(time.perf_counter() - start)
        assert ui.outputs["Compare"].outputs is not before, "the comparison was not re-rendered"
    return out


class _FullCollections:
    """The durations of the process's full (generation-2) garbage collections while inside (``gc.callbacks``)."""

    def __init__(self):
        self.seconds, self._start = [], None

    def _hear(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds.append(time.perf_counter() - self._start)
            self._start = None

    def __enter__(self):
        gc.callbacks.append(self._hear)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._hear)


def _p95(values: list) -> float:
    return sorted(values)[max(0, -(-95 * len(values) // 100) - 1)]


def _first_estimate(model, x, labels, family) -> tuple:
    """Wall and CPU seconds of a fresh Explorer's first estimate of the plan the UI opens on (4 ranks, speed)."""
    ex = Explorer(model, example_input=x, labels=labels, model_family=family, batch_size=x.shape[1])
    plan = ex.make_plan(objective="speed", topology=4)
    start, cpu = time.perf_counter(), time.process_time()
    ex.estimate(plan)
    return time.perf_counter() - start, time.process_time() - cpu


def _machine() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",) * 3
    return (f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads; load average {' / '.join(f'{v:.1f}' for v in load)} (1/5/15 min)")


def run(name, model, x, labels, family, changes: int, estimate_max: int) -> dict:
    count = sum(1 for _ in model.modules())
    timings = []
    with _FullCollections() as in_analyze:
        for _ in range(5):
            start = time.perf_counter()
            analyze(model, model_family=family)
            timings.append(time.perf_counter() - start)
    estimated = count <= estimate_max
    first_s, first_cpu = _first_estimate(copy.deepcopy(model), x, labels, family) if estimated else (None, None)
    ex = Explorer(model, example_input=x if estimated else None, labels=labels, model_family=family,
                  batch_size=x.shape[1])
    start = time.perf_counter()
    ui = ex.ui  # builds the widgets; estimates the plan they show unless the model is too big for that
    open_s, opened_estimating = time.perf_counter() - start, ui.auto_estimate.value
    start = time.perf_counter()
    ui.estimate()  # what the estimate button does (nothing to do if opening estimated)
    shown_s = time.perf_counter() - start
    ui.auto_estimate.value = True  # the changes below re-estimate, on every model
    with _FullCollections() as in_changes:
        lat = _latencies(ui, changes)
    misses = len(ex._estimates)
    ui.clear()
    for control, values in CHANGES:  # back to the start, then the same changes: every estimate cached
        _set(ui, control, values[0])
    ui.gates["allow_zero_optimizer"].value = True
    cached = _latencies(ui, changes)
    return {"model": name, "modules": count, "analyze_ms": round(statistics.median(timings) * 1e3, 1),
            "ui_open_s": round(open_s, 2), "opens_estimating": opened_estimating,
            "estimate_click_s": round(shown_s, 2), "first_estimate_s": None if first_s is None else round(first_s, 2),
            "first_estimate_cpu_s": None if first_cpu is None else round(first_cpu, 2),
            "change_median_ms": round(statistics.median(lat) * 1e3, 1),
            "change_p95_ms": round(_p95(lat) * 1e3, 1), "change_max_ms": round(max(lat) * 1e3, 1),
            "cached_p95_ms": round(_p95(cached) * 1e3, 1), "estimates": misses,
            "full_gcs_analyze": len(in_analyze.seconds), "full_gcs_changes": len(in_changes.seconds),
            "full_gc_max_ms": round(max(in_analyze.seconds + in_changes.seconds, default=0.0) * 1e3, 1),
            "estimator": "yes" if estimated else "no (re-plan + render only)"}


def _import_torch_compiler() -> float:
    """Seconds of torch's one-time ``import torch._dynamo``, which the first ``torch.optim`` optimizer
    of a process triggers (``add_param_group`` is wrapped in dynamo's disable): any training script
    or notebook that built an optimizer has paid it. Paid here up front, so that the first estimate
    below is the estimator's own time; printed, so that a cold process can add it."""
    start = time.perf_counter()
    import torch._dynamo  # noqa: F401

    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=50)
    parser.add_argument("--skip-big", action="store_true", help="leave out the generated 1 000 / 10 000 module models")
    parser.add_argument("--only", nargs="*", help="run only the models whose names start with these")
    parser.add_argument("--estimate-max-modules", type=int, default=20_000,
                        help="run the estimator only for models up to this many modules")
    args = parser.parse_args(argv)
    print(f"torch's compiler imported in {_import_torch_compiler():.2f} s (once per process, by its first optimizer)")
    rows = []
    for name, model, x, labels, family in _models(args.skip_big):
        if args.only and not any(name.startswith(o) for o in args.only):
            continue
        rows.append(run(name, model, x, labels, family, args.changes, args.estimate_max_modules))
        print(rows[-1], flush=True)
    pd.set_option("display.width", 200)
    print(pd.DataFrame(rows).to_string(index=False))
    print(_machine())


if __name__ == "__main__":
    main()
