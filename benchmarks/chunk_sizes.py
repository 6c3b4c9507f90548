"""Time chunks sized by estimate, against measurement (not a test).

Run: ``python benchmarks/chunk_sizes.py [--model mlp] [--size tiny] [--time-steps 8] [--rounds 3] [--steps 11]``. For a zoo model
(its module stepped once per time step: the zoo ``mlp``) at ``time_steps`` T on 2 gloo ranks (mode dp),
:func:`~snn_explorer.core.levers.chunk_choice.choose_chunks` estimates every chunk size it tries (powers of two below T, and
T); the plan without checkpointing and each size are then trained by ``measure_many()`` on 2 ranks, ``rounds`` times
(each round one set of ranks running every plan ``steps`` steps in turn, so that load which changes between rounds
falls on every size alike; ``--rounds 0`` skips the ranks). Prints, per size, the estimated and measured peak bytes per rank, the estimated step
time on the H100-SXM profile and on this machine's calibration, and the measured step time: the median of every
timed step of every round (the first step of each plan is the warm-up, dropped), with each size's step relative
to the plan without checkpointing, estimated and measured. Beside them, the step of one rank's model and batch
timed in this process on one thread (``compute_work.timed_step``, as the estimator's local correction times a
step), ``--timed`` times per size in turn, its median and least, beside the estimate for one rank of that batch on this machine: free of the ranks' collectives and waits, so the growth
with k shows through less noise. The one-rank estimate relative to its plan without
checkpointing is printed twice: with this machine's calibrated cost per checkpointed call (``checkpoint_overhead``,
and ``checkpoint_overhead_per_op`` per operator of the call's region) and without them; then that estimate over the
least-of ratio measured on one thread. Then which size the memory objective takes, the wall and CPU seconds the
measuring took (CPU: this process and its finished ranks) and the load average before and after.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import statistics
import time

import pandas as pd

import snn_explorer as se
from snn_explorer.core.levers import choose_chunks, chunked, copy_without_levers, find_time_step_module
from snn_explorer.core.model import detached_copy
from snn_explorer.core.parallelize import apply_activation_checkpointing
from snn_explorer.estimator import measure_many
from snn_explorer.estimator.calibration.this_machine import default_hardware
from snn_explorer.estimator.instruments.isolation import collector_paused, one_thread
from snn_explorer.estimator.profile.step import batch_slice
from snn_explorer.estimator.timing.checkpoint_probe import reference_step_s
from snn_explorer.estimator.timing.compute_work import timed_step
from snn_explorer.zoo import build


def _cpu_s() -> float:
    own, ranks = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + ranks.ru_utime + ranks.ru_stime


def _measured(zoo, plans, x, y, rounds: int, steps: int):
    """(peak bytes, every timed step's seconds) per plan, over ``rounds`` runs of ``measure_many``."""
    peaks, times = {i: set() for i in range(len(plans))}, {i: [] for i in range(len(plans))}
    if rounds == 0:  # one thread only
        return peaks, {i: [float("nan")] for i in times}
    for _ in range(rounds):
        for i, m in enumerate(measure_many(zoo.model, plans, example_input=x, labels=y, steps=steps)):
            peaks[i].add(m.peak_bytes)
            times[i] += m.step_time_s
    return peaks, times


def _timed_here(zoo, plans, x, y, times: int) -> dict:
    """(median, least) seconds of one rank's step (its batch share) of each plan's model, timed on one thread in
    turn (the least: the step with the least of other processes' work in it)."""
    models = []
    for plan in plans:
        model = detached_copy(zoo.model)
        apply_activation_checkpointing(model, plan, ())
        models.append(model)
    x, y = batch_slice(x, y, plans[0].per_rank_batch, x.shape[0])  # rank 0's share
    steps = {i: [] for i in range(len(plans))}
    with one_thread(), collector_paused():
        for _ in range(times):
            for i, model in enumerate(models):
                steps[i].append(sum(timed_step(model, x, y, "adam").values()))
    return {i: (statistics.median(v), min(v)) for i, v in steps.items()}


def plans_of(base, choice) -> list:
    """The plan without checkpointing, then each chunk size tried."""
    return [base] + [p for p, _ in choice.tried]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--size", default="tiny", help="the zoo size (tiny, small, full)")
    parser.add_argument("--time-steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="rounds on 2 gloo ranks (0: one thread only)")
    parser.add_argument("--steps", type=int, default=11)
    parser.add_argument("--timed", type=int, default=101)
    args = parser.parse_args()
    if args.rounds < 0:
        parser.error(f"--rounds {args.rounds}: expected 0 (one thread only) or more rounds on 2 gloo ranks")
    zoo = build(args.model, args.size)
    x, y = batch_slice(zoo.example_input, zoo.labels, zoo.batch_size, args.time_steps)
    step_module = find_time_step_module(zoo.model, x)
    if step_module is None:
        raise SystemExit(f"{args.model}: no module is stepped once per time step; time chunks do not apply")
    features = se.DistributedFeatureSet(allow_activation_checkpointing=True)
    base = copy_without_levers(se.plan(analysis=se.analyze(zoo.model), objective="speed", topology={"dp": 2},
                                       mode="dp", batch_size=zoo.batch_size, features=features))
    here = default_hardware()
    on_h100 = se.plan_estimator(zoo.model, x, y, hardware="H100-SXM")
    on_here = se.plan_estimator(zoo.model, x, y, hardware=here)
    # the same calibration without the checkpointing machinery's per-call cost (the estimate before it was counted)
    on_here_bare = se.plan_estimator(zoo.model, x, y, hardware=dataclasses.replace(here, checkpoint_overhead={},
                                                                                   checkpoint_overhead_per_op={}))
    choice = choose_chunks(base, step_module, on_h100)
    alone = copy_without_levers(se.plan(analysis=se.analyze(zoo.model), objective="speed", topology={"dp": 1},
                                        mode="dp", batch_size=base.per_rank_batch, features=features))
    one_rank = {p: alone if p is base else chunked(alone, step_module, p.checkpoint_every) for p in plans_of(base, choice)}
    plans = plans_of(base, choice)
    load_before, wall, cpu = os.getloadavg(), time.perf_counter(), _cpu_s()
    peaks, times = _measured(zoo, plans, x, y, args.rounds, args.steps)
    here_s = _timed_here(zoo, plans, x, y, args.timed)
    wall, cpu = time.perf_counter() - wall, _cpu_s() - cpu
    est_base, here_base, measured_base = on_h100(base), on_here(base), statistics.median(times[0])
    rows = []
    for i, plan in enumerate(plans):
        h100, local, measured = on_h100(plan), on_here(plan), statistics.median(times[i])
        rows.append({"chunk steps": "none" if plan is base else plan.checkpoint_every,
                     "est. peak B": h100.peak_bytes, "measured peak B": "/".join(map(str, sorted(peaks[i]))),
                     "est. step ms (H100-SXM)": round(h100.step_time_s * 1e3, 3),
                     f"est. step ms ({here.name})": round(local.step_time_s * 1e3, 3),
                     "measured step ms (median)": round(measured * 1e3, 3),
                     "est. / none (here)": round(local.step_time_s / here_base.step_time_s, 3),
                     "measured / none": round(measured / measured_base, 3),
                     "est. / none (H100)": round(h100.step_time_s / est_base.step_time_s, 3),
                     "est. 1 rank ms (here)": round(on_here(one_rank[plan]).step_time_s * 1e3, 3),
                     "est. 1 rank / none": round(on_here(one_rank[plan]).step_time_s / on_here(alone).step_time_s, 3),
                     "same, no ckpt cost": round(on_here_bare(one_rank[plan]).step_time_s
                                                 / on_here_bare(alone).step_time_s, 3),
                     "1 thread ms (median)": round(here_s[i][0] * 1e3, 3),
                     "1 thread / none": round(here_s[i][0] / here_s[0][0], 3),
                     "1 thread ms (least)": round(here_s[i][1] * 1e3, 3),
                     "least / none": round(here_s[i][1] / here_s[0][1], 3),
                     "est. / least (ratios)": round(on_here(one_rank[plan]).step_time_s / on_here(alone).step_time_s
                                                    / (here_s[i][1] / here_s[0][1]), 3),
                     "chosen": plan == choice.plan})
    print(f"{args.model} ({args.size}), T = {args.time_steps}, dp on 2 gloo ranks; time-stepped module {step_module!r}; "
          f"{args.rounds} rounds x {args.steps} steps (the first of each dropped); one thread: {args.timed} steps")
    print(pd.DataFrame(rows).to_string(index=False))
    print(f"checkpoint_overhead of {here.name!r} (s per checkpointed call): {dict(here.checkpoint_overhead)}; "
          f"checkpoint_overhead_per_op (s per operator of a call's region): {dict(here.checkpoint_overhead_per_op)}")
    if here.checkpoint_reference_s:
        print(f"reference probe step (timing.checkpoint_probe): {here.checkpoint_reference_s * 1e3:.3f} ms at "
              f"calibration, {reference_step_s() * 1e3:.3f} ms now (the estimate scales the two figures above by "
              "the same step timed when it estimates)")
    print(f"measuring: {wall:.1f} s wall, {cpu:.1f} s CPU (this process and its ranks); load average "
          f"{load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
