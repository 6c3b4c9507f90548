"""RankPool: warm local ranks that run many functions, each run as a fresh launch would.

One agent process (the same ``elastic_agent`` a launch starts) holds ``nprocs`` warm ranks that
have imported torch and the package once (:mod:`~snn_explorer.ranks.warm`). A run writes its run
directory inside the pool's private folder, posts a job, and follows the ranks exactly as
:func:`~snn_explorer.ranks.engine.run` follows a fresh launch (:func:`~.engine.follow`: heartbeats,
reports, timeouts with the stacks of unfinished ranks, per-rank failures, :class:`LaunchError`).
Each run's ranks are processes forked for that run alone, with a store and process group of
their own, so a result equals a fresh launch's; a rank that raises, exits or is killed takes only
that run's process with it. Should a warm rank or the agent end, the pool starts again before its
next run. The pool ends with its ``with`` block, :meth:`RankPool.close`, its garbage collection or
the interpreter's exit, and if the process that made it dies, its agent ends the tree and removes
the folder; nothing (process, port, folder) is left.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..compat import TRAINING_LAZY_IMPORTS
from ..core.common import positive_int, positive_number
from . import channel, process, warm
from .engine import _rank_env, _running, follow, resolve_backend, run, with_retries
from .errors import LaunchError
from .progress import START_TIMEOUT_S, Tracker
from .result import LaunchResult

#: Seconds the ranks still running get to write their stacks after another rank's process failed.
STACK_WAIT_S = 1.0
#: Seconds a warm rank gets to say that this run's rank process has ended once it was ended.
REAP_WAIT_S = 10.0
#: Seconds :meth:`RankPool.close` waits for the killed processes to be gone.
CLOSE_WAIT_S = 5.0
_UNSET: Any = object()


class _Agent:
    """The pool's processes and folder; closing them needs nothing of the :class:`RankPool` (its finalizer)."""

    def __init__(self, nprocs: int, backend: str, env, preload: Tuple[str, ...], tmp_dir: Optional[str]):
        self.owner = os.getpid()
        self.nprocs = nprocs
        self.dir = tempfile.mkdtemp(prefix="snn-pool-", dir=tmp_dir)  # mode 0700
        self.jobs = 0
        self.warm: Dict[int, int] = {}  # rank -> warm rank's pid
        self.broken = ""
        try:
            for sub in ("events", "logs", "jobs", "runs", "tmp"):
                os.mkdir(channel.path(self.dir, sub), 0o700)
            channel.write_json(channel.path(self.dir, "spec.json"), {
                "nprocs": nprocs, "backend": backend, "pg_timeout": None, "shutdown_timeout": 3, "pool": True,
                "run_id": uuid.uuid4().hex, "sys_path": list(sys.path), "parent_pid": os.getpid(),
                "preload": [*TRAINING_LAZY_IMPORTS, *preload]})
            self.reader = channel.EventReader(self.dir)
            self.process = process.AgentProcess(self.dir, _rank_env(self.dir, backend, env))
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise

    def wait_ready(self, timeout: float) -> None:
        """Until every warm rank said it is ready; :class:`LaunchError` if the agent ends or time runs out."""
        deadline = time.monotonic() + timeout
        while len(self.warm) < self.nprocs:
            for event in self.reader.poll():
                if event["kind"] == "ready":
                    self.warm[event["rank"]] = event["pid"]
            if len(self.warm) == self.nprocs:
                return
            if self.process.poll() is not None or time.monotonic() > deadline:
                why = "its agent ended" if self.process.poll() is not None else f"not ready within {timeout:g} s"
                raise LaunchError(f"the rank pool did not start ({why}); the agent's log:\n{self.log_tail()}", {},
                                  function_ran=False)
            time.sleep(0.02)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            with open(channel.path(self.dir, "agent.log"), errors="replace") as fh:
                return fh.read()[-chars:]
        except OSError:
            return ""

    def alive(self) -> str:
        """"" while the agent and every warm rank run, else what ended."""
        if self.process.poll() is not None:
            return f"the pool's agent ended (exit code {self.process.poll()})"
        gone = [r for r, pid in sorted(self.warm.items()) if not _running(pid)]
        return f"the pool's warm rank(s) {gone} ended" if gone else ""

    def pids(self) -> List[int]:
        """The agent and every process below it."""
        return [] if self.process.poll() is not None else [self.process.pid, *process.descendants(self.process.pid)]

    def close(self) -> None:
        """End the whole tree at once (nothing in it needs saving) and remove the folder."""
        if os.getpid() != self.owner:  # a forked copy of the owner: the pool is not this process's
            return
        tree = self.pids()
        self.process.end(grace=0.0)
        deadline = time.monotonic() + CLOSE_WAIT_S  # a killed process takes a moment to be gone (its ports too)
        while any(_running(pid) for pid in tree) and time.monotonic() < deadline:
            time.sleep(0.01)
        shutil.rmtree(self.dir, ignore_errors=True)


