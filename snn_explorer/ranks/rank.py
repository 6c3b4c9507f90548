"""The rank side: the one entry every rank runs, under the agent or under ``torchrun``.

``run_rank`` is what the agent's elastic workers execute: heartbeat, load the payload, join the
process group, run the function, store its value. ``init_process_group`` is shared with the
exported job's ``run.py`` under torchrun.
"""
from __future__ import annotations

import faulthandler
import linecache
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Optional, Tuple

import cloudpickle
import torch
import torch.distributed as dist

from ..core.model import restore_stateful
from . import channel
from .teardown import end_process_groups


def exit_with_parent(parent: int, on_orphan) -> None:
    """A daemon thread that calls ``on_orphan`` once the process ``parent`` is gone."""
    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        on_orphan()
    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


#: torch's switch for a store-based barrier after ``init_process_group`` and every ``new_group``.
#: gloo needs it: a rank that leaves a group (destroys it, or exits) right after creating it, while a
#: peer is still completing its side of the connection, makes that peer fail with "connectFullMesh
#: failed ... Connection closed by peer". Measured on a 2-core host under load (a 2-rank group made,
#: a ``new_group`` made, then destroyed at once): 7 of 250 runs failed without the barrier, 0 of 1000 with it.
INIT_BARRIER_ENV = "TORCH_DIST_INIT_BARRIER"


def init_process_group(backend: str, timeout_s: Optional[float] = None):
    """Join the process group torchrun / the agent describe in the environment (NCCL: the
    ``LOCAL_RANK``-th GPU); returns ``torch.distributed``. gloo groups (this one and the rank's later
    ``new_group`` ones) are joined by every rank before any goes on (:data:`INIT_BARRIER_ENV`, unless
    the environment already sets it)."""
    kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local), **kwargs)
    else:
        os.environ.setdefault(INIT_BARRIER_ENV, "1")
        dist.init_process_group("gloo", **kwargs)
    return dist


def _write_error(run_dir: str, rank: int, exc: BaseException, phase: str) -> None:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    channel.write_json(channel.path(run_dir, "errors", f"{rank}.json"),
                       {"type": type(exc).__name__, "message": str(exc), "traceback": tb, "phase": phase,
                        "time": time.time()})
    channel.emit(run_dir, rank, "error", type=type(exc).__name__, message=str(exc))
    sys.stderr.write(tb)


def _load_payload(path: str):
    """``(fn, args, kwargs)``; in-memory sources (notebook cells) go to linecache for tracebacks and
    the parent's ``register_stateful`` registrations are made here too."""
    with open(path, "rb") as fh:
        data, sources = cloudpickle.loads(fh.read())
    for name, lines in sources.items():
        linecache.cache[name] = (sum(map(len, lines)), None, lines, name)
    fn, args, kwargs, stateful = cloudpickle.loads(data)
    restore_stateful(stateful)
    return fn, args, kwargs


def exit_status(code) -> Tuple[int, str]:
    """``SystemExit.code`` -> (exit code, message): None -> 0, an int -> itself, anything else -> 1 and its text."""
    if code is None:
        return 0, ""
    if isinstance(code, int):
        return code, ""
    return 1, str(code)


def _leave(code: int) -> None:
    """Exit now: interpreter teardown can block on a live process group."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _default_signals() -> None:
    """A forked rank inherits the agent's elastic handlers (SIGTERM raising an exception, which a
    rank blocked in a collective would only see after it): give it Python's defaults back."""
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _enter(run_dir: str, phase: list, name: str) -> None:
    """``phase[0] = name``, said to the launcher too (a ``phase`` event: it tells a rank stuck joining
    the process group from one still loading the payload, and whether any rank ran the function)."""
    phase[0] = name
    channel.emit(run_dir, int(os.environ["RANK"]), "phase", phase=name)


def _run_payload(run_dir: str, backend: str, pg_timeout: Optional[float], phase: list) -> Tuple[bytes, float]:
    """Load the payload, join the process group, run it: its pickled value and when it started to
    run. ``phase[0]`` says how far it got. The function, its arguments (the model) and its value
    are freed when this returns."""
    fn, args, kwargs = _load_payload(channel.path(run_dir, "payload.pkl"))
    _enter(run_dir, phase, "init")
    init_process_group(backend, pg_timeout)
    _enter(run_dir, phase, "run")
    started = time.time()
    return cloudpickle.dumps(fn(*args, **kwargs)), started


def run_rank(run_dir: str, backend: str, pg_timeout: Optional[float] = None) -> None:
    """One rank: heartbeat, load the payload, init the process group, run, store the value, end
    the process groups (see :func:`~snn_explorer.ranks.teardown.end_process_groups`), exit."""
    _default_signals()
    rank = int(os.environ["RANK"])
    os.environ[channel.DIR_ENV] = run_dir
    exit_with_parent(os.getppid(), lambda: os._exit(70))
    stacks = open(channel.path(run_dir, "stacks", f"{rank}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    channel.emit(run_dir, rank, "start", pid=os.getpid())
    phase = ["load"]  # then "init" (joining the process group), then "run" (the function)
    try:
        data, started = _run_payload(run_dir, backend, pg_timeout, phase)
    except SystemExit as exc:
        code, text = exit_status(exc.code)
        if text:
            print(text, file=sys.stderr)
        channel.emit(run_dir, rank, "exit", code=code, how="SystemExit", text=text)
        _leave(code)
    except BaseException as exc:  # the peers may be blocked in a collective: leave at once
        _write_error(run_dir, rank, exc, phase[0])
        _leave(1)
    channel.write_atomic(channel.path(run_dir, "results", f"{rank}.pkl"), data)
    channel.emit(run_dir, rank, "end", seconds=time.time() - started)
    end_process_groups()  # no barrier: a peer that failed would hold this rank until the group's timeout
    _leave(0)  # the value is stored; a torch interpreter teardown only delays the launcher
