"""The one way snn_explorer runs code on N ranks: torch elastic in an agent process, a payload
trampoline, a progress channel, per-rank failures (used by the launcher, measure() and the tests).

``run(fn, args, nprocs=...)`` -> :class:`LaunchResult` or :class:`LaunchError`; ``report()`` from
inside a rank; :class:`RankPool`: warm ranks that many runs reuse (``run(..., pool=)``).
Sits below the estimator: imports ``snn_explorer.core`` only.
"""
from .engine import COMM_BACKENDS, resolve_backend, run
from .errors import LaunchError, RankFailure
from .pool import RankPool
from .progress import report
from .rank import init_process_group
from .result import LaunchResult

__all__ = ["COMM_BACKENDS", "LaunchError", "LaunchResult", "RankFailure", "RankPool", "init_process_group", "report",
           "resolve_backend", "run"]
