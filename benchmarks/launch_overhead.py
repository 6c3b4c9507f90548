"""Wall time to results for a trivial N-rank gloo function: a fresh launch of the rank runner
(``launch``, which ``measure`` and the tests' harness also use), a run on a warm ``RankPool``,
``torchrun`` on a script, and a plain ``multiprocessing`` spawn of the ranks from this process.

Run: ``python benchmarks/launch_overhead.py [--nprocs 2] [--repeat 5]``. Alternating runs of each and
their medians, then the ratios (targets: launch / torchrun <= 1.1; a warm pool run <= 1.0 s). The
pool's start (until its first result) and its close are timed once per repeat. Not a test: the
numbers depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

SCRIPT = '''
import torch
import torch.distributed as dist

def trivial():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()

dist.init_process_group("gloo")
value = trivial()
with open(f"{OUT}/rank{dist.get_rank()}.txt", "w") as fh:
    fh.write(str(value))
dist.destroy_process_group()
'''


def trivial():
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def time_launch(nprocs: int) -> float:
    from snn_explorer.launcher import launch

    start = time.perf_counter()
    result = launch(trivial, nprocs=nprocs, progress=False)
    elapsed = time.perf_counter() - start
    assert result.values == [float(nprocs)] * nprocs, result.values
    return elapsed, max(result.startup.values())


def time_pool(nprocs: int, runs: int):
    """(start until the first result, median warm run, close) of one RankPool."""
    from snn_explorer.ranks import RankPool

    start = time.perf_counter()
    pool = RankPool(nprocs, "gloo")
    assert pool.run(trivial) == [float(nprocs)] * nprocs
    first = time.perf_counter() - start
    warm = []
    for _ in range(runs):
        start = time.perf_counter()
        values = pool.run(trivial)
        warm.append(time.perf_counter() - start)
        assert values == [float(nprocs)] * nprocs, values
    start = time.perf_counter()
    pool.close()
    return first, statistics.median(warm), time.perf_counter() - start


def _spawned_rank(rank: int, nprocs: int, port: int, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, nprocs, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=nprocs)
    queue.put((rank, trivial()))
    dist.destroy_process_group()


def time_spawn(nprocs: int) -> float:
    """The baseline: a TCPStore here, ranks started with multiprocessing's spawn, values over a queue."""
    import multiprocessing

    import torch.distributed as dist

    start = time.perf_counter()
    store = dist.TCPStore("127.0.0.1", 0, nprocs, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_spawned_rank, args=(r, nprocs, store.port, queue)) for r in range(nprocs)]
    for p in procs:
        p.start()
    values = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join()
    elapsed = time.perf_counter() - start
    assert sorted(values.values()) == [float(nprocs)] * nprocs, values
    return elapsed


def time_torchrun(nprocs: int) -> float:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    with tempfile.TemporaryDirectory() as out:
        script = os.path.join(out, "trivial.py")
        with open(script, "w") as fh:
            fh.write(f"OUT = {out!r}\n" + SCRIPT)
        start = time.perf_counter()
        subprocess.run([torchrun, "--standalone", "--nproc-per-node", str(nprocs), script], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        values = [float(open(os.path.join(out, f"rank{r}.txt")).read()) for r in range(nprocs)]
        elapsed = time.perf_counter() - start
    assert values == [float(nprocs)] * nprocs, values
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5, help="alternate runs; the medians")
    args = parser.parse_args()
    runs = []
    for _ in range(args.repeat):
        runs.append((*time_launch(args.nprocs), *time_pool(args.nprocs, 5), time_torchrun(args.nprocs),
                     time_spawn(args.nprocs)))
    t_launch, t_start, p_first, p_warm, p_close, t_torchrun, t_spawn = (
        statistics.median(r[i] for r in runs) for i in range(7))
    label = "median of %d" % args.repeat if args.repeat > 1 else "one run"
    rows = [("fresh launch (snn_explorer)", t_launch), ("  last rank started at", t_start),
            ("warm RankPool run", p_warm), ("  pool start to 1st result", p_first), ("  pool close", p_close),
            ("torchrun (script)", t_torchrun), ("multiprocessing spawn", t_spawn)]
    print(f"| {'runner (' + label + ')':<30} | {'ranks':>5} | {'wall s':>7} |")
    print(f"|{'-' * 32}|{'-' * 7}|{'-' * 9}|")
    for name, value in rows:
        print(f"| {name:<30} | {args.nprocs:>5} | {value:>7.2f} |")
    print(f"| {'ratio launch / torchrun':<30} | {'':>5} | {t_launch / t_torchrun:>7.2f} |")
    print(f"| {'ratio warm run / launch':<30} | {'':>5} | {p_warm / t_launch:>7.2f} |")
    print(f"| {'ratio warm run / torchrun':<30} | {'':>5} | {p_warm / t_torchrun:>7.2f} |")


if __name__ == "__main__":
    main()
