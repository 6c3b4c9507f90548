"""Predicted vs measured step time of every plan, on this machine's gloo ranks; and the 1024-rank what-if.

Run: ``python benchmarks/step_time.py [--models mlp vgg ...] [--worlds 2 4] [--steps 9] [--repeat 3]``, or
``--scale`` for the time to enumerate and estimate every plan of 1024 ranks for a ~120-module
model on a datasheet profile. The accuracy run first calibrates this machine (``calibrate``, the
median of ``--repeat`` worlds per size), then for each zoo model and world size estimates every
plan's step time on that calibration and measures it in ``--repeat`` fresh worlds (``measure_many``:
the mean of the timed steps after the first on the slowest rank; the median over the worlds, whose
spread ``worlds_max_over_min`` shows).
Per model it prints the median and worst relative error and Kendall's tau between the predicted
and the measured order of the plans. Targets: median <= 15 %, worst <= 30 %, tau >= 0.8.
``--noise`` times one fixed step over and over in one process: how much this machine's own speed
varies, below which no error can be checked.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time

import pandas as pd

import snn_explorer as se
from snn_explorer.estimator import enumerate_plans, estimate, measure_many
from snn_explorer.zoo import build


def kendall_tau(a, b) -> float:
    """Kendall's tau-b of two equally long sequences (1: same order, -1: reversed)."""
    concordant = discordant = ties_a = ties_b = 0
    for i, j in itertools.combinations(range(len(a)), 2):
        da, db = a[i] - a[j], b[i] - b[j]
        if da == 0 and db == 0:
            continue
        if da == 0:
            ties_a += 1
        elif db == 0:
            ties_b += 1
        elif (da > 0) == (db > 0):
            concordant += 1
        else:
            discordant += 1
    denom = ((concordant + discordant + ties_a) * (concordant + discordant + ties_b)) ** 0.5
    return (concordant - discordant) / denom if denom else float("nan")


def rows_for(name: str, worlds, hw, steps: int, repeat: int = 1):
    zoo = build(name)
    analysis = se.analyze(zoo.model, model_family=zoo.family)
    plans = [p for w in worlds for p in enumerate_plans(analysis, world_size=w, batch_size=zoo.batch_size)]
    estimates = [estimate(zoo.model, p, example_input=zoo.example_input, labels=zoo.labels, hardware=hw)
                 for p in plans]
    runs = [measure_many(zoo.model, plans, example_input=zoo.example_input, labels=zoo.labels, steps=steps)
            for _ in range(repeat)]
    rows = []
    for est, *meas in zip(estimates, *runs):
        row = est.time.iloc[0]
        per_world = [max(m.step_time_s) for m in meas]
        real = statistics.median(per_world)
        rows.append(dict(model=name, mode=est.summary()["mode"], mesh=est.summary()["mesh"],
                         compute_ms=1e3 * row.compute_s, exposed_comm_ms=1e3 * row.exposed_comm_s,
                         predicted_ms=1e3 * est.step_time_s, measured_ms=1e3 * real,
                         worlds_max_over_min=max(per_world) / min(per_world),
                         rel_err=(est.step_time_s - real) / real))
    return rows


def summary(table: pd.DataFrame) -> pd.DataFrame:
    out = []
    for name, group in table.groupby("model", sort=False):
        err = group["rel_err"].abs()
        out.append(dict(model=name, plans=len(group), median_abs_err=err.median(), worst_abs_err=err.max(),
                        kendall_tau=kendall_tau(list(group["predicted_ms"]), list(group["measured_ms"]))))
    return pd.DataFrame(out)


def scale_rows(world: int = 1024, repeats: int = 2, hardware: str = "8x8-H100-SXM"):
    """Enumerate and estimate every plan of ``world`` ranks for a ~120-module model: the first pass
    (profiles the model, its TP replicas and per-rank batches) and then every plan again."""
    import torch

    from snn_explorer.zoo import SpikingMLP

    model = SpikingMLP(in_features=64, hidden=(64,) * 40, num_classes=8, stepping="all_steps")
    x = torch.rand(4, 16, 64)
    rows = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        plans = list(dict.fromkeys(p for obj in ("speed", "memory") for p in enumerate_plans(
            se.analyze(model), world_size=world, batch_size=world, objective=obj)))
        ests = [estimate(model, p, example_input=x, hardware=hardware) for p in plans]
        rows.append(dict(modules=sum(1 for _ in model.modules()), world=world, plans=len(plans),
                         pass_=("first" if i == 0 else f"again {i}"), seconds=round(time.perf_counter() - start, 3),
                         fastest=min(ests, key=lambda e: e.step_time_s).summary()["mode"]))
    return rows


def noise_rows(loops: int = 20):
    """The machine's own noise floor: the same small SNN training step (the calibration's probe),
    timed ``loops`` times over 0.25 s each in this process on one thread. No prediction can be
    checked more finely than these times vary."""
    import torch

    from snn_explorer.estimator.calibration.probes import busy_time, probe_step
    from snn_explorer.estimator.instruments.isolation import one_thread

    with one_thread():
        probe = probe_step(torch.device("cpu"))
        times = [busy_time(probe, lambda: None) for _ in range(loops)]
    median = statistics.median(times)
    return [dict(loops=loops, min_ms=1e3 * min(times), median_ms=1e3 * median, max_ms=1e3 * max(times),
                 max_over_min=max(times) / min(times), worst_vs_median=max(abs(t / median - 1) for t in times))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "mlp_all_steps", "mlp_tutorial", "vgg", "spikformer"])
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--repeat", type=int, default=3,
                        help="fresh worlds per world size, for the calibration and for each plan's measurement (median)")
    parser.add_argument("--scale", action="store_true", help="only the 1024-rank enumeration and estimate time")
    parser.add_argument("--noise", action="store_true", help="only the machine's noise floor (one fixed step, timed 20 times)")
    args = parser.parse_args()
    if args.noise:
        print(pd.DataFrame(noise_rows()).to_string(index=False, float_format="{:.3f}".format))
        return
    if args.scale:
        print(pd.DataFrame(scale_rows()).to_string(index=False))
        return
    start = time.perf_counter()
    hw = se.calibrate(group_sizes=sorted({w for w in args.worlds if w > 1} | {2}), worlds=args.repeat)
    print(f"calibrated in {time.perf_counter() - start:.1f} s: {hw.source}")
    print("compute slow-down of ranks sharing the host:", {p: round(v, 2) for p, v in hw.compute_sharing.items()})
    print("wrapper costs (ms):", {p: {k: round(v * 1e3, 2) for k, v in c.items()} for p, c in hw.framework_overhead.items()})
    table = pd.DataFrame([r for name in args.models for r in rows_for(name, args.worlds, hw, args.steps, args.repeat)])
    with pd.option_context("display.width", 250, "display.max_columns", 30, "display.float_format", "{:.3f}".format):
        print(table.to_string(index=False))
        print()
        print(summary(table).to_string(index=False))
    err = table["rel_err"].abs()
    print(f"\nall {len(table)} plans: median |error| {err.median():.1%}, worst {err.max():.1%}")


if __name__ == "__main__":
    main()