class PoolRun:
    """One run on the warm ranks, as :func:`~.engine.follow` drives it: ``poll`` / ``end`` like an agent's."""

    def __init__(self, agent: _Agent, run_dir: str, tracker: Tracker, job: bytes):
        self.agent, self.run_dir, self.tracker = agent, run_dir, tracker
        self.ending = False
        self.agent.jobs += 1
        self.job_file = channel.path(agent.dir, "jobs", f"{agent.jobs}.json")
        channel.write_atomic(self.job_file, job)

    def poll(self) -> Optional[int]:
        """0 once every rank's process was reaped, 1 if the pool broke; ends the others after a failure."""
        states = self.tracker.ranks.values()
        if all(s.reaped for s in states):
            return 0
        broken = self.agent.alive()
        if broken:
            self.agent.broken = broken
            return 1
        failed = [s for s in states if s.reaped and s.exit_code]
        if failed and not self.ending:
            self.ending = True
            root = min(failed, key=lambda s: (s.failed_at or float("inf"), s.rank)).rank
            self._end_others(root)
        return None

    def _end_others(self, root: int) -> None:
        """As elastic does after a failed rank: the others' stacks (faulthandler), then SIGTERM."""
        others = {s.rank: s.pid for s in self.tracker.ranks.values() if s.pid and not s.reaped}
        channel.write_atomic(channel.path(self.run_dir, "ended_after"), str(root).encode())
        _signal(others.values(), signal.SIGUSR1)
        deadline = time.monotonic() + STACK_WAIT_S
        while time.monotonic() < deadline and not all(_has_stack(self.run_dir, r) for r in others):
            time.sleep(0.02)
        _signal(others.values(), signal.SIGTERM)

    def end(self, grace: float = 3.0) -> None:
        """SIGTERM this run's rank processes still running, SIGKILL them (and theirs) after ``grace``,
        wait for the warm ranks to reap them, and write ``status.json``; a warm rank that does not
        say so marks the pool for a restart."""
        reader, reaped = channel.EventReader(self.run_dir), {}
        running = {s.rank: s.pid for s in self.tracker.ranks.values() if s.pid and not s.reaped}
        if grace > 0 and running:
            _signal(running.values(), signal.SIGTERM)
        deadline, killed = time.monotonic() + grace, False
        while len(reaped) < self.agent.nprocs and time.monotonic() < deadline + REAP_WAIT_S:
            reaped.update((e["rank"], e["code"]) for e in reader.poll() if e["kind"] == "exit" and e.get("reaped"))
            if not killed and time.monotonic() >= deadline:
                killed = True
                for r, pid in running.items():
                    if r not in reaped:
                        process.kill_tree(pid, [pid])
            if self.agent.alive():
                break
            time.sleep(0.01)
        if len(reaped) < self.agent.nprocs:
            self.agent.broken = self.agent.alive() or f"warm rank(s) {sorted(set(range(self.agent.nprocs)) - set(reaped))} " \
                                                      f"did not end their run within {REAP_WAIT_S:g} s"
        os.unlink(self.job_file)
        status = {"ok": not self.agent.broken and not any(reaped.values()),
                  "failures": {r: {"exitcode": c} for r, c in reaped.items() if c}, "agent_error": None}
        if self.agent.broken and not any(s.pid for s in self.tracker.ranks.values()):
            status["agent_error"] = f"{self.agent.broken}; its log:\n{self.agent.log_tail()}"
        channel.write_json(channel.path(self.run_dir, "status.json"), status)


