"""Estimate vs measured, every mode, on the built-in models and two outside the zoo (one dominant
weight per FSDP2 unit: tests/models.py); and the time to estimate all plans.

Run: ``python benchmarks/estimator_accuracy.py [--worlds 2 4] [--models mlp vgg ...] [--out table.csv]``,
or ``--speed`` for the time to estimate every plan of 8 ranks for a ~120-module model.
Measures on real gloo ranks of this machine (CPU), prints one row per plan with the relative
error of the peak (worst rank), whether sharded bytes and collectives match exactly, and the
estimation time: the first estimate (which profiles the model) and all the other plans after it.
"""
from __future__ import annotations

import argparse
import time

import pandas as pd

import snn_explorer as se
from snn_explorer.estimator import compare_estimate, enumerate_plans, estimate, measure_many
from snn_explorer.zoo import build

EXACT = ("params_bytes", "grads_bytes", "optimizer_bytes", "buffers_bytes")


#: Models outside the zoo (tests/models.py): one or two weights dominate their FSDP2 units.
OUTSIDE = ("wide_jelly", "dominant_classifier")


def _model(name: str):
    """The zoo model ``name``, or one of :data:`OUTSIDE` with the same fields."""
    if name not in OUTSIDE:
        return build(name)
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import models

    model, x, y = getattr(models, name)()
    return SimpleNamespace(model=model, example_input=x, labels=y, family="generic", batch_size=x.shape[1])


def rows_for(name: str, world: int, objectives, optimizer: str):
    zoo = _model(name)
    analysis = se.analyze(zoo.model, model_family=zoo.family)
    plans = list(dict.fromkeys(p for obj in objectives for p in enumerate_plans(
        analysis, world_size=world, batch_size=zoo.batch_size, objective=obj)))
    run = lambda p: estimate(zoo.model, p, example_input=zoo.example_input, labels=zoo.labels, optimizer=optimizer)
    start = time.perf_counter()
    estimates = [run(plans[0])]  # profiles the model
    first = time.perf_counter() - start
    start = time.perf_counter()
    estimates += [run(p) for p in plans[1:]]  # new per-rank batches and TP layouts are measured here
    rest = time.perf_counter() - start
    measured = measure_many(zoo.model, plans, example_input=zoo.example_input, labels=zoo.labels,
                            optimizer=optimizer, steps=3)
    rows = []
    for plan, est, meas in zip(plans, estimates, measured):
        cmp = compare_estimate(est, meas)
        per_rank, coll = cmp["per_rank"], cmp["collectives"]
        worst = per_rank["peak_bytes_rel_err"].abs().idxmax()
        rows.append(dict(
            model=name, world=world, mode=est.summary()["mode"], mesh=est.summary()["mesh"],
            memopt=plan.memopt_level, batch_per_rank=plan.per_rank_batch,
            peak_est=int(per_rank.loc[worst, "peak_bytes_est"]), peak_meas=int(per_rank.loc[worst, "peak_bytes_meas"]),
            peak_rel_err=round(float(per_rank.loc[worst, "peak_bytes_rel_err"]), 4),
            activations_rel_err=round(float(per_rank["activations_bytes_rel_err"].abs().max()), 4),
            sharded_exact=all((per_rank[f"{c}_est"] == per_rank[f"{c}_meas"]).all() for c in EXACT),
            collectives_exact=bool((coll["count_rel_err"] == 0).all() and (coll["bytes_rel_err"] == 0).all()),
            step_s=round(max(meas.step_time_s), 4), samples_per_s=round(meas.samples_per_s, 1),
            est_first_s=round(first, 3), est_rest_s=round(rest, 4)))
    return rows


def speed_rows(world: int = 8, repeats: int = 3):
    """Issue 3's target: all plans of 8 ranks for a ~120-module model in under 1 s after the first
    estimate (which profiles the model); each repeat on a fresh copy of the model (nothing cached)."""
    import copy

    import torch

    from snn_explorer.zoo import SpikingMLP

    base = SpikingMLP(in_features=64, hidden=(64,) * 40, num_classes=8, stepping="all_steps")
    x = torch.rand(4, 16, 64)
    rows = []
    for _ in range(repeats):
        model = copy.deepcopy(base)
        plans = list(dict.fromkeys(p for obj in ("speed", "memory") for p in enumerate_plans(
            se.analyze(model), world_size=world, batch_size=16, objective=obj)))
        start = time.perf_counter()
        estimate(model, plans[0], example_input=x)
        first = time.perf_counter() - start
        start = time.perf_counter()
        for p in plans[1:]:
            estimate(model, p, example_input=x)
        rows.append(dict(modules=sum(1 for _ in model.modules()), world=world, plans=len(plans),
                         first_s=round(first, 3), rest_s=round(time.perf_counter() - start, 3)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "mlp_all_steps", "vgg", "spikformer", *OUTSIDE],
                        help=f"zoo names, or {', '.join(OUTSIDE)} (models outside the zoo, from tests/models.py)")
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--objectives", nargs="+", default=["speed", "memory"])
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--out", default=None, help="also write the table as CSV here")
    parser.add_argument("--speed", action="store_true",
                        help="only time estimating every plan of 8 ranks for a ~120-module model")
    args = parser.parse_args()
    if args.speed:
        print(pd.DataFrame(speed_rows()).to_string(index=False))
        return
    rows = [r for name in args.models for world in args.worlds
            for r in rows_for(name, world, args.objectives, args.optimizer)]
    table = pd.DataFrame(rows)
    with pd.option_context("display.width", 250, "display.max_columns", 30):
        print(table.to_string(index=False))
    print(f"\nworst |peak error| {table['peak_rel_err'].abs().max():.3f}; "
          f"sharded bytes exact in {table['sharded_exact'].mean():.0%}, collectives exact in "
          f"{table['collectives_exact'].mean():.0%} of {len(table)} plans")
    if args.out:
        table.to_csv(args.out, index=False)


if __name__ == "__main__":
    main()
