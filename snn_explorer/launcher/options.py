"""``LaunchOptions`` and ``ExportOptions``: how a plan runs, as one object each.

``launch_plan`` and ``export_job`` keep what the run trains (model, plan, step function, steps,
dataset, optimizer, seed, step keywords) as arguments; how and where it runs travels in an options
object, which a notebook, the CLI and the Explorer build alike. Each value is checked when the
launch or export starts (a bad one raises there, naming the field and what it accepts).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Type, TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """How :func:`~snn_explorer.launch_plan` runs a plan on this machine's ranks.

    ``comm_backend``: ``"auto"`` (NCCL when every rank has a GPU, else gloo), ``"gloo"`` or ``"nccl"``
    (``snn_explorer.ranks.COMM_BACKENDS``). ``timeout``: seconds for the whole run (None: no limit).
    ``env``: environment variables for the ranks. ``progress``: the progress display (True, False or a
    display object). ``log_dir``: a folder for each rank's output. ``checkpoint_dir`` with
    ``checkpoint_every=n``: a checkpoint every ``n`` steps, and a launch into a folder holding one
    resumes after it. ``max_restarts``: restarts of the whole group after a failure (needs
    ``checkpoint_dir``). ``on_non_finite``: ``"stop"`` or ``"skip"`` on a NaN / Inf loss or gradient.
    """

    comm_backend: str = "auto"
    timeout: Optional[float] = 900.0
    env: Optional[Mapping[str, str]] = None
    progress: Any = True
    log_dir: Optional[str] = None
    checkpoint_dir: Any = None
    checkpoint_every: Optional[int] = None
    max_restarts: int = 0
    on_non_finite: str = "stop"

    def replace(self, **changes: Any) -> "LaunchOptions":
        """A copy with ``changes``; an unknown field raises ``TypeError`` naming it."""
        return _replace(self, changes)


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    """Where and how :func:`~snn_explorer.export_job`'s job runs under torchrun / Slurm.

    ``nnodes`` and ``nproc_per_node`` (default: the plan's world size over ``nnodes``) must multiply
    to the plan's world size. ``job_name`` names files and the rendezvous; ``port`` the rendezvous
    port (29500 by default); ``rdzv_endpoint`` (``host:port``) a fixed rendezvous; ``gpus_per_node``,
    ``time_limit`` and ``partition`` go into ``job.sbatch``. ``max_restarts``: torchrun's restarts.
    ``checkpoint_dir`` / ``checkpoint_every`` / ``on_non_finite``: as in :class:`LaunchOptions`.
    """

    nnodes: int = 1
    nproc_per_node: Optional[int] = None
    job_name: str = "snn-explorer"
    port: Optional[int] = None
    rdzv_endpoint: Optional[str] = None
    gpus_per_node: Optional[int] = None
    time_limit: str = "01:00:00"
    partition: Optional[str] = None
    max_restarts: int = 0
    checkpoint_dir: Any = None
    checkpoint_every: Optional[int] = None
    on_non_finite: str = "stop"

    def replace(self, **changes: Any) -> "ExportOptions":
        """A copy with ``changes``; an unknown field raises ``TypeError`` naming it."""
        return _replace(self, changes)


def _replace(options, changes: Mapping[str, Any]):
    names = [f.name for f in dataclasses.fields(options)]
    unknown = sorted(set(changes) - set(names))
    if unknown:
        raise TypeError(f"{type(options).__name__} has no field(s) {unknown}; fields: {names}")
    return dataclasses.replace(options, **changes)


def options_of(kind: Type[T], options: Any) -> T:
    """``options`` as a ``kind`` (None: every default); anything else raises ``TypeError``."""
    if options is None:
        return kind()
    if not isinstance(options, kind):
        raise TypeError(f"options={options!r} must be a {kind.__name__} (snn_explorer.{kind.__name__}(...)) or None")
    return options


def split_keywords(kind: Type[T], keywords: Mapping[str, Any]) -> dict:
    """``keywords`` with every field of ``kind`` among them moved into ``options`` (a ``kind``), for callers
    holding one flat mapping of choices (a test table, a sweep)."""
    names = {f.name for f in dataclasses.fields(kind)}
    rest = {k: v for k, v in keywords.items() if k not in names}
    moved = {k: v for k, v in keywords.items() if k in names}
    if moved:
        rest["options"] = _replace(options_of(kind, rest.pop("options", None)), moved)
    return rest
