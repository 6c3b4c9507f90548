"""What a finished run directory says: the ranks' values, logs and failures -> LaunchResult / LaunchError."""
from __future__ import annotations

import dataclasses
import glob
import os
import signal
import time
import warnings
from typing import Any, Dict, Optional, Tuple

import cloudpickle

from . import channel
from .errors import LaunchError, RankFailure, cause_order, in_collective, waiting_in
from .progress import ENDED_AFTER, Tracker, ended_after
from .result import LaunchResult

#: Characters of a rank's stderr kept on its failure record.
LOG_TAIL = 4000


def read_logs(run_dir: str, nprocs: int) -> Dict[int, Dict[str, str]]:
    logs: Dict[int, Dict[str, str]] = {}
    for rank in range(nprocs):
        logs[rank] = {}
        for stream in ("stdout", "stderr"):
            found = glob.glob(channel.path(run_dir, "logs", "*", "attempt_0", str(rank), f"{stream}.log"))
            logs[rank][stream] = open(found[0], errors="replace").read() if found else ""
    return logs


def keep_logs(logs: Dict[int, Dict[str, str]], log_dir: str) -> Dict[int, tuple]:
    """Copy the logs to ``log_dir``; a failure to write them warns and keeps the run's results."""
    files = {}
    try:
        os.makedirs(log_dir, exist_ok=True)
        for rank, streams in logs.items():
            paths = tuple(os.path.join(log_dir, f"rank{rank}.{s}.log") for s in ("stdout", "stderr"))
            for p, s in zip(paths, ("stdout", "stderr")):
                with open(p, "w") as fh:
                    fh.write(streams[s])
            files[rank] = paths
    except OSError as exc:
        warnings.warn(f"could not keep the rank logs in log_dir={log_dir!r} ({exc}); they are on the result",
                      RuntimeWarning, stacklevel=3)
    return files


def _signal_name(exitcode: Optional[int]) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return "ExitCode"


def load_values(run_dir: str) -> Tuple[Dict[int, Any], Dict[int, RankFailure]]:
    """rank -> stored value, and a failure for each value the caller cannot unpickle."""
    values, failures = {}, {}
    for rank, path in channel.rank_files(run_dir, "results"):
        try:
            with open(path, "rb") as fh:
                values[rank] = cloudpickle.loads(fh.read())
        except Exception as exc:  # noqa: BLE001 - e.g. a class the caller cannot import
            failures[rank] = RankFailure(rank, 0, type(exc).__name__, f"could not unpickle its value here: {exc}")
    return values, failures


def _failure(rank: int, state, err: Optional[dict], code: Optional[int], tail: str, others: bool,
             stack: str) -> RankFailure:
    if err:
        return RankFailure(rank, code, err["type"], err["message"], err["traceback"], tail,
                           time=err.get("time", state.failed_at), phase=err.get("phase", ""))
    if state.message and state.status == "failed":  # an exit the tracker saw (sys.exit, os._exit, a signal)
        kind = "SystemExit" if state.exit_how == "SystemExit" else _signal_name(code)
        collateral = state.ended_after is not None or (code == -signal.SIGTERM and others)
        return RankFailure(rank, code, kind, state.message, "", tail, time=state.failed_at, collateral=collateral,
                           stack=stack if collateral else "", phase=state.phase)
    ended = code == -signal.SIGTERM and others
    message = f"exited with code {code}" if code is None or code >= 0 else f"killed by {_signal_name(code)}"
    return RankFailure(rank, code, _signal_name(code), message, "", tail, collateral=ended,
                       stack=stack if ended else "")


def failures(run_dir: str, status: dict, logs, values: dict, tracker: Tracker) -> Dict[int, RankFailure]:
    """Every rank that did not store a value: its reported exception if any, else its exit (with
    its dumped stacks when it was ended because another rank failed)."""
    reported = {r: channel.read_json(p) for r, p in channel.rank_files(run_dir, "errors")}
    stacks = read_stacks(run_dir)
    codes = {int(r): f["exitcode"] for r, f in status.get("failures", {}).items()}
    failed = set(reported) | set(codes) | {r for r, s in tracker.ranks.items() if s.status == "failed"}
    out = {}
    for rank in sorted(failed - set(values)):
        state = tracker.ranks[rank]
        code = codes.get(rank, state.exit_code if state.exit_code is not None else 1)
        tail = logs.get(rank, {}).get("stderr", "")[-LOG_TAIL:]
        out[rank] = _failure(rank, state, reported.get(rank), code, tail, len(failed) > 1, stacks.get(rank, ""))
    return _name_the_cause(out)


def _name_the_cause(fails: Dict[int, RankFailure]) -> Dict[int, RankFailure]:
    """Each rank ended because another failed says after which rank's failure, also when the agent's note of it
    (its ``exit`` event) did not arrive before the launch ended."""
    root = cause_order(fails.values())[0] if fails else None
    if root is None or root.collateral:
        return fails
    return {r: dataclasses.replace(f, message=ended_after(root.rank, f.message))
            if f.collateral and not f.message.startswith(ENDED_AFTER) else f for r, f in fails.items()}


def read_stacks(run_dir: str) -> Dict[int, str]:
    """rank -> the stacks it dumped (faulthandler, on SIGUSR1), for the ranks that dumped any."""
    out = {}
    for rank, path in channel.rank_files(run_dir, "stacks"):
        with open(path, errors="replace") as fh:
            text = fh.read()
        if text.strip():
            out[rank] = text
    return out


