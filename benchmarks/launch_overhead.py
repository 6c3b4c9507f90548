"""Wall time to results for a trivial N-rank gloo function: the rank runner (``launch``, which
``measure`` and the tests' harness also use) vs ``torchrun`` on a script vs a plain
``multiprocessing`` spawn of the ranks from this process (what ``measure`` and the tests did before).

Run: ``python benchmarks/launch_overhead.py [--nprocs 4] [--repeat 1]``. One run of each (or
alternating runs and their medians), then the ratios (target: launch / torchrun <= 1.1). Not a
test: the numbers depend on the machine and its load.
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
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=1, help="alternate runs; the ratio of the medians")
    args = parser.parse_args()
    runs = []
    for _ in range(args.repeat):
        runs.append((*time_launch(args.nprocs), time_torchrun(args.nprocs), time_spawn(args.nprocs)))
    t_launch, t_start, t_torchrun, t_spawn = (statistics.median(r[i] for r in runs) for i in range(4))
    label = "median of %d" % args.repeat if args.repeat > 1 else "one run"
    print(f"{'runner (' + label + ')':<26}{'ranks':>6}{'wall s':>9}")
    print(f"{'snn_explorer.launcher':<26}{args.nprocs:>6}{t_launch:>9.2f}")
    print(f"{'  last rank started at':<26}{'':>6}{t_start:>9.2f}")
    print(f"{'torchrun (script)':<26}{args.nprocs:>6}{t_torchrun:>9.2f}")
    print(f"{'multiprocessing spawn':<26}{args.nprocs:>6}{t_spawn:>9.2f}")
    print(f"{'ratio launch / torchrun':<26}{'':>6}{t_launch / t_torchrun:>9.2f}")
    print(f"{'ratio launch / spawn':<26}{'':>6}{t_launch / t_spawn:>9.2f}")


if __name__ == "__main__":
    main()
