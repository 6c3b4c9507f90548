"""How often a 2-rank gloo group fails to form on one loaded host, with and without torch's init barrier.

Each run forks two ranks that join a gloo group over a loopback store, all-reduce once, make a
``new_group`` and leave at once (destroy, exit): the pattern of a short rank function. The rank that
finishes first closes its sockets while its peer may still be completing its side of the new group's
connection, which gloo reports as ``connectFullMesh failed ... Connection closed by peer``.
``TORCH_DIST_INIT_BARRIER=1`` (what :func:`snn_explorer.ranks.init_process_group` sets for gloo) makes
every rank wait, through the store, until all have joined each group.

Run: ``python benchmarks/gloo_connect_race.py [--runs 250] [--burners 2]``. ``--burners`` busy-loop
processes load the cores as a test tier running beside it does. Not a test: the failure rate depends
on the machine and its load.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import TCPStore

from snn_explorer.ranks.warm import loopback_store

TIMEOUT = timedelta(seconds=30)


def _rank(rank: int, port: int) -> None:
    """Join, all-reduce, make a sub-group, leave; exit code 1 on any error."""
    try:
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=TIMEOUT)
        dist.all_reduce(torch.ones(4))
        dist.new_group([0, 1])
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - counted, and its first line shown
        sys.stderr.write(f"rank {rank}: {str(exc).splitlines()[0][:120]}\n")
        os._exit(1)
    os._exit(0)


def _one_run() -> bool:
    """True when both ranks ended cleanly."""
    store = loopback_store(int(TIMEOUT.total_seconds()))
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            _rank(rank, store.port)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    return not any(codes)


def _burn() -> None:
    while True:
        pass


def trial(runs: int, barrier: bool) -> tuple:
    """(failed runs, seconds) over ``runs`` runs."""
    os.environ["TORCH_DIST_INIT_BARRIER"] = "1" if barrier else "0"
    start = time.monotonic()
    failed = sum(not _one_run() for _ in range(runs))
    return failed, time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=250)
    parser.add_argument("--burners", type=int, default=2)
    args = parser.parse_args()
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(args.burners)]
    for proc in burners:
        proc.start()
    try:
        rows = [(barrier, *trial(args.runs, barrier)) for barrier in (False, True)]
    finally:
        for proc in burners:
            proc.terminate()
    print(f"\n{os.cpu_count()} cores, {args.burners} busy-loop processes beside, torch {torch.__version__}\n")
    print("| TORCH_DIST_INIT_BARRIER | runs | failed | seconds |")
    print("|---|---|---|---|")
    for barrier, failed, seconds in rows:
        print(f"| {int(barrier)} | {args.runs} | {failed} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
