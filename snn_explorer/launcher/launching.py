"""launch(): run a function on N ranks from a notebook or terminal (on the rank runner, ``snn_explorer.ranks``)."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

from ..core.common import UNSET, renamed_keyword
from ..ranks import LaunchResult, resolve_backend, run

__all__ = ["launch", "resolve_backend"]


def launch(fn: Callable, *args: Any, nprocs: int, comm_backend: str = "auto", timeout: Optional[float] = 900.0,
           env: Optional[Mapping[str, str]] = None, progress: Union[bool, Callable, None] = True,
           log_dir: Optional[str] = None, backend: Any = UNSET, pool: Any = None, **kwargs: Any) -> LaunchResult:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` ranks with the process group initialised.

    ``fn`` may be a lambda, closure or notebook function: it is shipped by value (cloudpickle).
    ``comm_backend`` (``backend``: its deprecated name): ``"auto"`` (NCCL when CUDA has ``nprocs``
    devices, else gloo), ``"gloo"`` or ``"nccl"`` (one GPU per rank). ``timeout``: seconds a rank
    may go without a heartbeat (its start, each :func:`report`, its end) before the launch is
    ended, None: no heartbeat limit (starting may take up to 120 s and joining the process group 60 s,
    whatever ``timeout``; a start or a join that hangs before any rank ran ``fn`` is tried once more).
    ``env``: extra environment variables for the ranks. ``progress``: True (widgets in a
    notebook, a text line on a terminal), False, or ``callable(snapshot)``. ``log_dir``: also keep
    each rank's stdout/stderr there (they are always on the result; checked writable first).
    A rank that exits without returning (``sys.exit``, ``os._exit``) is a failure of that rank.
    ``pool``: a :class:`~snn_explorer.ranks.RankPool` of ``nprocs`` ranks on this backend runs it on its
    warm ranks (a pool that does not fit is refused). Raises :class:`LaunchError`.
    """
    comm_backend = renamed_keyword("comm_backend", comm_backend, "auto", "backend", backend)
    return run(fn, args, kwargs, nprocs=nprocs, backend=comm_backend, timeout=timeout, env=env, progress=progress,
               log_dir=log_dir, pool=pool)
