"""The warm side of a :class:`~snn_explorer.ranks.pool.RankPool`: what each of its elastic workers runs.

A warm rank has imported torch and the package once (in the agent, before elastic forked it) and
then waits for runs. For each run it forks one fresh rank process, which sets the run's
environment, working directory and ``sys.path``, connects to a store made for this run alone and
enters :func:`~snn_explorer.ranks.rank.run_rank`, exactly as a rank of a fresh launch does. The
rank process is a fork of an untouched interpreter, so its RNG state, modules, process group and
device meshes are those of a fresh launch's rank, whatever an earlier run did. The warm rank waits
for it, ends whatever it left behind (its orphans are adopted here) and says how it ended in the
run's event file (an ``exit`` event with ``reaped``), which is how the caller knows the run is over.

Runs arrive as ``jobs/<n>.json`` in the pool's directory, numbered from 1. Warm rank 0 serves each
run's store (a loopback ``TCPStore``) and closes it when the run is over, so a run leaves no port.
"""
from __future__ import annotations

import gc
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Optional

import torch
from torch.distributed import TCPStore

from . import channel, process, rank

#: Seconds between looks for the next job: short right after a run, longer once the pool idles.
JOB_POLL_S = (0.005, 0.05)
#: Seconds after a run before the longer poll.
BUSY_S = 2.0
#: Seconds a rank process waits for its run's store to be served before it gives up.
STORE_WAIT_S = 60.0
#: The variables elastic sets for its workers (besides ``TORCHELASTIC_*``): a run's rank keeps the
#: warm rank's, over the run's environment.
ELASTIC_KEYS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
                "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def loopback_store(timeout_s: int = 60) -> TCPStore:
    """A ``TCPStore`` server whose socket listens on 127.0.0.1 only (TCPStore alone binds every
    interface, so the socket is bound first and handed over)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    return TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, master_listen_fd=sock.detach(),
                    timeout=timedelta(seconds=timeout_s))


def _next_job(pool_dir: str, number: int) -> dict:
    """Job ``number`` once the caller posts it."""
    target = channel.path(pool_dir, "jobs", f"{number}.json")
    since = time.monotonic()
    while not os.path.exists(target):
        time.sleep(JOB_POLL_S[0] if time.monotonic() - since < BUSY_S else JOB_POLL_S[1])
    return channel.read_json(target)


def serve(pool_dir: str, backend: str) -> None:
    """A warm rank: announce itself (a ``ready`` event in the pool's directory), then run the jobs in
    order for as long as the agent lives."""
    rank._default_signals()
    me = int(os.environ["RANK"])
    rank.exit_with_parent(os.getppid(), lambda: os._exit(70))
    process.become_subreaper()
    gc.collect()
    gc.freeze()  # what is imported now is shared with every run's fork and never scanned there
    channel.emit(pool_dir, me, "ready", pid=os.getpid())
    number = 1
    while True:
        job = _next_job(pool_dir, number)
        number += 1
        if os.path.isdir(job["run_dir"]):  # else the caller has given that run up
            _serve_job(job, me, backend)


def _serve_job(job: dict, me: int, backend: str) -> None:
    """Fork this run's rank process, serve its store (rank 0), wait for it, end what it left, say so."""
    run_dir = job["run_dir"]
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _rank_process(job, me, backend)  # never returns
    store = _serve_store(run_dir, job["nprocs"]) if me == 0 else None
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    process.kill_tree(os.getpid())  # what the rank left running (adopted here: this process is a subreaper)
    _reap()
    after = _ended_after(run_dir) if code < 0 else None
    try:
        channel.emit(run_dir, me, "exit", code=code, after=after, reaped=True)
    except OSError:  # the caller has removed the run directory
        pass
    if store is not None:
        _wait_run_over(run_dir, job["nprocs"])
        del store  # closes its port


def _serve_store(run_dir: str, nprocs: int):
    """A loopback store for this run alone; its port goes to ``store_port`` for the rank processes."""
    store = loopback_store(timeout_s=int(STORE_WAIT_S))
    try:
        channel.write_atomic(channel.path(run_dir, "store_port"), str(store.port).encode())
    except OSError:
        pass
    return store


def _wait_run_over(run_dir: str, nprocs: int) -> None:
    """Until every rank's process was reaped, or the caller removed the run directory."""
    while os.path.isdir(run_dir):
        reaped = set()
        for r in range(nprocs):
            try:
                with open(channel.path(run_dir, "events", f"{r}.jsonl")) as fh:
                    if '"reaped": true' in fh.read():
                        reaped.add(r)
            except OSError:
                pass
        if len(reaped) == nprocs:
            return
        time.sleep(JOB_POLL_S[0])


def _reap() -> None:
    """Collect the exit status of every ended child (adopted orphans included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _ended_after(run_dir: str) -> Optional[int]:
    """The rank whose failure made the caller end the others (``ended_after``), if it did."""
    try:
        with open(channel.path(run_dir, "ended_after")) as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return None


def _store_port(run_dir: str) -> str:
    target = channel.path(run_dir, "store_port")
    deadline = time.monotonic() + STORE_WAIT_S
    while not os.path.exists(target):
        if time.monotonic() > deadline or not os.path.isdir(run_dir):
            raise RuntimeError(f"warm rank 0 served no store for this run within {STORE_WAIT_S:g} s")
        time.sleep(0.002)
    with open(target) as fh:
        return fh.read().strip()


def _rank_process(job: dict, me: int, backend: str) -> None:
    """The run's rank: its logs, environment, directory, ``sys.path`` and store, then ``run_rank``."""
    try:
        run_dir = job["run_dir"]
        logs = channel.path(run_dir, "logs", "pool", "attempt_0", str(me))
        os.makedirs(logs, exist_ok=True)
        for fd, name in ((1, "stdout.log"), (2, "stderr.log")):
            out = os.open(os.path.join(logs, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(out, fd)
            os.close(out)
        elastic = {k: v for k, v in os.environ.items() if k in ELASTIC_KEYS or k.startswith("TORCHELASTIC_")}
        os.environ.clear()  # the caller's environment at the run's call, as a fresh launch's agent gets it
        os.environ.update({**job["env"], **elastic})
        tempfile.tempdir = None  # gettempdir() looks at TMPDIR again
        os.chdir(job["cwd"])
        sys.path[:] = job["sys_path"] + ([] if process.PACKAGE_ROOT in job["sys_path"] else [process.PACKAGE_ROOT])
        os.environ["MASTER_PORT"] = _store_port(run_dir)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # every rank a client of the run's store
        _fresh_seeds(job["seed"])
        rank.run_rank(run_dir, backend, job["pg_timeout"])
    except BaseException:  # noqa: BLE001 - a rank process never returns into the warm rank's loop
        traceback.print_exc()
        sys.stderr.flush()
    os._exit(1)


def _fresh_seeds(seed: int) -> None:
    """The RNG state a fresh launch's rank starts with: torch's default generators seeded with one
    random 64-bit seed shared by the ranks (a fresh agent seeds itself so at import, and its ranks
    inherit it), numpy's global state too where the warm rank imported numpy; Python's ``random`` is
    reseeded by the fork itself, per process, as in a fresh launch."""
    torch.manual_seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed % 2 ** 32)


def job_text(run_dir: str, nprocs: int, pg_timeout, env: dict) -> bytes:
    """What the caller posts as ``jobs/<n>.json``: the run, the ranks' whole environment (``env``), and one
    fresh seed for its ranks."""
    return json.dumps({"run_dir": run_dir, "nprocs": nprocs, "pg_timeout": pg_timeout, "env": env,
                       "cwd": os.getcwd(), "sys_path": list(sys.path),
                       "seed": int.from_bytes(os.urandom(8), "little")}).encode()
