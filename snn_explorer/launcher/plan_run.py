"""launch_plan(): every rank receives the model, applies the plan and runs the user's step function."""
from __future__ import annotations

import dataclasses
import os
import sys
import uuid
import warnings
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional

import torch
import torch.distributed as dist

from ..core import SNNDistributedPlan, apply, preflight
from ..core.checkpoints import FolderLock, check_checkpoint, check_plan_checkpointable, latest_checkpoint, step_path
from ..core.common import non_negative_int, positive_int
from ..core.parallelize import device_type_for
from ..ranks import LaunchError, resolve_backend
from ..ranks.progress import _number, report
from .launching import launch
from .non_finite import NonFiniteGuard, check_action
from .options import LaunchOptions, options_of
from .result import TrainResult

DEFAULT_OPTIMIZER = {"lr": 1e-3}


def _batches(runtime, dataset, seed: int) -> Iterator[Any]:
    if dataset is None:
        while True:
            yield None
    loader = runtime.prepare_dataloader(dataset, seed=seed)
    if len(loader) == 0:
        raise ValueError(f"the dataset ({len(dataset)} samples) yields no batch of {runtime.plan.batch_size} "
                         f"(global) for this rank; use a larger dataset or a smaller plan batch_size")
    epoch = 0
    while True:
        runtime.set_epoch(epoch)
        yield from loader
        epoch += 1


def _metrics(out: Any) -> Dict[str, Any]:
    if out is None:
        return {}
    if isinstance(out, Mapping):
        return {str(k): _number(v) for k, v in out.items()}
    return {"loss": _number(out)}


def _resume(runtime, state: dict, checkpoints: Optional[dict]) -> int:
    """The step to start from: after the latest complete checkpoint in ``checkpoint_dir`` (loaded
    into the runtime and optimizer), else 0."""
    if not checkpoints:
        return 0
    latest = latest_checkpoint(checkpoints["dir"], verify=False)  # the load checksums it, split over the ranks
    if latest is None:
        return 0
    return runtime.load_checkpoint(latest, optimizer=state.get("optimizer")).step


def _checkpoint(runtime, state: dict, checkpoints: Optional[dict], done: int, steps: int) -> None:
    if checkpoints and (done % checkpoints["every"] == 0 or done == steps):
        runtime.reset_state()  # between batches: the next step resets the neurons anyway
        runtime.save_checkpoint(step_path(checkpoints["dir"], done), optimizer=state.get("optimizer"), step=done,
                                overwrite=True)


def _rank_lock(checkpoints: Optional[dict]) -> Optional[FolderLock]:
    """An exported job's lock of its checkpoint folder (a launch_plan run holds it in the caller):
    rank 0 takes it, every rank learns whether it could (one collective)."""
    if not checkpoints or checkpoints.get("held"):
        return None
    lock, problem = None, None
    if dist.get_rank() == 0:
        try:
            lock = FolderLock(checkpoints["dir"], run_id=os.environ.get("TORCHELASTIC_RUN_ID")).acquire()
            if lock.took_over:
                print(f"took over the checkpoint folder's lock left by {lock.took_over}, which is gone", file=sys.stderr)
        except ValueError as exc:
            problem = str(exc)
    found = [problem]
    dist.broadcast_object_list(found, src=0)
    if found[0]:
        raise RuntimeError(found[0])
    return lock


