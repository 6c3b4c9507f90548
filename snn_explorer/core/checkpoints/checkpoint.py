"""Distributed checkpoints on ``torch.distributed.checkpoint`` (DCP): save under one plan, load
under any plan of the same model (dp, ZeRO, tp, fsdp2, fsdp2_tp, pp, pp x dp, pp_tp, pp_fsdp2, pp_fsdp2_tp).

A checkpoint is a directory: DCP's files (each rank writes its own shards; tensors are stored by
their full path in the user's model and their global shape, so any other sharding can read them
back) plus ``manifest.json`` (format, torch version, plan, world size, step, ``extra``, every
tensor's path, shape and dtype, whether every value is finite, and the size and checksum of every
file: :mod:`.checkpoint_integrity`). Keys inside DCP:

- ``model.<path>``: parameters and persistent buffers. DTensors (TP, FSDP2, FSDP2+TP) are saved
  shard by shard; the plain channel / head shards of the conv and fused q/k/v TP styles are
  gathered over their tp group and saved whole (DCP writes a replicated tensor once). Under a
  pipeline plan each rank saves the units of its own stages, under the same full paths (a stage
  replicated over dp is written once; an FSDP2-sharded one shard by shard), so pp and every other
  plan read each other's checkpoints.
- ``optim.<path>.<state>``: the optimizer state of each parameter, laid out like the parameter;
  under ZeRO each rank saves the state of the parameters it owns, under pp the state of its stages.
- ``rng.<rank>``: each rank's CPU (and CUDA) RNG state, restored when the world size is unchanged.

The step (``step=``, the training step a pipeline schedule or any loop is at) is in the manifest,
and so is an fp16 plan's loss scaler (scale, clean steps, skipped steps: ``loss_scaler``).
Parameters and optimizer state are always the fp32 master copies, whatever the plan's precision
(autocast and FSDP2's ``param_dtype`` cast only what the forward computes with), so a checkpoint
saved under fp32, bf16 or fp16 loads into a plan of any precision; a plan with a loss scaler
resumes the saved one's state, or starts its own where the checkpoint has none.
Neuron state (membranes, spikingjelly memories) is *not* saved: it is reset at the start of every
batch (every micro-batch under pp), so a checkpoint is taken between batches. Saving while a neuron
holds state is refused unless ``allow_mid_sequence=True``; that state is then dropped, and loading
resets every neuron.

Writes are atomic: DCP writes into a hidden sibling ``.<name>.partial``, rank 0 adds the manifest
last and renames the directory after every rank finished, so a directory named like a checkpoint
always holds a complete one; a write that fails on any rank (a full disk, an error) raises
:class:`CheckpointError` on every rank naming the rank and the error, and leaves the previous
checkpoint as it was. Loading reads DCP's metadata with a restricted unpickler
(:func:`snn_explorer.compat_dcp.read_dcp_metadata`) and tensors with ``torch.load(weights_only=True)``:
nothing in a checkpoint runs as code. A load checks every manifest field's type, every file (a
regular file of the folder, no symlink, its size and checksum) and reads into staging tensors
before it changes the live model: a refused load changes nothing. A save refuses NaN / Inf
values (``allow_non_finite=True`` saves them, marked, and :func:`latest_checkpoint` passes such a
checkpoint over). Every rank must call save and load (they are collectives);
without a process group (mode ``none``) they run in this process alone.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from ...compat import non_persistent_buffer_names, spikingjelly_memories, spikingjelly_reset_values
from ...compat_dcp import SafeFileSystemReader, UnsafeCheckpointError, without_unsafe_advice
from ..model import neurons
from ..parallelize.mixed_precision import LossScaler
from ..planning.plan_types import SNNDistributedPlan
from .checkpoint_files import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    check_target,
    latest_checkpoint,
    model_mismatch,
    partial_path,
    publish,
    read_manifest,
    reshard_problem,
    saved_tensor_metadata,
    step_path,
)
from .checkpoint_tensors import (
    destination,
    from_whole,
    group_settings,
    kept_whole,
    local_part,
    model_tensor_shapes,
    model_tensors,
    non_finite,
    optimizer_class,
    optimizer_destinations,
    optimizer_entries,
    restore_optimizer,
    saveable,
)

__all__ = ["CheckpointError", "LoadedCheckpoint", "check_checkpoint", "check_plan_checkpointable",
           "latest_checkpoint", "load_checkpoint", "model_mismatch", "model_tensor_shapes", "neurons_holding_state",
           "read_manifest", "reshard_problem", "save_checkpoint", "step_path"]


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What :func:`load_checkpoint` restored besides the tensors."""

    step: int
    extra: Any
    plan: SNNDistributedPlan
    world_size: int
    rng_restored: bool
    #: whether the runtime's fp16 loss scaler took the checkpoint's state (False: none saved, or no scaler)
    scaler_restored: bool = False


