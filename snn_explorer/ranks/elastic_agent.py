"""What the agent process runs (``python -m snn_explorer.ranks.elastic_agent RUN_DIR``): torch elastic
on its own main thread, in its own session, with loopback-only stores.

It imports torch and the package once, then elastic *forks* the ranks from it (so no rank imports
torch again), each entering :func:`snn_explorer.ranks.rank.run_rank`. Every port it opens listens
on 127.0.0.1. When a rank fails, the ranks still running are asked for their Python stacks
(where each one was waiting) before elastic ends them, and their ends are recorded as caused by
that failure. It ends every descendant before it exits, and removes the run directory if its
parent dies.
"""
import importlib
import json
import os
import shutil
import signal
import socket
import sys
import time
import traceback

import cloudpickle  # noqa: F401  (imported once here, inherited by the forked ranks)
import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from .. import compat_elastic
from . import channel, process, rank, warm
from .warm import loopback_store

#: Seconds the ranks still running get to write their stacks after another rank failed.
STACK_WAIT_S = 1.0


class ExitRecorder:
    """Emits an ``exit`` event for every worker as soon as it exits and keeps its code (elastic
    reports one failed worker only, and a worker's clean exit not at all). On the first failure it
    asks the workers still running for their stacks; their later ends name that failure."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.codes: dict = {}
        self.first_failure = None
        self.alive_at_failure: set = set()
        #: Workers forked but not yet started at the first failure: until a rank resets its signal handlers, a
        #: SIGTERM meets elastic's handler (inherited by the fork), which makes the worker exit with code 1.
        self.unstarted_at_failure: set = set()

    def record(self, processes) -> None:
        for local_rank, proc in enumerate(processes):
            code = proc.exitcode
            if code is None or local_rank in self.codes:
                continue
            self.codes[local_rank] = code
            after = self.first_failure if self._ended_by_agent(local_rank, code) else None
            channel.emit(self.run_dir, local_rank, "exit", code=code, after=after)
            if code != 0 and self.first_failure is None:
                self.first_failure = local_rank
                self.dump_peer_stacks(processes)

    def _ended_by_agent(self, local_rank: int, code: int) -> bool:
        return ((local_rank in self.alive_at_failure and code < 0)
                or (local_rank in self.unstarted_at_failure and code != 0))

    def dump_peer_stacks(self, processes) -> None:
        """SIGUSR1 (faulthandler) to every started worker still running; wait for their stacks. Notes the workers
        not started yet."""
        waiting = {}
        for local_rank, proc in enumerate(processes):
            started = os.path.exists(channel.path(self.run_dir, "events", f"{local_rank}.jsonl"))
            if proc.exitcode is None and not started:
                self.unstarted_at_failure.add(local_rank)  # no stack handler yet: SIGUSR1 would kill it
            elif proc.exitcode is None:
                self.alive_at_failure.add(local_rank)
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                    waiting[local_rank] = channel.path(self.run_dir, "stacks", f"{local_rank}.txt")
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + STACK_WAIT_S
        while waiting and time.monotonic() < deadline:
            waiting = {r: p for r, p in waiting.items() if not (os.path.exists(p) and os.path.getsize(p))}
            time.sleep(0.02)

    def install(self) -> None:
        """Record the workers at each of elastic's polls (:func:`compat_elastic.record_every_poll`)."""
        compat_elastic.record_every_poll(self.record)


class LoopbackBackend(C10dRendezvousBackend):
    @property
    def name(self) -> str:
        return "c10d-loopback"


def register_loopback_rendezvous() -> None:
    """Register ``c10d-loopback``: elastic's c10d rendezvous whose stores listen on 127.0.0.1 only.

    Both stores are loopback-bound: the rendezvous store, and the store elastic shares with the
    workers (MASTER_ADDR / MASTER_PORT), which it would otherwise open on every interface.
    """
    def creator(params):
        store = loopback_store()
        handler = create_handler(store, LoopbackBackend(store, params.run_id), params)
        compat_elastic.serve_store_with(handler, lambda master_addr, master_port: loopback_store())
        return handler
    rendezvous_handler_registry.register("c10d-loopback", creator)


def loopback_interface() -> str:
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return names[0] if names else ""


def start_method() -> str:
    """``fork`` (the ranks inherit the imported torch) unless this process touched CUDA."""
    return "spawn" if torch.cuda.is_initialized() else "fork"


def run_elastic(run_dir: str, spec: dict) -> dict:
    """Run the ranks under elastic; the outcome as ``status.json`` holds it. A pool's agent (``spec["pool"]``)
    runs warm ranks (:func:`~snn_explorer.ranks.warm.serve`) instead, which run the pool's jobs until it ends."""
    if spec["backend"] == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and loopback_interface():
        os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
    recorder = ExitRecorder(run_dir)
    recorder.install()
    register_loopback_rendezvous()
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=spec["nprocs"], run_id=spec["run_id"],
        rdzv_backend="c10d-loopback", rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1", max_restarts=0,
        start_method=start_method(), monitor_interval=0.25 if spec.get("pool") else 0.05, shutdown_timeout=spec["shutdown_timeout"],
        logs_specs=DefaultLogsSpecs(log_dir=channel.path(run_dir, "logs"), redirects=Std.ALL),
    )
    status = {"ok": False, "failures": {}, "agent_error": None}
    try:
        if spec.get("pool"):
            elastic_launch(config, warm.serve)(run_dir, spec["backend"])
        else:
            elastic_launch(config, rank.run_rank)(run_dir, spec["backend"], spec.get("pg_timeout"))
        status["ok"] = True
    except ChildFailedError as exc:
        status["failures"] = {int(r): {"exitcode": c} for r, c in recorder.codes.items() if c}
        status["failures"].update({int(r): {"exitcode": f.exitcode} for r, f in exc.failures.items()})
    except BaseException as exc:  # SignalException, rendezvous errors, ...
        status["agent_error"] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return status


def main(run_dir: str, spec: dict) -> int:
    """The agent: watch the parent, adopt orphans, run the ranks, write ``status.json``, end the tree."""
    def orphaned():  # the caller died (SIGTERM, SIGHUP, SIGKILL): nobody else will clean up
        shutil.rmtree(run_dir, ignore_errors=True)
        process.kill_tree(os.getpid())
        os.killpg(0, 9)

    rank.exit_with_parent(spec["parent_pid"], orphaned)
    process.become_subreaper()
    for name in spec.get("preload", ()):  # a pool's modules: imported once, here, for every warm rank
        importlib.import_module(name)
    status = {"ok": False}
    try:
        status = run_elastic(run_dir, spec)
        channel.write_json(channel.path(run_dir, "status.json"), status)
    finally:
        process.kill_tree(os.getpid())  # adopted orphans: a rank's grandchildren in their own session
    return 0 if status["ok"] else 1


def _caller_path(spec: dict) -> None:
    """The caller's ``sys.path`` (the payload's modules are found on it), this package's root kept."""
    missing = [process.PACKAGE_ROOT] if process.PACKAGE_ROOT not in spec["sys_path"] else []
    sys.path[:] = spec["sys_path"] + missing


if __name__ == "__main__":
    with open(os.path.join(sys.argv[1], "spec.json")) as fh:
        agent_spec = json.load(fh)
    _caller_path(agent_spec)
    sys.exit(main(sys.argv[1], agent_spec))
