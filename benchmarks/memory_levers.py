"""Activation checkpointing: estimated vs measured peak per rank, with and without it, on 2 gloo ranks.

Run: ``python benchmarks/memory_levers.py [--time-steps 32]``. One row per (model, mode, checkpointing):
the estimated and measured peak (worst rank), their relative error, the estimated activation bytes
and the recompute cost (FLOPs as a fraction of one forward, ``PlanEstimate.recompute_forward_fraction``).
"""
from __future__ import annotations

import argparse

import pandas as pd

import snn_explorer as se
from snn_explorer.core.planning import split_options
from snn_explorer.estimator import estimate, measure_many
from snn_explorer.zoo import build

GATES = se.DistributedFeatureSet(allow_activation_checkpointing=True)
CASES = (("mlp_all_steps", dict(activation_checkpointing="blocks")),
         ("mlp", dict(activation_checkpointing="time_chunks", checkpoint_every=4, time_step_module="net")))
MODES = (("dp", {"dp": 2}), ("fsdp2", {"dp": 2}), ("tp", {"tp": 2}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--time-steps", type=int, default=32)
    args = parser.parse_args()
    rows = []
    for name, levers in CASES:
        zoo = build(name, time_steps=args.time_steps)
        analysis = se.analyze(zoo.model)
        plans = [se.plan(analysis=analysis, objective="memory", topology=topology, batch_size=zoo.batch_size,
                         mode=mode, features=GATES, **split_options(lv)) for mode, topology in MODES
                 for lv in (dict(activation_checkpointing="none"), levers)]
        measured = measure_many(zoo.model, plans, example_input=zoo.example_input, labels=zoo.labels)
        for plan, got in zip(plans, measured):
            est = estimate(zoo.model, plan, example_input=zoo.example_input, labels=zoo.labels)
            rows.append(dict(model=name, mode=plan.mode, checkpointing=plan.activation_checkpointing,
                             k=plan.checkpoint_every, est_peak=est.peak_bytes, measured_peak=got.peak_bytes,
                             rel_error=round((est.peak_bytes - got.peak_bytes) / got.peak_bytes, 3),
                             est_activations=int(est.per_rank["activations_bytes"].max()),
                             recompute_fraction=round(est.recompute_forward_fraction, 2)))
    print(pd.DataFrame(rows).to_string(index=False))


if __name__ == "__main__":
    main()