# ---- agreement between ranks ------------------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world() -> int:
    return dist.get_world_size() if _distributed() else 1


def _agree(problem: Optional[str]) -> None:
    """Raise CheckpointError on every rank when any rank found a problem (so no rank is left waiting
    in a collective the others skipped)."""
    problems = [problem]
    if _distributed():
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    found = sorted({p for p in problems if p})
    if found:
        raise CheckpointError(found[0] if len(found) == 1 else "; ".join(found))


def _attempt(fn, *args) -> Optional[str]:
    try:
        fn(*args)
        return None
    except (CheckpointError, OSError, TypeError, ValueError) as exc:
        return str(exc)


def _dcp_failure(action: str, path: Path, exc: BaseException) -> CheckpointError:
    """CheckpointError naming each rank DCP reports failed and its error (DCP gathers them to every rank)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        named = "; ".join(f"rank {r}: {type(e[0]).__name__}: {e[0]}" for r, e in sorted(failures.items()))
    else:
        named = f"rank {_rank()}: {type(exc).__name__}: {exc}"
    return CheckpointError(without_unsafe_advice(f"{action} {path} failed ({named})"))


# ---- checks -----------------------------------------------------------------------------------------
def neurons_holding_state(module: nn.Module) -> List[str]:
    """Paths of the stateful neurons that hold state (not at their reset value). Registered classes
    (``register_stateful``) cannot be inspected and count as at rest."""
    busy = []
    for path, m in neurons.stateful_modules(module):
        library = neurons.snn_library(m)
        if library == "snntorch":
            state = [b for n, b in m.named_buffers(recurse=False) if n in non_persistent_buffer_names(m)]
            held = any(torch.count_nonzero(b) for b in state if isinstance(b, torch.Tensor))
        elif library == "spikingjelly":
            rest = spikingjelly_reset_values(m)
            held = any(isinstance(v, torch.Tensor) and not torch.all(v == rest.get(k, 0))
                       for k, v in spikingjelly_memories(m).items())
        else:
            held = False
        if held:
            busy.append(path)
    return busy


def check_plan_checkpointable(plan: SNNDistributedPlan) -> None:
    """CheckpointError for a plan whose runtime cannot be saved or loaded; every mode can now (kept
    so that callers check at plan time, before any rank starts)."""
    if not isinstance(plan, SNNDistributedPlan):
        raise CheckpointError(f"plan must be an SNNDistributedPlan, got {type(plan).__name__}")


def check_checkpoint(path, model: nn.Module, plan: Optional[SNNDistributedPlan] = None) -> dict:
    """Plan-time check that ``path`` is a complete checkpoint of ``model`` (undistributed) that
    ``plan`` can load; returns its manifest, raises CheckpointError naming what differs."""
    manifest = read_manifest(path)
    problem = model_mismatch(manifest, model_tensor_shapes(model))
    problem = problem or (reshard_problem(manifest, plan) if plan is not None else None)
    if problem:
        raise CheckpointError(f"{path}: {problem}")
    return manifest


def _check_save_inputs(runtime, path: Path, step: int, extra: Any, overwrite: bool, allow_mid_sequence: bool) -> None:
    check_plan_checkpointable(runtime.plan)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step={step!r}; expected a non-negative int")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"extra must be JSON-serialisable (it is stored in {MANIFEST}): {exc}") from None
    busy = [] if allow_mid_sequence else neurons_holding_state(runtime.module)
    if busy:
        raise CheckpointError(
            f"neuron state is not at rest in {busy[:3]}{' ...' if len(busy) > 3 else ''}: a checkpoint does not hold "
            "neuron state (it is reset every batch). Save between batches after runtime.reset_state(), or pass "
            "allow_mid_sequence=True to save anyway (the running sequence's state is then lost)")
    check_target(path, overwrite)


# ---- save -------------------------------------------------------------------------------------------
def _manifest(runtime, optimizer, step: int, extra: Any, finite: bool) -> dict:
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "torch_version": torch.__version__,
        "world_size": _world(), "step": step, "extra": extra, "plan": runtime.plan.to_dict(), "finite": finite,
        "tensors": {p: {"shape": list(s), "dtype": d} for p, (s, d) in model_tensor_shapes(runtime.module).items()},
        "optimizer": None if optimizer is None else {"class": optimizer_class(optimizer),
                                                     "param_groups": group_settings(optimizer)},
        "loss_scaler": None if runtime.scaler is None else runtime.scaler.state_dict(),
    }


def _save_state(runtime, optimizer) -> Dict[str, torch.Tensor]:
    module = runtime.module
    state = {f"model.{p}": saveable(o, n, t) for p, o, n, t in model_tensors(module)}
    if optimizer is not None:
        state.update(optimizer_entries(module, optimizer))
    state[f"rng.{_rank()}"] = torch.get_rng_state()
    if torch.cuda.is_available() and runtime.device.type == "cuda":
        state[f"rng_cuda.{_rank()}"] = torch.cuda.get_rng_state(runtime.device)
    return state


def _finite_or_refused(state: Dict[str, torch.Tensor], path: Path, allow_non_finite: bool) -> bool:
    """Whether every rank's tensors are finite; a CheckpointError on every rank naming the first
    non-finite ones and their rank unless ``allow_non_finite`` (the manifest then says so)."""
    found = non_finite(state)
    problem = f"rank {_rank()}: {', '.join(found[:3])}{' ...' if len(found) > 3 else ''}" if found else None
    problems = [problem]
    if _distributed():
        problems = [None] * _world()
        dist.all_gather_object(problems, problem)
    named = [p for p in problems if p]
    if named and not allow_non_finite:
        raise CheckpointError(f"not saving {path}: non-finite values (NaN / Inf) in {'; '.join(named)}; the "
                              "previous checkpoint stays the latest (allow_non_finite=True saves anyway, and "
                              "latest_checkpoint then passes it over)")
    return not named


def save_checkpoint(runtime, path, optimizer=None, step: int = 0, extra: Any = None, overwrite: bool = False,
                    allow_mid_sequence: bool = False, allow_non_finite: bool = False) -> Path:
    """Write ``runtime``'s model (and ``optimizer``'s state, the step, RNG states, ``extra``) to the
    directory ``path``; a collective: call on every rank. Returns the path. Non-finite values are
    refused before anything is written unless ``allow_non_finite``."""
    path = Path(path)
    _agree(_attempt(_check_save_inputs, runtime, path, step, extra, overwrite, allow_mid_sequence))
    state = _save_state(runtime, optimizer)
    finite = _finite_or_refused(state, path, allow_non_finite)
    tmp = partial_path(path)
    if _rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _agree(None)  # the parent exists and the stale partial directory is gone before anyone writes
    try:
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not _distributed())
    except (dcp.CheckpointException, OSError, RuntimeError) as exc:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _dcp_failure("saving checkpoint", path, exc) from None
    manifest = _manifest(runtime, optimizer, step, extra, finite)
    problem = _attempt(publish, tmp, path, manifest) if _rank() == 0 else None
    if problem and _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _agree(problem and f"publishing checkpoint {path} failed ({problem}); the previous one is unchanged")
    return path


# ---- load -------------------------------------------------------------------------------------------
def _check_load(runtime, path: Path, optimizer) -> Tuple[dict, Dict[str, Any], SNNDistributedPlan]:
    check_plan_checkpointable(runtime.plan)
    manifest = read_manifest(path, share=(_rank(), _world()))  # each rank checksums its share of the files
    try:
        saved_plan = SNNDistributedPlan.from_dict(manifest["plan"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: manifest field 'plan' is not a plan this snn_explorer reads ({exc})") from None
    problem = model_mismatch(manifest, model_tensor_shapes(runtime.module))
    if problem:
        raise CheckpointError(f"{path}: {problem}")
    saved_opt = manifest.get("optimizer")
    if optimizer is not None:
        if saved_opt is None:
            raise CheckpointError(f"{path} holds no optimizer state (saved without optimizer=); load without it")
        if saved_opt["class"] != optimizer_class(optimizer):
            raise CheckpointError(f"{path} holds the state of a {saved_opt['class']} optimizer, not of the "
                                  f"{optimizer_class(optimizer)} given")
        if len(saved_opt["param_groups"]) != len(optimizer.param_groups):
            raise CheckpointError(f"{path} has {len(saved_opt['param_groups'])} optimizer param group(s), the "
                                  f"optimizer given {len(optimizer.param_groups)}")
    if runtime.scaler is not None and manifest.get("loss_scaler") is not None:
        try:  # checked before any tensor is read, into a throw-away scaler
            LossScaler().load_state_dict(manifest["loss_scaler"])
        except ValueError as exc:
            raise CheckpointError(f"{path}: {exc}") from None
    return manifest, saved_tensor_metadata(path, manifest["files"]), saved_plan


def _read(path: Path, state: Dict[str, torch.Tensor]) -> None:
    """DCP's load of ``state`` through the safe reader; CheckpointError naming the ranks that failed."""
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), no_dist=not _distributed())
    except (dcp.CheckpointException, UnsafeCheckpointError, OSError, RuntimeError) as exc:
        raise _dcp_failure("loading checkpoint", path, exc) from None


