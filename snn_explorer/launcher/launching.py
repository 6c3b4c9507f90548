"""launch(): run a function on N ranks through torch elastic in a separate agent process."""
from __future__ import annotations

import glob
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from typing import Any, Callable, Dict, Mapping, Optional, Union

import cloudpickle

from . import channel
from . import payload as payloads
from .display import choose_display
from .errors import LaunchError, RankFailure, cause_order
from .process import AgentProcess
from .progress import Tracker
from .result import LaunchResult
from ..core.validate import UNSET, positive_int, positive_number, renamed_keyword

BACKENDS = ("auto", "gloo", "nccl")
#: Seconds the agent gets to end the other ranks after a failure before the launcher ends the tree.
FAILURE_GRACE_S = 5.0
#: Fresh launches tried after one whose ranks all failed joining the process group, before any user
#: code ran (a transient gloo connect error on a busy machine, e.g. "connectFullMesh failed").
INIT_RETRIES = 1
#: Seconds the ranks get to exit by themselves once every rank has stored its value; then the
#: tree ends without waiting for elastic's own teardown.
EXIT_GRACE_S = 5.0
POLL_S = 0.05


def resolve_backend(backend: str, nprocs: int) -> str:
    """The communication backend: ``auto`` is NCCL when CUDA has at least ``nprocs`` devices, else gloo."""
    if backend not in BACKENDS:
        raise ValueError(f"comm_backend={backend!r}; expected one of {BACKENDS}")
    if backend != "auto":
        return backend
    import torch

    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs else "gloo"


def _check(nprocs: Any, timeout: Any) -> None:
    positive_int("nprocs", nprocs)
    positive_number("timeout", timeout, what="seconds", allow_none=True)


def _rank_env(run_dir: str, backend: str, env: Optional[Mapping[str, str]]) -> Dict[str, str]:
    out = dict(os.environ)
    out.update({"PYTHONUNBUFFERED": "1", "TMPDIR": channel.path(run_dir, "tmp"), channel.DIR_ENV: run_dir})
    if backend == "gloo":
        out.setdefault("OMP_NUM_THREADS", "1")
    out.update({str(k): str(v) for k, v in (env or {}).items()})
    return out


def _read_logs(run_dir: str, nprocs: int) -> Dict[int, Dict[str, str]]:
    logs: Dict[int, Dict[str, str]] = {}
    for rank in range(nprocs):
        logs[rank] = {}
        for stream in ("stdout", "stderr"):
            found = glob.glob(channel.path(run_dir, "logs", "*", "attempt_0", str(rank), f"{stream}.log"))
            logs[rank][stream] = open(found[0], errors="replace").read() if found else ""
    return logs


def _keep_logs(logs: Dict[int, Dict[str, str]], log_dir: str) -> Dict[int, tuple]:
    os.makedirs(log_dir, exist_ok=True)
    files = {}
    for rank, streams in logs.items():
        paths = tuple(os.path.join(log_dir, f"rank{rank}.{s}.log") for s in ("stdout", "stderr"))
        for p, s in zip(paths, ("stdout", "stderr")):
            with open(p, "w") as fh:
                fh.write(streams[s])
        files[rank] = paths
    return files


def _failure_type(exitcode: Optional[int]) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return "ExitCode"


def _failures(run_dir: str, status: dict, logs: Dict[int, Dict[str, str]], results: set,
              tracker: Tracker) -> Dict[int, RankFailure]:
    """Every failed rank: its reported exception if any, else its exit code or signal."""
    reported = {r: channel.read_json(p) for r, p in channel.rank_files(run_dir, "errors")}
    codes = {int(r): f["exitcode"] for r, f in status.get("failures", {}).items()}
    out = {}
    for rank in sorted(set(reported) | set(codes) | {r for r, s in tracker.ranks.items() if s.exit_code}):
        state, err = tracker.ranks[rank], reported.get(rank)
        code = codes.get(rank, state.exit_code if state.exit_code is not None else 1)
        tail = logs.get(rank, {}).get("stderr", "")[-4000:]
        if err:
            out[rank] = RankFailure(rank, code, err["type"], err["message"], err["traceback"], tail,
                                    time=state.failed_at, phase=err.get("phase", ""))
        elif state.exit_code:
            out[rank] = RankFailure(rank, code, "SystemExit", f"sys.exit({state.exit_code})", "", tail,
                                    time=state.failed_at)
        else:
            ended = code == -signal.SIGTERM and len(codes) > 1
            message = f"exited with code {code}" if code is None or code >= 0 else f"killed by {_failure_type(code)}"
            out[rank] = RankFailure(rank, code, _failure_type(code), message, "", tail, collateral=ended)
    return out


