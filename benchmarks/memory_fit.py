"""fit_budget at shrinking memory budgets: the plan found, its estimated (and measured) peak, step time, search time.

Run: ``python benchmarks/memory_fit.py [--models spikformer vgg] [--world-size 2] [--hardware H100-SXM]
[--size tiny] [--time-steps 16] [--measure]``. Per model, the budget is 100 %, 75 %, 50 % and 35 % of the unlevered peak (the estimated
peak of the fastest plan without memory levers); each row is what :func:`snn_explorer.fit_budget` returns
there, or the lowest estimated peak when no plan fits. ``--measure`` also trains each chosen plan on
``world_size`` gloo ranks (``measure``) and prints its measured peak.

The reference project's ``memopt`` search is not run side by side: it needs CUDA and its own package
(the 2.0.0 ``examples/memopt``), neither of which this benchmark's CPU machines have.
"""
from __future__ import annotations

import argparse
import re

import pandas as pd

from snn_explorer import fit_budget
from snn_explorer.estimator import measure
from snn_explorer.zoo import build

SHARES = (1.0, 0.75, 0.5, 0.35)


def _row(name, share, budget, zoo, args) -> dict:
    row = dict(model=name, budget_share=share, budget_bytes=budget)
    try:
        found = fit_budget(zoo.model, zoo.example_input, budget, args.world_size, labels=zoo.labels,
                           hardware=args.hardware)
    except ValueError as exc:
        lowest = re.search(r"lowest estimated peak is (\d+) B \((.*)\)", str(exc))
        return dict(row, plan=f"none fits (lowest: {lowest.group(2)})", est_peak=int(lowest.group(1)))
    row.update(plan=found.table["plan"].iloc[0], est_peak=found.estimate.peak_bytes,
               step_ms=round(found.estimate.step_time_s * 1e3, 3), search_s=round(found.search_s, 2),
               candidates=len(found.table))
    if args.measure:
        got = measure(zoo.model, found.plan, example_input=zoo.example_input, labels=zoo.labels)
        row.update(measured_peak=got.peak_bytes,
                   rel_error=round((found.estimate.peak_bytes - got.peak_bytes) / got.peak_bytes, 3))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["spikformer", "mlp_all_steps"])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--size", default="tiny", help="zoo size (tiny, small, full)")
    parser.add_argument("--time-steps", type=int, default=16, help="T: activations and neuron state grow with it")
    parser.add_argument("--hardware", default="H100-SXM", help="a built-in hardware profile for the step times")
    parser.add_argument("--measure", action="store_true", help="measure each chosen plan on gloo ranks too")
    args = parser.parse_args()
    rows = []
    for name in args.models:
        zoo = build(name, args.size, time_steps=args.time_steps)
        top = fit_budget(zoo.model, zoo.example_input, 2 ** 50, args.world_size, labels=zoo.labels,
                         hardware=args.hardware)
        for share in SHARES:
            rows.append(_row(name, share, int(top.estimate.peak_bytes * share), zoo, args))
    with pd.option_context("display.width", 250, "display.max_colwidth", 60):
        print(pd.DataFrame(rows).to_string(index=False))


if __name__ == "__main__":
    main()