def train_plan_rank(model, plan_data: dict, train_fn: Callable, steps: int, dataset=None,
                    device_type: str = "cpu", optimizer: Optional[dict] = DEFAULT_OPTIMIZER, seed: int = 0,
                    train_kwargs: Optional[dict] = None, checkpoints: Optional[dict] = None,
                    on_non_finite: str = "stop") -> List[Dict[str, Any]]:
    """One rank of :func:`launch_plan` (also what an exported job runs): apply, then ``steps`` steps,
    resuming after the latest checkpoint of ``checkpoints["dir"]`` and saving one every
    ``checkpoints["every"]`` steps when ``checkpoints`` is given; a NaN / Inf loss or gradient
    stops the run or skips the step (:mod:`.non_finite`). Returns the metrics of the steps this
    run made (a skipped step's with ``"skipped": True``)."""
    torch.manual_seed(seed)
    runtime = apply(model=model, plan=SNNDistributedPlan.from_dict(plan_data), device_type=device_type)
    torch.manual_seed(seed + runtime.dp_rank)  # data drawn in the step differs per dp rank, equal on TP peers
    lock = _rank_lock(checkpoints)
    state: Dict[str, Any] = {}
    if optimizer is not None:
        state["optimizer"] = runtime.build_optimizer(**optimizer)
    guard = NonFiniteGuard(runtime, state.get("optimizer"), on_non_finite)
    start = _resume(runtime, state, checkpoints)
    batches, history = _batches(runtime, dataset, seed), []
    for _ in range(start):  # the data position of the resumed step
        next(batches)
    for step in range(start, steps):
        guard.step = step + 1
        metrics = _metrics(train_fn(runtime, step, next(batches), state, **(train_kwargs or {})))
        if not guard.after_step(metrics.get("loss")):
            metrics["skipped"] = True
        history.append(metrics)
        report(step=step + 1, total=steps, loss=metrics.get("loss"),
               message=f"step {step + 1} skipped: non-finite values" if metrics.get("skipped") else None)
        _checkpoint(runtime, state, checkpoints, step + 1, steps)
    runtime.reset_state()  # the neurons' state holds the last step's graph, and through it the FSDP2 state
    if lock is not None:
        lock.release()
    return history


def checkpoint_settings(checkpoint_dir, checkpoint_every) -> Optional[dict]:
    """``{"dir", "every"}`` for the ranks (None without checkpoints); both or neither must be given."""
    if checkpoint_dir is None and checkpoint_every is None:
        return None
    if checkpoint_dir is None or checkpoint_every is None:
        raise ValueError("checkpoint_dir and checkpoint_every go together: give both or neither")
    return {"dir": os.fspath(checkpoint_dir), "every": positive_int("checkpoint_every", checkpoint_every)}


def _checkpoint_spec(model, plan, checkpoint_dir, checkpoint_every) -> Optional[dict]:
    """:func:`checkpoint_settings` with an absolute directory, created, and its latest checkpoint
    checked against the model and plan before any rank starts."""
    settings = checkpoint_settings(checkpoint_dir, checkpoint_every)
    if settings is None:
        return None
    check_plan_checkpointable(plan)
    settings["dir"] = os.path.abspath(settings["dir"])
    os.makedirs(settings["dir"], exist_ok=True)
    latest = latest_checkpoint(settings["dir"])
    if latest is not None:
        check_checkpoint(latest, model, plan)
    return settings


