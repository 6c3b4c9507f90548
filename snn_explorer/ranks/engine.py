"""run(): a function on N ranks through torch elastic in a separate agent process (the one rank runner).

``launch``, ``measure`` and the test harness all come here. The caller writes a private run
directory (``channel``), starts the agent (``process``), follows the ranks' heartbeats and
reports (``progress``) until every rank stored its value, one failed, or one went silent, ends
the whole process tree, and turns the directory into a LaunchResult or LaunchError (``outcome``).
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch

from ..core.common import positive_int, positive_number
from . import channel
from . import payload as payloads
from .display import choose_display
from .errors import LaunchError
from .outcome import outcome
from .process import AgentProcess
from .progress import START_TIMEOUT_S, Tracker
from .result import LaunchResult

COMM_BACKENDS = ("auto", "gloo", "nccl")
#: Seconds the agent gets to end the other ranks after a failure before the caller ends the tree.
FAILURE_GRACE_S = 5.0
#: Fresh launches tried after one whose ranks all failed joining the process group, before any user
#: code ran (a transient gloo connect error on a busy machine, e.g. "connectFullMesh failed").
INIT_RETRIES = 1
#: Seconds the ranks get to exit by themselves once every rank has stored its value; then the
#: tree ends without waiting for elastic's own teardown.
EXIT_GRACE_S = 5.0
#: Seconds a rank may go on joining the process group once every rank has begun to join (it takes a
#: second or two then); past them the run ends as failed before user code, and is tried again.
JOIN_TIMEOUT_S = 60.0
POLL_S = 0.05
#: CPU (gloo) ranks allowed per usable core: ranks may share cores (tests run 4 ranks on 2 cores),
#: but past this each rank gets under 1/8 of a core and a launch of many more only exhausts memory
#: and processes (a launch of 10**9 ranks ran out of memory after 52 s). Overridden by MAX_RANKS_ENV.
RANKS_PER_CORE = 8
MAX_RANKS_ENV = "SNN_EXPLORER_MAX_LOCAL_RANKS"


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_local_ranks(nprocs: int, backend: str) -> None:
    """Refuse more ranks on this machine than it can hold, at once and naming the cap: one CUDA
    device per NCCL rank, :data:`RANKS_PER_CORE` gloo ranks per usable core (or ``$SNN_EXPLORER_MAX_LOCAL_RANKS``)."""
    if backend == "nccl":
        return  # resolve_backend refused more NCCL ranks than devices
    override = os.environ.get(MAX_RANKS_ENV)
    if override is not None:
        cap = positive_int(MAX_RANKS_ENV, int(override) if override.strip().isdigit() else override)
        why = f"${MAX_RANKS_ENV}={cap}"
    else:
        cores = _usable_cores()
        cap, why = RANKS_PER_CORE * cores, f"{RANKS_PER_CORE} gloo ranks per core x {cores} usable core(s)"
    if nprocs > cap:
        raise ValueError(f"nprocs={nprocs} is more ranks than this machine runs at once: the cap is {cap} ({why}). "
                         f"Use fewer ranks (estimates of larger worlds need no ranks: snn_explorer.estimate), or set "
                         f"{MAX_RANKS_ENV} to raise the cap")


def resolve_backend(backend: str, nprocs: int) -> str:
    """``auto``: NCCL when CUDA has at least ``nprocs`` devices, else gloo; ``nccl`` needs them."""
    if backend not in COMM_BACKENDS:
        raise ValueError(f"comm_backend={backend!r}; expected one of {COMM_BACKENDS}")
    if backend == "gloo":
        return backend
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "nccl" and gpus < nprocs:
        raise ValueError(f"comm_backend='nccl' needs one CUDA device per rank: {nprocs} rank(s), {gpus} visible; "
                         f"use comm_backend='gloo' (CPU) or fewer ranks")
    return "nccl" if gpus >= nprocs else "gloo"


def check_log_dir(log_dir) -> Optional[str]:
    """``log_dir`` as an absolute path, created and proven writable before any rank starts."""
    if log_dir is None:
        return None
    path = os.path.abspath(os.fspath(log_dir))
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".snn-explorer-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"log_dir={os.fspath(log_dir)!r} is not a directory this process can write "
                         f"({exc.strerror or exc}); pass a writable directory or None") from None
    return path


def _rank_env(run_dir: str, backend: str, env: Optional[Mapping[str, Optional[str]]]) -> Dict[str, str]:
    """The caller's environment, the run's variables, then ``env`` (a None value removes a key)."""
    out = dict(os.environ)
    out.update({"PYTHONUNBUFFERED": "1", "TMPDIR": channel.path(run_dir, "tmp"), channel.DIR_ENV: run_dir})
    if backend == "gloo":
        out.setdefault("OMP_NUM_THREADS", "1")
    for key, value in (env or {}).items():
        if value is None:
            out.pop(str(key), None)
        else:
            out[str(key)] = str(value)
    return out


def run(fn: Callable, args: Sequence[Any] = (), kwargs: Optional[Mapping[str, Any]] = None, *, nprocs: int,
        backend: str = "auto", timeout: Optional[float] = 900.0, time_limit: Optional[float] = None,
        pg_timeout: Optional[float] = None, env: Optional[Mapping[str, Optional[str]]] = None,
        progress: Union[bool, Callable, None] = False, log_dir: Optional[str] = None, pool=None) -> LaunchResult:
    """``fn(*args, **kwargs)`` on ``nprocs`` ranks with the process group initialised.

    ``timeout``: seconds a rank may go without a heartbeat (its start, each ``report``, its end),
    None: no limit; a rank gets :data:`~.progress.START_TIMEOUT_S` (120 s, the agent's start
    included) to start and :data:`JOIN_TIMEOUT_S` to join the process group once every rank is
    joining, whatever the ``timeout``, and a run that fails there before any rank ran the function
    is tried again once. ``time_limit``: seconds for the
    whole run, start-up included, None: no limit. ``pg_timeout``: the process group's own timeout
    (torch's default if None). ``env``: extra variables for the ranks (None removes one).
    ``progress``: see :func:`~snn_explorer.ranks.display.choose_display`. ``pool``: a
    :class:`~snn_explorer.ranks.pool.RankPool` of ``nprocs`` ranks on this backend whose warm ranks run it
    (one that does not fit is refused before anything runs). Raises :class:`LaunchError`.
    """
    nprocs = positive_int("nprocs", nprocs)
    timeout = positive_number("timeout", timeout, what="seconds without a heartbeat", allow_none=True)
    time_limit = positive_number("time_limit", time_limit, what="seconds for the whole run", allow_none=True)
    pg_timeout = positive_number("pg_timeout", pg_timeout, what="seconds", allow_none=True)
    backend = resolve_backend(backend, nprocs)
    check_local_ranks(nprocs, backend)
    if pool is not None:
        pool.check_fits(nprocs, backend)
    log_dir = check_log_dir(log_dir)
    payload = payloads.dumps(fn, tuple(args), dict(kwargs or {}))
    if pool is not None:
        return pool.run_payload(payload, (timeout, time_limit), pg_timeout=pg_timeout, env=env, progress=progress,
                                log_dir=log_dir)
    spec = {"nprocs": nprocs, "backend": backend, "pg_timeout": pg_timeout, "shutdown_timeout": 3}
    return with_retries(lambda: _run_once(payload, spec, (timeout, time_limit), env, progress, log_dir))


def with_retries(once: Callable[[], LaunchResult]) -> LaunchResult:
    """``once()``, tried again (:data:`INIT_RETRIES` times) while it fails before any rank ran the function."""
    for attempt in range(1, INIT_RETRIES + 2):
        try:
            return once()
        except LaunchError as exc:
            exc.attempts = attempt
            if not exc.before_user_code or attempt > INIT_RETRIES:
                raise


def prepare_run_dir(run_dir: str, payload: bytes, spec: dict) -> None:
    """The run directory's layout, the payload and the spec the agent or the warm ranks read."""
    channel.make_layout(run_dir)
    channel.write_atomic(channel.path(run_dir, "payload.pkl"), payload)
    channel.write_json(channel.path(run_dir, "spec.json"), {
        **spec, "run_id": uuid.uuid4().hex, "sys_path": list(sys.path), "parent_pid": os.getpid()})


def _run_once(payload: bytes, spec: dict, limits: Tuple, env, progress, log_dir) -> LaunchResult:
    """One agent, one run directory, one outcome."""
    started = time.time()
    run_dir = tempfile.mkdtemp(prefix="snn-launch-")  # mode 0700
    try:
        prepare_run_dir(run_dir, payload, spec)
        start = lambda tracker: AgentProcess(run_dir, _rank_env(run_dir, spec["backend"], env))  # noqa: E731
        return follow(start, run_dir, spec["nprocs"], spec["backend"], started, limits, progress, log_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def follow(start: Callable, run_dir: str, nprocs: int, backend: str, started: float, limits: Tuple, progress,
           log_dir) -> LaunchResult:
    """Start the ranks (``start(tracker)`` returns what runs them: ``poll()`` None while it runs, ``end(grace)``),
    follow their events until the run is over, end what is left, and return the outcome."""
    tracker = Tracker(nprocs, started)
    display = choose_display(progress, nprocs)
    reader = channel.EventReader(run_dir)
    runner = start(tracker)
    try:
        hung, why, stuck = _wait(runner, reader, tracker, display, started, *limits)
        agent_death = _killed_by_signal(runner, tracker)
        # a silent rank ends the run: every unfinished rank shows where it was (the silent one's peers wait for it)
        stacks = _dump_stacks(run_dir, tracker, tracker.unfinished() if hung else stuck) if hung or stuck else {}
    finally:
        runner.end(grace=0.0 if not tracker.unfinished() else 3.0)
        for event in reader.poll():
            tracker.apply(event)
        display.close(tracker)
    return outcome(run_dir, nprocs, backend, started, tracker, hung, why, stacks, log_dir, agent_death)


def _killed_by_signal(runner, tracker: Tracker) -> Optional[Tuple[int, int]]:
    """(pid, signal) of a runner that a signal ended while ranks were unfinished, else None."""
    code = runner.poll()
    if code is not None and code < 0 and tracker.unfinished():
        return getattr(runner, "pid", None), -code
    return None


def _dump_stacks(run_dir: str, tracker: Tracker, ranks) -> Dict[int, str]:
    """Ask hung ranks (or ranks still running after another failed) for their Python stacks
    (faulthandler on SIGUSR1)."""
    for r in ranks:
        if tracker.ranks[r].pid:
            try:
                os.kill(tracker.ranks[r].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    time.sleep(0.5)
    stacks = dict((r, open(p).read()) for r, p in channel.rank_files(run_dir, "stacks"))
    return {r: stacks.get(r, "") for r in ranks}


def _running(pid: int) -> bool:
    """True while ``pid`` runs (a zombie has exited); without /proc, assume it runs."""
    if not os.path.isdir("/proc/self"):
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return True


def _alive(tracker: Tracker) -> bool:
    return any(s.pid and _running(s.pid) for s in tracker.ranks.values())


def _wait(agent, reader: channel.EventReader, tracker: Tracker, display, started: float,
          timeout: Optional[float], time_limit: Optional[float]):
    """Follow the ranks until the agent (or a pool's run) is over, a failure's grace ends, or all values are stored
    and the exit grace ends; returns the timed-out ranks (empty if none), why, and the ranks still
    running when the grace after a failure ended (the agent did not end them: the launcher will)."""
    failed_at = done_at = None
    while True:
        events = list(reader.poll())
        for event in events:
            tracker.apply(event)
        if events:
            display.update(tracker)
        if agent.poll() is not None:
            return [], "", []
        now = time.time()
        if failed_at is None and any(s.status == "failed" for s in tracker.ranks.values()):
            failed_at = now
        if failed_at is not None and now - failed_at > FAILURE_GRACE_S:
            return [], "", [r for r in tracker.unfinished()
                            if tracker.ranks[r].status != "failed" and tracker.ranks[r].pid
                            and _running(tracker.ranks[r].pid)]
        if done_at is None and not tracker.unfinished():
            done_at = now
        if done_at is not None and (now - done_at > EXIT_GRACE_S or not _alive(tracker)):
            return [], "", []  # values are stored and the ranks have exited: skip elastic's teardown
        if time_limit is not None and now - started > time_limit and tracker.unfinished():
            return tracker.unfinished(), f"not finished within the time limit of {time_limit:g} s", []
        silent = tracker.silent(now, timeout)
        if silent:
            any_started = any(tracker.ranks[r].pid for r in silent)
            why = f"no heartbeat for {timeout:g} s" if any_started else f"not started within {START_TIMEOUT_S:g} s"
            return silent, why, []
        joining = tracker.stuck_joining(now, JOIN_TIMEOUT_S)
        if joining:
            return joining, f"still joining the process group {JOIN_TIMEOUT_S:g} s after every rank began to", []
        time.sleep(POLL_S)