def unfinished_after(fails: Dict[int, RankFailure], tracker: Tracker, logs, run_dir: str, missing) -> None:
    """A failure for each rank in ``missing`` (no value, no failure of its own): ended because of
    the failures in ``fails`` if there are any (with its stacks), else gone without a value."""
    root = cause_order(fails.values())[0].rank if fails else None
    stacks = read_stacks(run_dir)
    for rank in missing:
        tail = logs[rank]["stderr"][-LOG_TAIL:]
        if root is None:
            fails[rank] = RankFailure(rank, tracker.ranks[rank].exit_code, "NoResult",
                                      "ended without returning a value", "", tail)
        else:
            fails[rank] = RankFailure(rank, tracker.ranks[rank].exit_code, "Ended",
                                      f"still running after rank {root} failed; ended by the launcher", "", tail,
                                      collateral=True, stack=stacks.get(rank, ""))


def headline(fails: Dict[int, RankFailure], nprocs: int) -> str:
    first = cause_order(fails.values())[0]
    return f"launch failed on rank(s) {sorted(fails)} of {nprocs}; first: {first.summary()}"


def timed_out(tracker: Tracker, hung, why: str, stacks, logs, joined, values) -> LaunchError:
    """The error of ranks without a heartbeat (``hung``): every unfinished rank with its stack; when
    some are inside a collective and others are not, those others come first (the peers were
    waiting for them)."""
    ended = sorted(set(hung) | {r for r in tracker.unfinished() if r in stacks})
    suspects = [r for r in ended if not in_collective(stacks.get(r, ""))]
    fails = {}
    for r in ended:
        waiting = bool(suspects) and r not in suspects
        fails[r] = RankFailure(r, None, "Timeout", why + ("; waiting for a peer" if waiting else ""),
                               stacks.get(r, ""), logs[r]["stderr"][-LOG_TAIL:], collateral=waiting,
                               phase=tracker.ranks[r].phase, stack=stacks.get(r, ""))
    order = suspects + [r for r in ended if r not in suspects]
    where = "; ".join(f"rank {r} in {waiting_in(stacks.get(r, ''))}" for r in order if waiting_in(stacks.get(r, "")))
    return LaunchError(f"launch timed out: rank(s) {sorted(tracker.unfinished())} had not finished ({why}; "
                       f"rank(s) {sorted(hung)})" + (f"; first: {where}" if where else ""), fails,
                       unfinished=tracker.unfinished(), logs=joined, results=values, timed_out=True,
                       function_ran=tracker.function_ran())


def agent_killed(agent_death: Tuple[int, int], fails: Dict[int, RankFailure], nprocs: int, **kw) -> LaunchError:
    """The error of a run whose agent process was killed by a signal: the agent is the cause, and
    every rank's end (often a KeyboardInterrupt, as the ranks follow their parent) its consequence."""
    pid, signum = agent_death
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    ended = {r: RankFailure(r, f.exitcode, f.type, f.message, f.traceback, f.log_tail, collateral=True,
                            time=f.time, phase=f.phase, stack=f.stack) for r, f in fails.items()}
    return LaunchError(f"launch failed: the launcher's agent process (pid {pid}) was killed by {name} while the "
                       f"ranks ran; it ended rank(s) {sorted(ended) or list(range(nprocs))} with it (what each "
                       "reported below is a consequence, not a cause)", ended, **kw)


def outcome(run_dir, nprocs, backend, started, tracker, hung, why, stacks, log_dir,
            agent_death: Optional[Tuple[int, int]] = None) -> LaunchResult:
    """The LaunchResult of a finished run, or the LaunchError that says why it is not one
    (``agent_death``: the agent's pid and the signal that killed it, if one did before the ranks finished)."""
    logs = read_logs(run_dir, nprocs)
    joined = {r: s["stdout"] + s["stderr"] for r, s in logs.items()}
    values, unreadable = load_values(run_dir)
    if hung:
        raise timed_out(tracker, hung, why, stacks, logs, joined, values)
    status_file = channel.path(run_dir, "status.json")
    status = channel.read_json(status_file) if os.path.exists(status_file) else {}
    fails = {**failures(run_dir, status, logs, values, tracker), **unreadable}
    if len(values) == nprocs and not fails:
        return _result(values, logs, backend, started, tracker, log_dir)  # whatever the agent's exit
    if status.get("agent_error") and not fails:
        raise LaunchError(f"the launcher agent failed:\n{status['agent_error']}", {}, logs=joined, results=values)
    if agent_death is not None:
        raise agent_killed(agent_death, fails, nprocs, unfinished=tracker.unfinished(), logs=joined, results=values,
                           function_ran=tracker.function_ran())
    unfinished_after(fails, tracker, logs, run_dir, sorted(set(range(nprocs)) - set(values) - set(fails)))
    text = headline(fails, nprocs)
    if not status and not any(s.pid for s in tracker.ranks.values()):
        agent_log = open(channel.path(run_dir, "agent.log"), errors="replace").read()[-LOG_TAIL:]
        text += f"\nno rank started; the launcher agent's log:\n{agent_log}"
    raise LaunchError(text, fails, unfinished=tracker.unfinished(), logs=joined, results=values,
                      function_ran=tracker.function_ran())


def _result(values, logs, backend, started, tracker, log_dir) -> LaunchResult:
    return LaunchResult(
        values=[values[r] for r in range(len(values))], backend=backend, wall_time=time.time() - started,
        stdout={r: s["stdout"] for r, s in logs.items()}, stderr={r: s["stderr"] for r, s in logs.items()},
        log_files=keep_logs(logs, log_dir) if log_dir else {}, log_dir=log_dir,
        timings={r: s.seconds for r, s in tracker.ranks.items()},
        startup={r: s.started_at - started for r, s in tracker.ranks.items()},
        reports={r: s.reports for r, s in tracker.ranks.items()})
