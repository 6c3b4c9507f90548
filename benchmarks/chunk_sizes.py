"""Time chunks sized by estimate, against measurement (not a test).

Run: ``python benchmarks/chunk_sizes.py [--model mlp] [--time-steps 8]``. For a zoo model (its module stepped once
per time step: the zoo ``mlp``) at ``time_steps`` T on 2 gloo ranks (mode dp), :func:`~snn_explorer.core.chunk_choice.
choose_chunks` estimates every chunk size it tries (powers of two below T, and T); each size and the plan without
checkpointing are then run by ``measure()`` on 2 ranks. Prints, per size, the estimated and measured peak bytes per
rank and the estimated step time on the H100-SXM profile, which size the memory objective takes, and the load.
"""
from __future__ import annotations

import argparse
import os
import time

import pandas as pd

import snn_explorer as se
from snn_explorer.core.chunk_choice import choose_chunks
from snn_explorer.core.memory_levers import copy_without_levers, find_time_step_module
from snn_explorer.estimator import measure
from snn_explorer.estimator.profile.step import batch_slice
from snn_explorer.zoo import build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--time-steps", type=int, default=8)
    args = parser.parse_args()
    zoo = build(args.model)
    x, y = batch_slice(zoo.example_input, zoo.labels, zoo.batch_size, args.time_steps)
    step_module = find_time_step_module(zoo.model, x)
    if step_module is None:
        raise SystemExit(f"{args.model}: no module is stepped once per time step; time chunks do not apply")
    features = se.DistributedFeatureSet(allow_activation_checkpointing=True)
    base = copy_without_levers(se.plan(analysis=se.analyze(zoo.model), objective="speed", topology={"dp": 2},
                                       mode="dp", batch_size=zoo.batch_size, features=features))
    estimate_of = se.plan_estimator(zoo.model, x, y, hardware="H100-SXM")
    choice = choose_chunks(base, step_module, estimate_of)
    rows = []
    for plan in (base,) + tuple(p for p, _ in choice.tried):
        start = time.perf_counter()
        measured = measure(zoo.model, plan, example_input=x, labels=y)
        est = estimate_of(plan)
        rows.append({"chunk steps": "none" if plan is base else plan.checkpoint_every,
                     "est. peak B": est.peak_bytes, "measured peak B": measured.peak_bytes,
                     "est. step ms (H100-SXM)": round(est.step_time_s * 1e3, 3),
                     "chosen": plan == choice.plan, "measure s": round(time.perf_counter() - start, 1)})
    print(f"{args.model}, T = {args.time_steps}, dp on 2 gloo ranks; time-stepped module {step_module!r}")
    print(pd.DataFrame(rows).to_string(index=False))
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