def load_checkpoint(runtime, path, optimizer=None) -> LoadedCheckpoint:
    """Read the checkpoint at ``path`` into ``runtime``'s model (and ``optimizer``), resharding to
    the runtime's plan; a collective: call on every rank. Neuron state is reset.

    Transactional: the files are checked (fields, sizes, checksums: each rank its share), every
    tensor is read into staging tensors and checked, and only then copied into the live model
    and optimizer; a load refused at any point leaves both as they were (it needs room for one
    more copy of this rank's part of the model and optimizer state while it runs)."""
    path = Path(path)
    checked: list = []
    _agree(_attempt(lambda: checked.extend(_check_load(runtime, path, optimizer))))
    manifest, saved, saved_plan = checked
    module = runtime.module
    targets = {f"model.{p}": (o, n, t, destination(o, n, t)) for p, o, n, t in model_tensors(module)}
    state = {k: v[3] for k, v in targets.items()}
    optim = optimizer_destinations(module, optimizer, saved) if optimizer is not None else {}
    state.update({k: v[0] for k, v in optim.items()})
    rng_keys = [f"rng.{_rank()}"] + ([f"rng_cuda.{_rank()}"] if runtime.device.type == "cuda" else [])
    restore_rng = manifest["world_size"] == _world() and all(k in saved for k in rng_keys)
    if restore_rng:
        state.update({k: torch.empty(saved[k].size, dtype=saved[k].properties.dtype) for k in rng_keys})
    _read(path, state)
    bad = non_finite(state) if manifest["finite"] else []
    _agree(f"{path} is damaged: rank {_rank()} read non-finite values in {', '.join(bad[:3])}, which the manifest "
           "says were saved finite; nothing was loaded" if bad else None)
    _commit(runtime, optimizer, targets, optim, manifest)
    if restore_rng:
        torch.set_rng_state(state[rng_keys[0]])
        if len(rng_keys) > 1:
            torch.cuda.set_rng_state(state[rng_keys[1]], runtime.device)
    runtime.reset_state()
    return LoadedCheckpoint(step=manifest["step"], extra=manifest["extra"], plan=saved_plan,
                            world_size=manifest["world_size"], rng_restored=restore_rng,
                            scaler_restored=runtime.scaler is not None and manifest["loss_scaler"] is not None)


def _commit(runtime, optimizer, targets: dict, optim: dict, manifest: dict) -> None:
    """Copy the staged, checked tensors into the live model, optimizer and loss scaler (no collective)."""
    with torch.no_grad():
        for owner, name, tensor, staged in targets.values():
            source = from_whole(owner, name, tensor, staged) if kept_whole(owner) else staged
            local_part(tensor).copy_(local_part(source))
    if optimizer is not None:
        restore_optimizer(optimizer, optim, manifest["optimizer"]["param_groups"])
    if runtime.scaler is not None and manifest["loss_scaler"] is not None:
        runtime.scaler.load_state_dict(manifest["loss_scaler"])
