"""TrainResult: what launch_plan returns (a LaunchResult whose values are per-step metrics)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..ranks.result import LaunchResult

__all__ = ["LaunchResult", "TrainResult"]


@dataclass(frozen=True, eq=False, repr=False)
class TrainResult(LaunchResult):
    """A :func:`launch_plan` result: ``values[rank]`` is that rank's list of per-step metric dicts
    (the steps of the launch that finished). ``faults`` holds one message per launch that failed
    and was restarted (``max_restarts``), oldest first."""

    faults: Tuple[str, ...] = field(default=())

    @property
    def restarts(self) -> int:
        """How many times the ranks were restarted after a failure."""
        return len(self.faults)

    @property
    def losses(self) -> Dict[int, List[Optional[float]]]:
        """rank -> the loss of every step."""
        return {r: [m.get("loss") for m in steps] for r, steps in enumerate(self.values)}

    def metrics(self, rank: int = 0) -> List[dict]:
        return list(self.values[rank])