def _signal(pids, sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _has_stack(run_dir: str, rank: int) -> bool:
    path = channel.path(run_dir, "stacks", f"{rank}.txt")
    return os.path.exists(path) and os.path.getsize(path) > 0


def _close(holder: dict) -> None:
    """The finalizer: close the pool's current processes (``holder["agent"]``), if any."""
    agent = holder.pop("agent", None)
    if agent is not None:
        agent.close()


class RankPool:
    """``nprocs`` warm local ranks on ``backend`` (``"gloo"``, ``"nccl"``: one GPU per rank, ``"auto"``).

    ``with RankPool(2) as pool: pool.run(fn, *args, **kwargs)`` returns each rank's value (a list by
    rank); :meth:`launch` takes :func:`~snn_explorer.ranks.run`'s options and returns its
    :class:`LaunchResult`, and ``launch(..., pool=)``, ``launch_plan(..., pool=)``, ``measure(..., pool=)``
    and ``Explorer(..., pool=)`` run on it. Each run is what a fresh launch would be: fresh rank
    processes (forked from the warm ranks), a fresh store and process group, the RNG state of a
    fresh rank. The ranks start when the pool is made (in the background; the first run waits for
    them). A run's ranks get the caller's environment at that call, plus its ``env=``, as a fresh
    launch's do; ``env`` here is set when the warm ranks start, before they import torch (for
    variables read at import). ``timeout``: :meth:`run`'s heartbeat timeout. ``preload``: modules
    the warm ranks import once, so that runs need not (e.g. ``("snn_explorer.estimator",)`` for
    ``measure``; torch's lazily imported training modules, ``compat.TRAINING_LAZY_IMPORTS``, always);
    code imported there is that of the pool's start (:meth:`restart` after editing it).
    ``tmp_dir``: where the pool's private folder goes (the system's temporary directory by default).
    """

    def __init__(self, nprocs: int, backend: str = "gloo", *, env: Optional[Mapping[str, Optional[str]]] = None,
                 timeout: Optional[float] = 900.0, preload: Sequence[str] = (), tmp_dir: Optional[str] = None):
        self.nprocs = positive_int("nprocs", nprocs)
        self.backend = resolve_backend(backend, self.nprocs)
        self.timeout = positive_number("timeout", timeout, what="seconds without a heartbeat", allow_none=True)
        if isinstance(preload, str) or not all(isinstance(m, str) for m in preload):
            raise TypeError(f"preload={preload!r}; expected a sequence of module names")
        self._options = (dict(env or {}), tuple(preload), tmp_dir)
        self._lock = threading.RLock()
        self._holder: Dict[str, _Agent] = {}
        self._closed = False
        self._finalizer = weakref.finalize(self, _close, self._holder)  # at garbage collection or exit
        self._start()

    def _start(self) -> None:
        env, preload, tmp_dir = self._options
        self._holder["agent"] = _Agent(self.nprocs, self.backend, env, preload, tmp_dir)

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"RankPool({self.nprocs} ranks, backend={self.backend}, {state})"

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """End every process of the pool and remove its folder (a second call does nothing)."""
        self._closed = True
        self._finalizer()

    def restart(self) -> None:
        """End the warm ranks and start new ones (after editing code they imported, say)."""
        with self._lock:
            self._check_open()
            _close(self._holder)
            self._start()

    def pids(self) -> List[int]:
        """The pool's processes now: its agent, the warm ranks, a run's rank processes while it runs."""
        agent = self._holder.get("agent")
        return agent.pids() if agent is not None else []

    def check_fits(self, nprocs: int, backend: str) -> None:
        """ValueError unless this open pool has ``nprocs`` ranks on ``backend`` (already resolved)."""
        self._check_open()
        if nprocs != self.nprocs or backend != self.backend:
            raise ValueError(f"pool={self!r} does not fit this run: it needs {nprocs} rank(s) on {backend}; "
                             f"use RankPool({nprocs}, backend={backend!r}), or pool=None for a fresh launch")

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"pool={self!r} is closed; make a new RankPool")

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> list:
        """``fn(*args, **kwargs)`` on every rank (process group initialised); the values by rank.
        Raises :class:`LaunchError` as a launch does."""
        return self.launch(fn, args, kwargs).values

    def launch(self, fn: Callable, args: Sequence[Any] = (), kwargs: Optional[Mapping[str, Any]] = None, *,
               timeout: Optional[float] = _UNSET, time_limit: Optional[float] = None,
               pg_timeout: Optional[float] = None, env: Optional[Mapping[str, Optional[str]]] = None,
               progress=False, log_dir: Optional[str] = None) -> LaunchResult:
        """:func:`~snn_explorer.ranks.run` on this pool's ranks (``timeout`` defaults to the pool's)."""
        return run(fn, args, kwargs, nprocs=self.nprocs, backend=self.backend,
                   timeout=self.timeout if timeout is _UNSET else timeout, time_limit=time_limit,
                   pg_timeout=pg_timeout, env=env, progress=progress, log_dir=log_dir, pool=self)

    def run_payload(self, payload: bytes, limits: Tuple, *, pg_timeout, env, progress, log_dir) -> LaunchResult:
        """A pickled payload (:mod:`~.payload`) on the warm ranks, started again first if they ended,
        tried again (on new warm ranks) when it fails before any rank ran the function."""
        with self._lock:
            self._check_open()

            def once() -> LaunchResult:
                agent = self._ready()
                try:
                    return self._run_once(agent, payload, limits, pg_timeout, env, progress, log_dir)
                except LaunchError:
                    if agent.broken:
                        _close(self._holder)  # the next try (or run) starts new warm ranks
                    raise
            return with_retries(once)

    def _ready(self) -> _Agent:
        agent = self._holder.get("agent")
        if agent is None or agent.broken or agent.alive():
            _close(self._holder)
            self._start()
            agent = self._holder["agent"]
        try:
            agent.wait_ready(START_TIMEOUT_S)
        except LaunchError:
            _close(self._holder)
            raise
        return agent

    def _run_once(self, agent: _Agent, payload: bytes, limits, pg_timeout, env, progress, log_dir) -> LaunchResult:
        started = time.time()
        run_dir = channel.path(agent.dir, "runs", str(agent.jobs + 1))
        os.mkdir(run_dir, 0o700)
        try:
            channel.make_layout(run_dir)
            channel.write_atomic(channel.path(run_dir, "payload.pkl"), payload)
            ranks_env = process.with_package_path(_rank_env(run_dir, self.backend, env))
            job = warm.job_text(run_dir, self.nprocs, pg_timeout, ranks_env)
            start = lambda tracker: PoolRun(agent, run_dir, tracker, job)  # noqa: E731
            return follow(start, run_dir, self.nprocs, self.backend, started, limits, progress, log_dir)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
