"""The main job end to end: analyze a built-in SNN, compare plans for 4 ranks, apply one on 4 gloo ranks.

Run: ``python -m snn_explorer.quickstart [--model mlp] [--steps 3] [--nprocs 4]``
"""
from __future__ import annotations

import argparse

import pandas as pd
from torch import nn

from . import analyze, plan, SNNDistributedPlan
from .explorer import analysis_table, plans_table
from .launcher import launch_plan
from .zoo import build

TOPOLOGIES = ({"dp": 4}, {"dp": 2, "tp": 2}, {"tp": 4})


def train_step(runtime, step, batch, state, inputs, labels) -> float:
    """One training step on one rank (``launch_plan``'s signature): this dp rank's share of the batch."""
    share = runtime.plan.per_rank_batch
    start = runtime.dp_rank * share
    loss, _ = runtime.forward_loss(nn.CrossEntropyLoss(), inputs[:, start:start + share], labels[start:start + share])
    optimizer = state["optimizer"]
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return round(loss.item(), 6)


def run_on_gloo(plan_: SNNDistributedPlan, model_name: str, steps: int) -> dict:
    """Train the zoo model on the plan's gloo ranks through :func:`launch_plan`; rank -> losses."""
    zoo = build(model_name, batch_size=plan_.batch_size)
    result = launch_plan(zoo.model, plan_, train_step, steps=steps, optimizer={"lr": 1e-2}, comm_backend="gloo",
                         train_kwargs={"inputs": zoo.example_input, "labels": zoo.labels})
    return result.losses


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    pd.set_option("display.width", 200)
    pd.set_option("display.max_colwidth", 80)
    zoo = build(args.model)
    analysis = analyze(zoo.model, model_family=zoo.family)
    print(f"== {args.model}: stateful neurons and TP candidates ==")
    print(analysis_table(analysis).to_string(index=False))
    plans = [plan(analysis=analysis, objective=o, topology=t, neuron_backend="torch", batch_size=zoo.batch_size)
             for o in ("speed", "memory", "capacity") for t in TOPOLOGIES]
    print("\n== plans for 4 ranks ==")
    print(plans_table(plans).to_string())
    chosen = plan(analysis=analysis, objective="memory", topology={"dp": 2, "tp": 2}, neuron_backend="torch",
                  batch_size=zoo.batch_size)
    print(f"\n== applying {chosen!r} on 4 gloo ranks for {args.steps} steps ==")
    losses = run_on_gloo(chosen, args.model, args.steps)
    table = pd.DataFrame({f"rank {r}": v for r, v in sorted(losses.items())})
    table.index.name = "step"
    print(table.to_string())


if __name__ == "__main__":
    main()
