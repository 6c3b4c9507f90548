"""fit_budget at shrinking memory budgets: the plan found, its estimated (and measured) peak, step time, search time.

Run: ``python benchmarks/memory_fit.py [--models spikformer vgg] [--world-size 2] [--hardware H100-SXM]
[--size tiny] [--time-steps 16] [--measure [--device cuda]] [--generated 10000] [--reference]``. Per model, the budget is 100 %,
75 %, 50 % and 35 % of the unlevered peak (the estimated peak of the fastest plan without memory levers); each row
is what :func:`snn_explorer.fit_budget` returns there (levers: checkpointing by blocks, every 1st or 2nd, or block
by block; time chunks sized by estimate, :func:`~snn_explorer.core.levers.chunk_choice.choose_chunks`; spike compression; both; on a profile with a host link activation offload and FSDP2's CPU
offload), or the lowest estimated peak when no plan fits. ``--measure`` also trains each
chosen plan on ``world_size`` gloo ranks (``measure``; ``--device cuda``: NCCL ranks, a GPU each, where the
offload plans run too) and prints its measured peak. ``--generated M`` adds the
search on a generated all-steps MLP of about M modules (``explorer_latency``'s builder) at 100 % and 50 %
(wall and CPU seconds: ``search_s``, ``search_cpu_s``).

``--reference`` says whether the reference project's ``memopt`` (spikingjelly 2.0.0,
``spikingjelly.activation_based.memopt.optimize_memory``) runs here, on its own CIFAR10-DVS VGG
(``examples/memopt/models.py`` ``CIFAR10DVSVGG``): it calls each level on this machine and prints what
happened (levels 2-4 profile CUDA memory and raise on a machine without CUDA; levels 0-1 run on CPU).
"""
from __future__ import annotations

import argparse
import re
import time
from types import SimpleNamespace

import pandas as pd
import torch
from explorer_latency import _generated
from spikingjelly.activation_based import memopt, neuron
from spikingjelly.activation_based.examples.memopt.models import CIFAR10DVSVGG, VGGBlock

from snn_explorer import fit_budget
from snn_explorer.compat import mem_tracker_class
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
    offloads = found.plan.activation_offload or found.plan.cpu_offload
    if args.measure and offloads and args.device != "cuda":
        row.update(measured_peak="- (CUDA only)")  # apply refuses both on CPU ranks: their memory is the host's
    elif args.measure:
        got = measure(zoo.model, found.plan, example_input=zoo.example_input, labels=zoo.labels, device=args.device)
        row.update(measured_peak=got.peak_bytes,
                   rel_error=round((found.estimate.peak_bytes - got.peak_bytes) / got.peak_bytes, 3))
    return row


def _generated_rows(modules: int, args) -> list:
    """The search on a generated all-steps MLP of about ``modules`` modules, at 100 % and 50 % of its unlevered peak."""
    model, x, _ = _generated(modules)
    count = sum(1 for _ in model.modules())
    cpu = time.process_time()
    top = fit_budget(model, x, 2 ** 50, args.world_size, hardware=args.hardware)
    rows = [dict(model=f"generated ({count} modules)", budget_share=1.0, budget_bytes=top.estimate.peak_bytes,
                 plan=top.table["plan"].iloc[0], est_peak=top.estimate.peak_bytes,
                 step_ms=round(top.estimate.step_time_s * 1e3, 3), search_s=round(top.search_s, 2),
                 search_cpu_s=round(time.process_time() - cpu, 2), candidates=len(top.table))]
    budget = int(top.estimate.peak_bytes * 0.5)
    started, cpu = time.perf_counter(), time.process_time()
    try:
        found = fit_budget(model, x, budget, args.world_size, hardware=args.hardware)
        rows.append(dict(rows[0], budget_share=0.5, budget_bytes=budget, plan=found.table["plan"].iloc[0],
                         est_peak=found.estimate.peak_bytes, step_ms=round(found.estimate.step_time_s * 1e3, 3),
                         search_s=round(found.search_s, 2), search_cpu_s=round(time.process_time() - cpu, 2),
                         candidates=len(found.table)))
    except ValueError as exc:
        lowest = re.search(r"lowest estimated peak is (\d+) B \((.*)\)", str(exc))
        rows.append(dict(rows[0], budget_share=0.5, budget_bytes=budget, plan=f"none fits (lowest: {lowest.group(2)})",
                         est_peak=int(lowest.group(1)), step_ms=None, search_s=round(time.perf_counter() - started, 2),
                         search_cpu_s=round(time.process_time() - cpu, 2), candidates=None))
    return rows


