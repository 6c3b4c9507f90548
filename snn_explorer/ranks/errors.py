"""LaunchError and the per-rank failure record it carries."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence

#: Words of an error that only reports a vanished peer (a consequence of another rank's failure).
PEER_ERROR_MARKERS = ("by peer", "remote worker", "Connection refused", "Broken pipe", "Connection closed")


@dataclass(frozen=True)
class RankFailure:
    """Why one rank failed: exit code (None if it was still running), exception, traceback, log tail."""

    rank: int
    exitcode: Optional[int]
    type: str
    message: str
    traceback: str = ""
    log_tail: str = ""
    #: True when the launcher ended this rank because another one failed first.
    collateral: bool = False
    #: When it failed (seconds since the epoch), if the rank said so; orders root causes first.
    time: Optional[float] = None
    #: "spawn" (not started), "load" (the payload), "init" (joining the process group), "run" (the function),
    #: "" (unknown).
    phase: str = ""
    #: The Python stacks of a rank that was still running when it was ended (faulthandler's dump).
    stack: str = ""

    def describe(self) -> str:
        code = "still running" if self.exitcode is None else f"exit code {self.exitcode}"
        where = waiting_in(self.stack)
        return f"rank {self.rank} ({code}): {self.type}: {self.message}" + (f"; it was in {where}" if where else "")

    @property
    def early_exit(self) -> bool:
        """True when the rank's process ended by itself before returning (``sys.exit``, ``os._exit``)."""
        return self.message.startswith("exited with code")

    def summary(self) -> str:
        """One line: ``rank 1 exited with code 0 before returning a value`` / ``rank 1 ValueError: ...``."""
        return f"rank {self.rank} {self.message}" if self.early_exit else f"rank {self.rank} {self.type}: {self.message}"

    @property
    def peer_error(self) -> bool:
        """True for an error that only says a peer went away (the peer's failure is the cause)."""
        return bool(self.traceback) and any(m in self.message for m in PEER_ERROR_MARKERS)


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def _rank_frames(stack: str) -> list:
    """The frames (innermost first) of the thread that runs the rank's function in a faulthandler dump."""
    threads = [t for t in re.split(r"\n\s*\n", stack) if "in run_rank" in t] or [stack]
    return [m.groupdict() for m in _FRAME.finditer(threads[0])]


def waiting_in(stack: str) -> str:
    """Where a rank's dumped stack shows it: the innermost frame of the thread that runs the
    rank's function, and the innermost frame of the caller's code below it (outside torch), e.g.
    ``all_reduce (distributed_c10d.py:2950) from body (train.py:15)``; "" without a stack."""
    frames = _rank_frames(stack)
    if not frames:
        return ""
    text = lambda f: f"{f['func']} ({os.path.basename(f['file'])}:{f['line']})"  # noqa: E731
    own = next((f for f in frames if f"{os.sep}torch{os.sep}" not in f["file"]), None)
    return text(frames[0]) + (f" from {text(own)}" if own is not None and own is not frames[0] else "")


def in_collective(stack: str) -> bool:
    """True when the dumped stack shows the rank inside ``torch.distributed`` (waiting for peers)."""
    frames = _rank_frames(stack)
    return bool(frames) and f"{os.sep}torch{os.sep}distributed{os.sep}" in frames[0]["file"]


def cause_order(failures) -> list:
    """Root causes first: deaths without a Python error (signal, exit code), then errors by time,
    errors that only report a vanished peer after them; ranks ended by the launcher last."""
    return sorted(failures, key=lambda f: (f.collateral, f.peer_error,
                                           not (f.traceback == "" and f.exitcode is not None),
                                           f.time if f.time is not None else float("inf"), f.rank))


class LaunchError(RuntimeError):
    """A launch failed. ``failures`` maps rank -> :class:`RankFailure` (in rank order; the message
    lists root causes first); ``unfinished`` lists the ranks that had not finished; ``logs`` maps
    rank -> captured stdout+stderr; ``results`` maps rank -> return value of the ranks that did
    return one; ``timed_out`` is True when the launch ended at its timeout; ``function_ran`` is True when
    some rank began to run the function; ``attempts`` counts the launches tried (a launch whose ranks all
    failed or got stuck joining the process group, or never started, before any rank ran the function,
    is retried once)."""

    def __init__(self, headline: str, failures: Dict[int, RankFailure], unfinished: Sequence[int] = (),
                 logs: Optional[Dict[int, str]] = None, attempts: int = 1, results: Optional[Dict[int, Any]] = None,
                 timed_out: bool = False, function_ran: bool = True):
        self.function_ran = function_ran
        self.failures = dict(sorted(failures.items()))
        self.unfinished = tuple(unfinished)
        self.logs = logs or {}
        self.attempts = attempts
        self.results = dict(results or {})
        self.timed_out = timed_out
        super().__init__(self._format(headline))

    def _format(self, headline: str) -> str:
        ordered = cause_order(self.failures.values())
        lines = [headline]
        lines += ["  " + f.describe() + (" [ended by the launcher]" if f.collateral else "") for f in ordered]
        first = next((f for f in ordered if f.traceback), None)
        if first is not None:
            lines += [f"remote traceback of rank {first.rank}:", first.traceback.rstrip()]
        return "\n".join(lines)

    @property
    def root_cause(self) -> Optional[RankFailure]:
        """The failure that most likely started it (see :func:`cause_order`)."""
        ordered = cause_order(self.failures.values())
        return ordered[0] if ordered else None

    @property
    def before_user_code(self) -> bool:
        """True if no rank ran the function and every rank failed or timed out while joining the process group, or
        never started (or was ended because of one that did). The payload was unpickled (its objects' own
        unpickling code ran) by the ranks that joined; a retry unpickles it again."""
        causes = [f for f in self.failures.values() if not f.collateral]
        return not self.function_ran and bool(causes) and all(f.phase in ("spawn", "init") for f in causes)