def launch_plan(model, plan, train_fn: Callable, *, steps: int = 1, dataset=None,
                optimizer: Optional[dict] = DEFAULT_OPTIMIZER, seed: int = 0, train_kwargs: Optional[dict] = None,
                pool=None, options: Optional[LaunchOptions] = None) -> TrainResult:
    """Run ``plan`` for ``model`` on ``plan.world_size`` ranks, ``steps`` calls of ``train_fn`` each.

    The model travels by value; each rank applies the plan on CPU (gloo) or its own GPU (NCCL), as
    ``options.comm_backend`` implies (a :class:`~snn_explorer.LaunchOptions`; below, its fields), then calls
    ``train_fn(runtime, step, batch, state, **train_kwargs)`` for ``step`` = 0 .. ``steps - 1``:

    * ``runtime``: the :class:`~snn_explorer.core.SNNDistributedRuntime` that ``apply`` returned
      (``runtime.forward_loss``, ``runtime.dp_rank``, ``runtime.plan.per_rank_batch``, ...);
    * ``batch``: with ``dataset=`` (a torch ``Dataset``), this rank's next batch of
      ``plan.per_rank_batch`` samples: the dp ranks get different samples, tensor-parallel peers
      the same ones, and the loader starts a new epoch when it runs out (samples ``[T, ...]`` stack
      to ``[N, T, ...]``, or ``[T, N, ...]`` where the plan's ``data_layout`` states time-major
      inputs). Without a dataset ``batch`` is None and the step brings its own data: cut this
      rank's share of a global batch with ``runtime.rank_share(inputs, labels)`` (on the batch dim
      of the plan's data layout) or draw it at random, for
      which torch's RNG is seeded ``seed + dp_rank`` on each rank, so dp ranks draw different
      samples and TP peers the same ones;
    * ``state``: a dict that lives for the whole run on this rank; ``state["optimizer"]`` is
      ``runtime.build_optimizer(**optimizer)`` unless ``optimizer=None``.

    ``train_fn`` returns the step's loss (a number or scalar tensor), a dict of metrics
    (``"loss"`` among them) or None; each step is reported to the progress display. Returns a
    :class:`TrainResult` (``.losses``: rank -> per-step losses); raises ``LaunchError``.

    ``checkpoint_dir`` with ``checkpoint_every=n``: every ``n`` steps (and after the last) the ranks
    save a checkpoint ``step-000010`` there (see ``runtime.save_checkpoint``), and a launch into a
    directory that already holds one resumes after the latest complete checkpoint (whatever plan
    wrote it). ``.losses`` then holds the steps this launch made.

    ``max_restarts=k`` (needs ``checkpoint_dir``): when a rank fails (an exception, a crash, a
    kill, a timeout), every rank is ended and the group starts again, up to ``k`` times, resuming
    after the latest complete checkpoint, as torch elastic restarts a group; ``.faults`` lists
    what ended each failed attempt. The final failure is raised when restarts run out.

    ``pool``: a :class:`~snn_explorer.ranks.RankPool` of ``plan.world_size`` ranks on this backend runs it
    on its warm ranks (the same result as a fresh launch; one that does not fit is refused here).

    One run writes a ``checkpoint_dir`` at a time (its lock file names the holder; a second launch into
    it is refused at once; a lock left by a process that is gone is taken over, with a warning).

    ``on_non_finite``: a NaN or Inf loss or gradient on any rank (named by step and rank) stops the
    run before that step's update and checkpoint (``"stop"``, the default: the last good
    checkpoint stays the latest), or its update is skipped (``"skip"``) and the run goes on.
    """
    if not isinstance(plan, SNNDistributedPlan):
        raise TypeError(f"plan must be an SNNDistributedPlan, got {type(plan).__name__}")
    o = options_of(LaunchOptions, options)
    timeout, env, progress, log_dir, on_non_finite = o.timeout, o.env, o.progress, o.log_dir, o.on_non_finite
    positive_int("steps", steps)
    preflight(model, plan)
    check_action(on_non_finite)
    checkpoints = _checkpoint_spec(model, plan, o.checkpoint_dir, o.checkpoint_every)
    max_restarts = restart_count(o.max_restarts, checkpoints)
    backend = resolve_backend(o.comm_backend, plan.world_size)
    if pool is not None:
        pool.check_fits(plan.world_size, backend)
    lock = _folder_lock(checkpoints)
    faults: List[str] = []
    try:
        while True:
            try:
                result = launch(train_plan_rank, model, plan.to_dict(), train_fn, steps, dataset,
                                device_type_for(backend), optimizer, seed, train_kwargs,
                                checkpoints and {**checkpoints, "held": True}, on_non_finite,
                                nprocs=plan.world_size, comm_backend=backend, timeout=timeout, env=env,
                                progress=progress, log_dir=log_dir, pool=pool)
                break
            except LaunchError as error:
                cause = error.root_cause
                if len(faults) == max_restarts or (cause is not None and cause.type == "NonFiniteError"):
                    raise  # a restart would meet the same numbers again
                faults.append(str(error).splitlines()[0])
    finally:
        if lock is not None:
            lock.release()
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    return TrainResult(**fields, faults=tuple(faults))


def _folder_lock(checkpoints: Optional[dict]) -> Optional[FolderLock]:
    """The launch's lock of its checkpoint folder (None without checkpoints); a stale one taken over warns."""
    if not checkpoints:
        return None
    lock = FolderLock(checkpoints["dir"], run_id=uuid.uuid4().hex).acquire()
    if lock.took_over:
        warnings.warn(f"took over the lock of checkpoint_dir {checkpoints['dir']!r} left by {lock.took_over}, "
                      "which is gone", RuntimeWarning, stacklevel=3)
    return lock


def restart_count(max_restarts, checkpoints: Optional[dict]) -> int:
    """``max_restarts`` checked: a non-negative int, and above 0 only with checkpoints to resume from."""
    max_restarts = non_negative_int("max_restarts", max_restarts)
    if max_restarts and checkpoints is None:
        raise ValueError(f"max_restarts={max_restarts} needs checkpoint_dir and checkpoint_every: a restarted "
                         "group resumes from the latest checkpoint")
    return max_restarts
