"""LaunchResult: every rank's return value, captured logs, timings and reports."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple


@dataclass(frozen=True, eq=False)
class LaunchResult:
    """What a successful launch returns.

    ``values`` lists the ranks' return values in rank order; ``stdout`` / ``stderr`` map rank ->
    captured text; ``log_files`` maps rank -> (stdout path, stderr path) when a ``log_dir`` was
    given; ``timings`` maps rank -> seconds spent in the function; ``startup`` maps rank ->
    seconds from the call to the rank's start; ``reports`` maps rank -> its ``report()`` calls.
    """

    values: List[Any]
    backend: str
    wall_time: float
    stdout: Dict[int, str] = field(default_factory=dict)
    stderr: Dict[int, str] = field(default_factory=dict)
    log_files: Dict[int, Tuple[str, str]] = field(default_factory=dict)
    timings: Dict[int, float] = field(default_factory=dict)
    startup: Dict[int, float] = field(default_factory=dict)
    reports: Dict[int, List[dict]] = field(default_factory=dict)
    log_dir: Optional[str] = None

    @property
    def nprocs(self) -> int:
        return len(self.values)

    def log(self, rank: int) -> str:
        """Rank ``rank``'s stdout followed by its stderr."""
        return self.stdout.get(rank, "") + self.stderr.get(rank, "")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.nprocs} ranks, backend={self.backend}, wall_time={self.wall_time:.1f}s)"
