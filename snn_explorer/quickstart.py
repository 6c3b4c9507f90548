"""The main job, as a short report: analyze a built-in SNN, compare the plans for 4 ranks with the
estimator's numbers, then train the chosen plan for a few steps on 4 gloo ranks of this machine.

Run: ``python -m snn_explorer.quickstart [--model mlp] [--steps 3]``
"""
from __future__ import annotations

import argparse
import textwrap
from typing import List

from .core import analyze, plan
from .estimator import enumerate_plans, estimate
from .explorer.steps import example_step
from .launcher import LaunchOptions, launch_plan
from .zoo import ZOO_NAMES, build

WORLD_SIZE = 4
TOPOLOGY = {"dp": 2, "tp": 2}
OBJECTIVE = "memory"
WIDTH = 96


#: One training step on one rank (``launch_plan``'s signature): this dp rank's share of the batch,
#: cross-entropy, an optimizer step; the loss rounded to 6 digits for the printed table.
train_step = example_step(ndigits=6)


def _size(n: float) -> str:
    for unit, scale in (("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _say(text: str, indent: str = "  ") -> None:
    print(textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent))


def _analysis_lines(analysis) -> List[str]:
    neurons = ", ".join(analysis.neuron_names) or "none"
    layers = ", ".join(f"{s.name} ({s.in_features}->{s.out_features})" for s in analysis.linear_shapes
                       if s.name in analysis.tensor_parallel_candidate_names)
    others = [n for n in analysis.memory_module_names if n not in analysis.neuron_names]
    return [f"{len(analysis.neuron_names)} stateful neuron module(s), reset before every batch: {neurons}"
            + (f" (and {len(others)} other stateful module(s): {', '.join(others)})" if others else ""),
            f"{len(analysis.tensor_parallel_candidate_names)} Linear layer(s) tensor parallelism can split: {layers or 'none'}"]


def _plans_table(zoo, analysis) -> List[str]:
    plans = enumerate_plans(analysis, world_size=WORLD_SIZE, batch_size=zoo.batch_size, objective=OBJECTIVE)
    head = f"  {'plan':<10}{'mesh':<14}{'samples/rank':>13}{'peak memory/rank':>18}{'sent/step':>12}{'collectives':>13}"
    lines = [head]
    for p in plans:
        e = estimate(zoo.model, p, example_input=zoo.example_input, labels=zoo.labels)
        s = e.summary()
        lines.append(f"  {s['mode']:<10}{s['mesh']:<14}{s['batch_per_rank']:>13}{_size(s['peak_bytes']):>18}"
                     f"{_size(s['comm_bytes']):>12}{s['collectives']:>13}")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=ZOO_NAMES)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: must be at least 1")
    zoo = build(args.model)
    analysis = analyze(zoo.model, model_family=zoo.family)
    t, n = zoo.example_input.shape[:2]
    print(f"snn_explorer quickstart: the built-in {args.model!r} SNN, {t} time steps, global batch {n}\n")
    print("1. What the analysis found")
    for line in _analysis_lines(analysis):
        _say(line)
    print(f"\n2. The plans for {WORLD_SIZE} ranks, estimated per rank for one training step (Adam)")
    print("\n".join(_plans_table(zoo, analysis)))
    _say("dp copies the whole model to every rank; +zero shards the optimizer state; fsdp2 shards parameters, "
         "gradients and optimizer state; tp splits each layer (and its neurons' state) over the ranks; "
         "fsdp2_tp does both on a 2-D mesh.")
    chosen = plan(analysis=analysis, objective=OBJECTIVE, topology=TOPOLOGY, batch_size=zoo.batch_size)
    mesh = " x ".join(f"{k}={v}" for k, v in TOPOLOGY.items())
    print(f"\n3. Training {chosen.mode} on {WORLD_SIZE} gloo ranks ({mesh}) for {args.steps} steps")
    _say(f"Why this plan: the objective {' '.join(chosen.rationale)}")
    result = launch_plan(zoo.model, chosen, train_step, steps=args.steps, optimizer={"lr": 1e-2}, train_kwargs={"inputs": zoo.example_input, "labels": zoo.labels}, options=LaunchOptions(comm_backend="gloo", progress=False))
    losses = result.losses
    groups = sorted({tuple(r for r in losses if losses[r] == losses[rank]) for rank in losses})
    print(f"  {'step':<6}" + "".join(f"{'loss, ranks ' + '+'.join(map(str, g)):>20}" for g in groups))
    for step in range(args.steps):
        print(f"  {step:<6}" + "".join(f"{losses[g[0]][step]:>20.4f}" for g in groups))
    _say(f"Ranks that print the same loss are tensor-parallel peers: they compute one model copy together on the "
         f"same {chosen.per_rank_batch} samples. The {chosen.dp_size} copies train on different samples, "
         "so their losses differ; their gradients are averaged every step. "
         f"Took {result.wall_time:.1f} s, of which {max(result.startup.values()):.1f} s starting the ranks.")
    print("\nNext")
    _say("Explore the trade-offs interactively (the set-up installed JupyterLab): "
         ".venv/bin/jupyter lab notebooks/01_quickstart.ipynb (add --allow-root when running as root).")
    _say("Compare plans for your own model: .venv/bin/snn-explorer compare mypkg.models:make_net "
         "--topology dp=2,tp=2 --objective memory --input-shape T,N,F (your example input's shape)")


if __name__ == "__main__":
    main()
