"""The main job end to end: analyze a built-in SNN, compare plans for 4 ranks, apply one on 4 gloo ranks.

Run: ``python -m snn_explorer.quickstart [--model mlp] [--steps 3] [--nprocs 4]``
"""
from __future__ import annotations

import argparse
import uuid

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn

from . import analyze, apply, plan, SNNDistributedPlan
from .explorer import analysis_table, plans_table
from .zoo import build

TOPOLOGIES = ({"dp": 4}, {"dp": 2, "tp": 2}, {"tp": 4})


def train_rank(plan_data: dict, model_name: str, steps: int) -> list:
    """One rank: build the model (same seed everywhere), apply the plan, train ``steps`` steps."""
    dist.init_process_group("gloo")
    try:
        torch.set_num_threads(1)
        zoo = build(model_name, batch_size=SNNDistributedPlan.from_dict(plan_data).batch_size)
        runtime = apply(model=zoo.model, plan=SNNDistributedPlan.from_dict(plan_data), device_type="cpu")
        optimizer = runtime.build_optimizer(lr=1e-2)
        share = runtime.plan.per_rank_batch
        start = runtime.dp_rank * share
        inputs, labels = zoo.example_input[:, start:start + share], zoo.labels[start:start + share]
        losses = []
        for _ in range(steps):
            loss, _ = runtime.forward_loss(nn.CrossEntropyLoss(), inputs, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(round(loss.item(), 6))
        return losses
    finally:
        dist.destroy_process_group()


def run_on_gloo(plan_: SNNDistributedPlan, model_name: str, steps: int) -> dict:
    """Run :func:`train_rank` on the plan's ranks through torch's elastic launcher."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=plan_.world_size, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, start_method="spawn",
                          monitor_interval=0.1)
    return elastic_launch(config, train_rank)(plan_.to_dict(), model_name, steps)


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
    plans = [plan(analysis=analysis, objective=o, topology=t, backend="torch", batch_size=zoo.batch_size)
             for o in ("speed", "memory", "capacity") for t in TOPOLOGIES]
    print("\n== plans for 4 ranks ==")
    print(plans_table(plans).to_string())
    chosen = plan(analysis=analysis, objective="memory", topology={"dp": 2, "tp": 2}, backend="torch",
                  batch_size=zoo.batch_size)
    print(f"\n== applying {chosen!r} on 4 gloo ranks for {args.steps} steps ==")
    losses = run_on_gloo(chosen, args.model, args.steps)
    table = pd.DataFrame({f"rank {r}": v for r, v in sorted(losses.items())})
    table.index.name = "step"
    print(table.to_string())


if __name__ == "__main__":
    main()