def _headline(failures: Dict[int, RankFailure], nprocs: int) -> str:
    first = cause_order(failures.values())[0]
    return (f"launch failed on rank(s) {sorted(failures)} of {nprocs}; first: rank {first.rank} "
            f"{first.type}: {first.message}")


def _dump_stacks(run_dir: str, tracker: Tracker, ranks) -> Dict[int, str]:
    """Ask hung ranks for their Python stacks (faulthandler on SIGUSR1)."""
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


def _wait(agent: AgentProcess, reader: channel.EventReader, tracker: Tracker, display, timeout: Optional[float]):
    """Follow the ranks until the agent exits, a failure's grace ends, or all values are stored
    and the exit grace ends; returns the timed-out ranks (empty if none)."""
    failed_at = done_at = None
    while True:
        events = list(reader.poll())
        for event in events:
            tracker.apply(event)
        if events:
            display.update(tracker)
        if agent.poll() is not None:
            return []
        now = time.time()
        if failed_at is None and any(s.status == "failed" for s in tracker.ranks.values()):
            failed_at = now
        if failed_at is not None and now - failed_at > FAILURE_GRACE_S:
            return []
        if done_at is None and not tracker.unfinished():
            done_at = now
        if done_at is not None and (now - done_at > EXIT_GRACE_S or not _alive(tracker)):
            return []  # values are stored and the ranks have exited: skip elastic's teardown
        silent = tracker.silent(now, timeout)
        if silent:
            return silent
        time.sleep(POLL_S)


