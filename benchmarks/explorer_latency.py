"""Explorer latency: analyze time and control change -> re-rendered comparison (not a test).

Run: ``MPLBACKEND=Agg python benchmarks/explorer_latency.py [--changes 50] [--skip-big]``

For each model: ``analyze`` time (median of 5), the time to open the UI (``prepare_s``: the
estimator's one-off profile and one model run per per-rank batch and TP layout of the world size,
:meth:`Explorer.prepare`), then 50 seeded random control changes on the UI (objective, dp x tp,
mode, ZeRO gate, memory budget), each timed from setting ``.value`` to the comparison's widget
state being rewritten; median and p95, and how many distinct plans were estimated; then the same
changes again, every estimate cached (``cached_p95_ms``: the explorer's own re-plan and re-render). Targets (issue 4): p95 <= 50 ms at ~120
modules, <= 200 ms at 10 000 modules; analyze of 10 000 modules <= 0.5 s.

The generated models with 1 000 and 10 000 modules run with the estimator too (its profile is
linear in module count); ``--estimate-max-modules N`` leaves it out above N modules, and the
latency then covers re-planning and rendering only (the table says so).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("MPLBACKEND", "Agg")

import pandas as pd
import torch

from snn_explorer import analyze
from snn_explorer.explorer import Explorer
from snn_explorer.zoo import SpikingMLP, build

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


def _p95(values: list) -> float:
    return sorted(values)[max(0, -(-95 * len(values) // 100) - 1)]


def run(name, model, x, labels, family, changes: int, estimate_max: int) -> dict:
    count = sum(1 for _ in model.modules())
    timings = []
    for _ in range(5):
        start = time.perf_counter()
        analyze(model, model_family=family)
        timings.append(time.perf_counter() - start)
    estimated = count <= estimate_max
    ex = Explorer(model, example_input=x if estimated else None, labels=labels, model_family=family,
                  batch_size=x.shape[1])
    start = time.perf_counter()
    ui = ex.ui  # builds the widgets and prepares every plan of the world size: profile + model runs
    prepare_s = time.perf_counter() - start
    lat = _latencies(ui, changes)
    misses = len(ex._estimates)
    ui.clear()
    for control, values in CHANGES:  # back to the start, then the same changes: every estimate cached
        _set(ui, control, values[0])
    ui.gates["allow_zero_optimizer"].value = True
    cached = _latencies(ui, changes)
    return {"model": name, "modules": count, "analyze_ms": round(statistics.median(timings) * 1e3, 1),
            "prepare_s": round(prepare_s, 2) if estimated else None,
            "change_median_ms": round(statistics.median(lat) * 1e3, 1),
            "change_p95_ms": round(_p95(lat) * 1e3, 1),
            "cached_p95_ms": round(_p95(cached) * 1e3, 1), "estimates": misses,
            "estimator": "yes" if estimated else "no (re-plan + render only)"}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=50)
    parser.add_argument("--skip-big", action="store_true", help="leave out the generated 1 000 / 10 000 module models")
    parser.add_argument("--estimate-max-modules", type=int, default=20_000,
                        help="run the estimator only for models up to this many modules")
    args = parser.parse_args(argv)
    rows = []
    for name, model, x, labels, family in _models(args.skip_big):
        rows.append(run(name, model, x, labels, family, args.changes, args.estimate_max_modules))
        print(rows[-1], flush=True)
    pd.set_option("display.width", 200)
    print(pd.DataFrame(rows).to_string(index=False))


if __name__ == "__main__":
    main()