def memopt_vgg(seed: int = 0) -> SimpleNamespace:
    """The reference's own VGG (``CIFAR10DVSVGG``, its default dropout 0.25) on its input ``[N=8, T=10, 2, 48,
    48]`` (N first, as its forward takes it), 0/1 event frames and 10 class labels."""
    torch.manual_seed(seed)
    return SimpleNamespace(model=CIFAR10DVSVGG(), example_input=(torch.rand(8, 10, 2, 48, 48) < 0.2).float(),
                           labels=torch.randint(0, 10, (8,)))


def _memopt_step(model, x, labels) -> float:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = torch.nn.functional.cross_entropy(model(x).mean(0), labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def _reference_side_by_side(per_rank: int) -> list:
    """The reference memopt's levels 0 and 1 (the ones that run without CUDA) on its VGG with ``per_rank`` of the 8
    samples (what one of our dp ranks holds): torch's MemTracker peak of one training step (forward, backward,
    Adam) after a warm-up step, and that step's wall time on this CPU."""
    rows = []
    for level in (0, 1):
        ref = memopt_vgg()
        x, y = ref.example_input[:per_rank], ref.labels[:per_rank]
        model = memopt.optimize_memory(ref.model, VGGBlock, lambda current: current(x), level=level)
        _memopt_step(model, x, y)  # warm-up: Adam's state exists
        tracker = mem_tracker_class()()
        tracker.track_external(model, x)
        with tracker:
            started = time.perf_counter()
            _memopt_step(model, x, y)
            wall = time.perf_counter() - started
        rows.append(dict(level=level, samples=per_rank, measured_peak=tracker.get_tracker_snapshot("peak")[x.device]["Total"],
                         cpu_step_s=round(wall, 2)))
    return rows


def _reference_levels() -> list:
    """What each level of the reference memopt does on this machine, on its own VGG (a 1-sample, 2-step input:
    only whether it runs is asked here)."""
    rows = []
    for level in (0, 1, 2, 3, 4):
        model = CIFAR10DVSVGG()
        dummy = torch.zeros(1, 2, 2, 48, 48)
        try:
            memopt.optimize_memory(model, VGGBlock, lambda current: current(dummy), level=level,
                                   split_fn=lambda module: (module.proj_bn, module.neuron),
                                   can_chunk=lambda module: isinstance(module, neuron.BaseNode))
            rows.append(dict(level=level, runs_here=True, result="returned the model"))
        except RuntimeError as exc:
            rows.append(dict(level=level, runs_here=False, result=f"RuntimeError: {exc}"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["spikformer", "mlp_all_steps"],
                        help="zoo models, and memopt_vgg: the reference's VGG on its [8, 10, 2, 48, 48] input")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--size", default="tiny", help="zoo size (tiny, small, full)")
    parser.add_argument("--time-steps", type=int, default=16, help="T: activations and neuron state grow with it")
    parser.add_argument("--hardware", default="H100-SXM", help="a built-in hardware profile for the step times")
    parser.add_argument("--measure", action="store_true", help="measure each chosen plan on ranks too")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where --measure trains: cpu (gloo ranks) or cuda (NCCL, a GPU per rank; offloads too)")
    parser.add_argument("--generated", type=int, default=0, help="also search a generated model of this many modules")
    parser.add_argument("--reference", action="store_true", help="try each level of the reference memopt here")
    args = parser.parse_args()
    if args.reference:
        print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
        print(pd.DataFrame(_reference_levels()).to_string(index=False))
        print(pd.DataFrame(_reference_side_by_side(8 // args.world_size)).to_string(index=False))
    rows = []
    for name in args.models:
        zoo = memopt_vgg() if name == "memopt_vgg" else build(name, args.size, time_steps=args.time_steps)
        top = fit_budget(zoo.model, zoo.example_input, 2 ** 50, args.world_size, labels=zoo.labels,
                         hardware=args.hardware)
        for share in SHARES:
            rows.append(_row(name, share, int(top.estimate.peak_bytes * share), zoo, args))
    if args.generated:
        rows += _generated_rows(args.generated, args)
    with pd.option_context("display.width", 250, "display.max_colwidth", 60):
        print(pd.DataFrame(rows).to_string(index=False))


if __name__ == "__main__":
    main()