def launch(fn: Callable, *args: Any, nprocs: int, comm_backend: str = "auto", timeout: Optional[float] = 900.0,
           env: Optional[Mapping[str, str]] = None, progress: Union[bool, Callable, None] = True,
           log_dir: Optional[str] = None, backend: Any = UNSET, **kwargs: Any) -> LaunchResult:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` ranks with the process group initialised.

    ``fn`` may be a lambda, closure or notebook function: it is shipped by value (cloudpickle).
    ``comm_backend`` (``backend``: its deprecated name): ``"auto"`` (NCCL when CUDA has ``nprocs``
    devices, else gloo), ``"gloo"`` or ``"nccl"`` (one GPU per rank). ``timeout``: seconds a rank
    may go without a heartbeat (its start, each :func:`report`, its end) before the launch is
    ended (starting may take up to ``max(timeout, 120)`` s); None waits forever.
    ``env``: extra environment variables for the ranks. ``progress``: True (widgets in a
    notebook, a text line on a terminal), False, or ``callable(snapshot)``. ``log_dir``: also keep
    each rank's stdout/stderr there (they are always on the result). Raises :class:`LaunchError`.
    """
    _check(nprocs, timeout)
    backend = resolve_backend(renamed_keyword("comm_backend", comm_backend, "auto", "backend", backend), nprocs)
    payload = payloads.dumps(fn, args, kwargs)
    for attempt in range(1, INIT_RETRIES + 2):
        try:
            return _launch_once(payload, nprocs, backend, timeout, env, progress, log_dir)
        except LaunchError as exc:
            exc.attempts = attempt
            if not exc.before_user_code or attempt > INIT_RETRIES:
                raise


def _launch_once(payload: bytes, nprocs: int, backend: str, timeout, env, progress, log_dir) -> LaunchResult:
    """One agent, one run directory, one outcome."""
    started = time.time()
    run_dir = tempfile.mkdtemp(prefix="snn-launch-")  # mode 0700
    try:
        channel.make_layout(run_dir)
        channel.write_atomic(channel.path(run_dir, "payload.pkl"), payload)
        channel.write_json(channel.path(run_dir, "spec.json"), {
            "nprocs": nprocs, "backend": backend, "run_id": uuid.uuid4().hex, "sys_path": list(sys.path),
            "parent_pid": os.getpid(), "shutdown_timeout": 3})
        tracker = Tracker(nprocs, started)
        display = choose_display(progress, nprocs)
        reader = channel.EventReader(run_dir)
        agent = AgentProcess(run_dir, _rank_env(run_dir, backend, env))
        try:
            hung = _wait(agent, reader, tracker, display, timeout)
            stacks = _dump_stacks(run_dir, tracker, hung) if hung else {}
        finally:
            agent.end(grace=0.0 if not tracker.unfinished() else 3.0)
            for event in reader.poll():
                tracker.apply(event)
            display.close(tracker)
        return _outcome(run_dir, nprocs, backend, started, tracker, hung, stacks, timeout, log_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _outcome(run_dir, nprocs, backend, started, tracker, hung, stacks, timeout, log_dir) -> LaunchResult:
    logs = _read_logs(run_dir, nprocs)
    joined = {r: s["stdout"] + s["stderr"] for r, s in logs.items()}
    if hung:
        failures = {r: RankFailure(r, None, "Timeout", f"no heartbeat for {timeout:g} s", stacks.get(r, ""),
                                   logs[r]["stderr"][-4000:]) for r in hung}
        raise LaunchError(f"launch timed out: rank(s) {sorted(tracker.unfinished())} had not finished "
                          f"(no heartbeat for {timeout:g} s from rank(s) {hung})", failures,
                          unfinished=tracker.unfinished(), logs=joined)
    status_file = channel.path(run_dir, "status.json")
    results = dict(channel.rank_files(run_dir, "results"))
    if len(results) == nprocs and not channel.rank_files(run_dir, "errors"):
        return _result(results, logs, backend, started, tracker, log_dir)  # whatever the agent's exit
    status = channel.read_json(status_file) if os.path.exists(status_file) else {}
    failures = _failures(run_dir, status, logs, set(results), tracker)
    if status.get("agent_error") and not failures:
        raise LaunchError(f"the launcher agent failed:\n{status['agent_error']}", {}, logs=joined)
    for rank in sorted(set(range(nprocs)) - set(results) - set(failures)):
        failures[rank] = RankFailure(rank, tracker.ranks[rank].exit_code, "NoResult",
                                     "ended without returning a value", "", logs[rank]["stderr"][-4000:])
    if failures:
        headline = _headline(failures, nprocs)
        if not status and not any(s.pid for s in tracker.ranks.values()):
            agent_log = open(channel.path(run_dir, "agent.log"), errors="replace").read()[-4000:]
            headline += f"\nno rank started; the launcher agent's log:\n{agent_log}"
        raise LaunchError(headline, failures, unfinished=tracker.unfinished(), logs=joined)
    return _result(results, logs, backend, started, tracker, log_dir)


def _result(results, logs, backend, started, tracker, log_dir) -> LaunchResult:
    values = [cloudpickle.loads(open(results[r], "rb").read()) for r in range(len(results))]
    return LaunchResult(
        values=values, backend=backend, wall_time=time.time() - started,
        stdout={r: s["stdout"] for r, s in logs.items()}, stderr={r: s["stderr"] for r, s in logs.items()},
        log_files=_keep_logs(logs, log_dir) if log_dir else {}, log_dir=log_dir,
        timings={r: s.seconds for r, s in tracker.ranks.items()},
        startup={r: s.started_at - started for r, s in tracker.ranks.items()},
        reports={r: s.reports for r, s in tracker.ranks.items()})
