"""Progress from ranks: ``report()`` on the rank side, a per-rank tracker on the launcher side.

Every event a rank writes (its start, each ``report``, its end) is also a heartbeat; the
launcher's timeout counts from a rank's latest one.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from . import channel

#: Seconds a rank may take to start (the agent's start and rendezvous, the fork) before it counts as hung; the
#: run is then tried again if no rank ran the function. Generous: a rank starts in seconds on a busy 2-core machine.
START_TIMEOUT_S = 120.0


def _number(value: Any) -> Any:
    """Tensors and numpy scalars -> float, so reports stay JSON."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if callable(getattr(value, "detach", None)):
        value = value.detach()  # a loss tensor that requires grad: float() of it would warn on every rank
    try:
        return float(value)
    except (TypeError, ValueError):
        return repr(value)


#: How the message of a rank ended because another rank failed begins.
ENDED_AFTER = "ended after rank "


def ended_after(root: int, message: str) -> str:
    """The message of a rank ended because rank ``root`` failed, around its own ``message``."""
    return f"{ENDED_AFTER}{root} failed ({message})"


def exit_message(code: int, text: str = "") -> str:
    """``exited with code 0 before returning a value`` (+ ``: text`` of ``sys.exit(text)``), or the signal."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code} before returning a value" + (f": {text}" if text else "")


def report(step: Optional[int] = None, loss: Any = None, message: Optional[str] = None,
           total: Optional[int] = None, **metrics: Any) -> None:
    """Report progress from a rank (and count as its heartbeat).

    Inside :func:`launch` the report reaches the live display; elsewhere (plain ``torchrun``,
    a single process) it prints one line to stdout.
    """
    fields = {"step": step, "total": total, "loss": _number(loss), "message": message,
              "metrics": {k: _number(v) for k, v in metrics.items()}}
    rank = int(os.environ.get("RANK", "0"))
    run_dir = os.environ.get(channel.DIR_ENV)
    if run_dir:
        channel.emit(run_dir, rank, "report", **fields)
        return
    parts = [f"[rank {rank}]"]
    if step is not None:
        parts.append(f"step {step}" + (f"/{total}" if total else ""))
    if fields["loss"] is not None:
        parts.append(f"loss={fields['loss']:.6g}" if isinstance(fields["loss"], float) else f"loss={fields['loss']}")
    parts += [f"{k}={v}" for k, v in fields["metrics"].items()]
    if message:
        parts.append(str(message))
    print(" ".join(parts), flush=True)


def heartbeat(step: Optional[int] = None, total: Optional[int] = None, message: Optional[str] = None) -> None:
    """:func:`report` inside a run; nothing outside one (library code that may also run in-process)."""
    if os.environ.get(channel.DIR_ENV):
        report(step=step, total=total, message=message)


@dataclass
class RankState:
    """What the launcher knows about one rank."""

    rank: int
    status: str = "starting"  # starting | running | done | failed
    #: "spawn" (no event yet), "load" (the payload), "init" (joining the process group), "run" (the function)
    phase: str = "spawn"
    #: When the rank said it entered ``phase`` (seconds since the epoch), None before its first event.
    phase_at: Optional[float] = None
    pid: Optional[int] = None
    step: Optional[int] = None
    total: Optional[int] = None
    loss: Optional[float] = None
    message: Optional[str] = None
    last_seen: float = field(default_factory=time.time)
    seconds: Optional[float] = None
    started_at: Optional[float] = None
    failed_at: Optional[float] = None
    exit_code: Optional[int] = None
    exit_how: str = ""  # "SystemExit" when the rank said so, else "" (the agent saw the process end)
    ended_after: Optional[int] = None  # the rank whose failure made the agent end this one
    reaped: bool = False  # a pool's warm rank saw this run's rank process end (and ended what it left)
    reports: List[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "reports"}


class Tracker:
    """Folds rank events into :class:`RankState` per rank."""

    def __init__(self, nprocs: int, started: float):
        self.ranks: Dict[int, RankState] = {r: RankState(r, last_seen=started) for r in range(nprocs)}

    def apply(self, event: Dict[str, Any]) -> None:
        state = self.ranks[event["rank"]]
        state.last_seen = max(state.last_seen, event["time"])
        kind = event["kind"]
        if kind == "start":
            state.status, state.pid, state.started_at = "running", event["pid"], event["time"]
            state.phase, state.phase_at = "load", event["time"]
        elif kind == "phase":
            state.phase, state.phase_at = event["phase"], event["time"]
        elif kind == "report":
            report = {k: event[k] for k in ("step", "total", "loss", "message", "metrics")}
            state.reports.append(report)
            for key in ("step", "total", "loss", "message"):
                if report[key] is not None:
                    setattr(state, key, report[key])
        elif kind == "end":
            state.status, state.seconds = "done", event["seconds"]
        elif kind == "error":
            state.status, state.message = "failed", f"{event['type']}: {event['message']}"
            state.failed_at = event["time"]
        elif kind == "exit":
            self._exit(state, event)

    @staticmethod
    def _exit(state: RankState, event: Dict[str, Any]) -> None:
        """A rank's process ended (said by the rank on ``sys.exit``, or by the agent on any exit):
        a failure unless the rank had stored its value."""
        state.reaped = state.reaped or bool(event.get("reaped"))
        if state.exit_code is None:
            state.exit_code, state.exit_how = event["code"], event.get("how", "")
        if state.status in ("done", "failed"):
            return
        state.status, state.failed_at = "failed", event["time"]
        state.message = exit_message(event["code"], event.get("text", ""))
        if event.get("after") is not None:
            state.ended_after = event["after"]
            state.message = ended_after(event["after"], state.message)

    def unfinished(self) -> List[int]:
        return [r for r, s in self.ranks.items() if s.status != "done"]

    def function_ran(self) -> bool:
        """Whether some rank began to run the function (or finished it)."""
        return any(s.phase == "run" or s.status == "done" for s in self.ranks.values())

    def stuck_joining(self, now: float, limit: float) -> List[int]:
        """Every rank, when all of them are still joining the process group ``limit`` seconds after the last
        one began to (joining waits only for the peers, so once every rank is at it, it takes a second or
        two); else none (a rank that got through leaves the others to the heartbeat timeout)."""
        states = list(self.ranks.values())
        if not all(s.phase == "init" and s.status == "running" for s in states):
            return []
        return [s.rank for s in states] if now - max(s.phase_at for s in states) > limit else []

    def silent(self, now: float, timeout: Optional[float]) -> List[int]:
        """Unfinished ranks with no heartbeat for ``timeout`` seconds (None: no limit); a rank that has not
        started gets :data:`START_TIMEOUT_S` instead, whatever ``timeout`` is."""
        def limit(state: RankState) -> Optional[float]:
            return timeout if state.pid else START_TIMEOUT_S
        return [r for r in self.unfinished()
                if limit(self.ranks[r]) is not None and now - self.ranks[r].last_seen > limit(self.ranks[r])]

    def snapshot(self) -> List[dict]:
        return [s.as_dict() for s in self.ranks.values()]

    def line(self, rank: int) -> str:
        """One short human line for a rank, shared by the text and widget displays."""
        s = self.ranks[rank]
        parts = [s.status]
        if s.step is not None:
            parts.append(f"step {s.step}" + (f"/{s.total}" if s.total else ""))
        if s.loss is not None:
            parts.append(f"loss {s.loss:.4g}" if isinstance(s.loss, float) else f"loss {s.loss}")
        if s.message:
            parts.append(str(s.message))
        return " · ".join(parts)
