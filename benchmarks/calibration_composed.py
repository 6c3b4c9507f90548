"""The calibration's timed step composed from cut runs against the whole step (not a test).

Run: ``python benchmarks/calibration_composed.py [--modules 1000] [--rounds 6]``

On a machine-calibrated estimate, ``local_correction`` times one training step of the profiled model
(forward, backward, optimizer) and divides by the modelled time. For a model of repeated blocks it now times
the model cut to 2 and 64 repeats and composes the whole step from them
(``estimator.timing.compute_work.composed_step``). This prints, for a generated deep all-steps MLP (the
explorer latency benchmark's), each phase's whole and composed time per round, by wall clock (what the
calibration reads) and by the thread's CPU time (what other processes' load moves less), the minimum of each
over the rounds, the relative difference of those minima, and the CPU seconds each way took.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from explorer_latency import _generated  # noqa: E402  (the same generated model)

from snn_explorer.core.common import collector_paused  # noqa: E402
from snn_explorer.estimator.instruments.isolation import one_thread  # noqa: E402
from snn_explorer.estimator.profile.profiling import model_profile  # noqa: E402
from snn_explorer.estimator.profile.step import batch_slice  # noqa: E402
from snn_explorer.estimator.timing.compute_work import PHASES, composed_step, timed_step  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    model, x, y = _generated(args.modules)
    profile = model_profile(model, x, y)
    n, t = profile.example_input.shape[1], profile.example_input.shape[0]
    x, y = batch_slice(profile.example_input, profile.labels, n, t, layout=profile.layout)
    print(f"generated {args.modules} modules, example batch {n} x {t} steps; load average "
          f"{' / '.join(f'{v:.1f}' for v in os.getloadavg())}; torch {torch.__version__}")
    least = {}
    for r in range(args.rounds):
        for clock in (time.perf_counter, time.thread_time):
            with one_thread(), collector_paused():
                start = time.process_time()
                whole = timed_step(profile.model, x, y, "adam", clock)
                mid = time.process_time()
                composed = composed_step(profile.model, x, y, "adam", clock)
                cpu = (mid - start, time.process_time() - mid)
            for p in PHASES:
                a, b = least.get((clock.__name__, p), (float("inf"), float("inf")))
                least[clock.__name__, p] = (min(a, whole[p]), min(b, composed[p]))
            print(r, clock.__name__, "; ".join(f"{p} whole {whole[p] * 1e3:.1f} ms composed {composed[p] * 1e3:.1f} ms"
                                               for p in PHASES), f"| CPU s: whole {cpu[0]:.2f}, composed {cpu[1]:.2f}",
                  flush=True)
    print("minimum over the rounds:")
    for (clock, p), (a, b) in least.items():
        print(f"  {clock:12s} {p:9s} whole {a * 1e3:8.1f} ms  composed {b * 1e3:8.1f} ms  ({b / a - 1:+.1%})")
    print(f"load average {' / '.join(f'{v:.1f}' for v in os.getloadavg())} (1/5/15 min)")


if __name__ == "__main__":
    main()
