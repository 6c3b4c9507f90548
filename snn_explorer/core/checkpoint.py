"""Distributed checkpoints on ``torch.distributed.checkpoint`` (DCP): save under one plan, load
under any plan of the same model.

A checkpoint is a directory: DCP's files (each rank writes its own shards; tensors are stored by
their full path in the user's model and their global shape, so any other sharding can read them
back) plus ``manifest.json`` (format, torch version, plan, world size, step, ``extra``, every
tensor's path, shape and dtype, and the size of every file). Keys inside DCP:

- ``model.<path>``: parameters and persistent buffers. DTensors (TP, FSDP2, FSDP2+TP) are saved
  shard by shard; the plain channel / head shards of the conv and fused q/k/v TP styles are
  gathered over their tp group and saved whole (DCP writes a replicated tensor once).
- ``optim.<path>.<state>``: the optimizer state of each parameter, laid out like the parameter;
  under ZeRO each rank saves the state of the parameters it owns.
- ``rng.<rank>``: each rank's CPU (and CUDA) RNG state, restored when the world size is unchanged.

Neuron state (membranes, spikingjelly memories) is *not* saved: it is reset at the start of every
batch, so a checkpoint is taken between batches. Saving while a neuron holds state (a sequence
stepped in chunks, not finished) is refused unless ``allow_mid_sequence=True``; that state is then
dropped, and loading resets every neuron.

The write is atomic: DCP writes into a hidden sibling ``.<name>.partial``, rank 0 adds the manifest
last and renames the directory after every rank finished, so a directory named like a checkpoint
always holds a complete one. Every rank must call save and load (they are collectives); without a
process group (mode ``none``) they run in this process alone.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor, distribute_tensor

from ..compat import non_persistent_buffer_names
from . import neurons
from .parallelize.channel_tp import full_shape, full_tensor, local_shard
from .plan_types import SNNDistributedPlan

FORMAT = "snn_explorer.checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DCP_METADATA = ".metadata"


class CheckpointError(ValueError):
    """A directory that is not a complete checkpoint of this model, or one that cannot be written."""


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What :func:`load_checkpoint` restored besides the tensors."""

    step: int
    extra: Any
    plan: SNNDistributedPlan
    world_size: int
    rng_restored: bool


# ---- the model's tensors, by full path ------------------------------------------------------------
def _tensors(module: nn.Module) -> Iterator[Tuple[str, nn.Module, str, torch.Tensor]]:
    """``(path, owner, name, tensor)`` of every parameter and persistent buffer (neuron state,
    which lives in non-persistent buffers or spikingjelly memories, is left out)."""
    for owner_path, owner in module.named_modules():
        skip = non_persistent_buffer_names(owner)
        items = list(owner.named_parameters(recurse=False))
        items += [(n, b) for n, b in owner.named_buffers(recurse=False) if n not in skip and b is not None]
        for name, tensor in items:
            yield (f"{owner_path}.{name}" if owner_path else name), owner, name, tensor


def _kept_whole(owner: nn.Module) -> bool:
    """Whether ``owner``'s tensors are saved whole: a module sharded by a channel / head TP style
    (plain shards, or rows in head-aligned order), which DCP could not reshard as they are."""
    return getattr(owner, "_snn_tp_shards", None) is not None


def _saveable(owner: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """What DCP writes for ``owner.name`` (or a tensor laid out like it): DTensors as they are,
    channel / head shards gathered whole in the model's row order (a collective)."""
    tensor = tensor.detach()
    if not _kept_whole(owner):
        return tensor
    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return full_tensor(owner, name, whole.contiguous())


def _from_whole(owner: nn.Module, name: str, like: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_saveable` for a kept-whole tensor: this rank's part of ``whole``, laid
    out like ``like`` (a DTensor with its placements, else a plain shard). No collective."""
    local = local_shard(owner, name, whole)
    if isinstance(like, DTensor):
        return distribute_tensor(local, like.device_mesh, like.placements, src_data_rank=None)
    return local


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _model_shape(owner: nn.Module, name: str, tensor: torch.Tensor) -> Tuple[int, ...]:
    """The global shape of ``owner.name`` as the checkpoint stores it."""
    return tuple(full_shape(owner, name, tensor))


def model_tensor_shapes(module: nn.Module) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """Full path -> (global shape, dtype) of what a checkpoint of ``module`` holds; no collective."""
    return {path: (_model_shape(owner, name, t), _dtype_name(t.dtype))
            for path, owner, name, t in _tensors(module)}


# ---- the optimizer ---------------------------------------------------------------------------------
def _local_optimizer(optimizer):
    """The optimizer holding this rank's state: ZeRO's partition optimizer, else ``optimizer``."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def _optimizer_class(optimizer) -> str:
    return type(_local_optimizer(optimizer)).__name__


def _param_owners(module: nn.Module) -> Dict[int, Tuple[str, nn.Module, str]]:
    return {id(t): (path, owner, name) for path, owner, name, t in _tensors(module) if isinstance(t, nn.Parameter)}


def _group_settings(optimizer) -> List[Dict[str, Any]]:
    """The hyperparameters of each param group (JSON values), without the parameters."""
    def plain(value):
        return value.item() if isinstance(value, torch.Tensor) else value

    return [{k: plain(v) for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def _like(value: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether optimizer state ``value`` is laid out like its parameter (``exp_avg``; not ``step``)."""
    return value.shape == param.shape and isinstance(value, DTensor) == isinstance(param, DTensor)


def _optimizer_entries(module: nn.Module, optimizer) -> Dict[str, torch.Tensor]:
    owners = _param_owners(module)
    out = {}
    for param, state in _local_optimizer(optimizer).state.items():
        if id(param) not in owners:
            raise CheckpointError("the optimizer holds a parameter that is not in the runtime's model; build it "
                                  "with runtime.build_optimizer() or over runtime.model.parameters()")
        path, owner, name = owners[id(param)]
        for key, value in state.items():
            if value is None:
                continue
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"optimizer state {key!r} of {path} is a {type(value).__name__}, not a tensor; "
                                      "only tensor state can be checkpointed")
            out[f"optim.{path}.{key}"] = _saveable(owner, name, value) if _like(value, param) else value.detach()
    return out


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


# ---- save -------------------------------------------------------------------------------------------
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
            rest = m._memories_rv if hasattr(m, "_memories_rv") else {}
            held = any(isinstance(v, torch.Tensor) and not torch.all(v == rest.get(k, 0))
                       for k, v in m._memories.items())
        else:
            held = False
        if held:
            busy.append(path)
    return busy


def check_plan_checkpointable(plan: SNNDistributedPlan) -> None:
    """CheckpointError for a plan whose runtime cannot be saved or loaded yet (pipeline stages)."""
    if plan.uses_pp:
        raise CheckpointError("checkpoints of pipeline plans (mode 'pp') are not supported yet: each rank holds "
                              "only its stages (the rest of the model is on the meta device); save under a "
                              "dp / tp / fsdp2 / fsdp2_tp plan")


def _check_target(path: Path, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise CheckpointError(f"{path} already exists; pass overwrite=True to replace it (or choose another path)")
    if path.exists() and not (path / MANIFEST).is_file():
        raise CheckpointError(f"{path} exists and is not a checkpoint (no {MANIFEST}); refusing to replace it")
    if path.parent.exists() and not path.parent.is_dir():
        raise CheckpointError(f"the parent {path.parent} of the checkpoint is a file, not a directory")


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
    _check_target(path, overwrite)


def _manifest(runtime, optimizer, step: int, extra: Any, tensors: Dict[str, Tuple]) -> dict:
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "torch_version": torch.__version__,
        "world_size": _world(), "step": step, "extra": extra, "plan": runtime.plan.to_dict(),
        "tensors": {p: {"shape": list(s), "dtype": d} for p, (s, d) in tensors.items()},
        "optimizer": None if optimizer is None else {"class": _optimizer_class(optimizer),
                                                     "param_groups": _group_settings(optimizer)},
    }


def _write_manifest(tmp: Path, manifest: dict) -> None:
    manifest["files"] = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
    target = tmp / MANIFEST
    with open(target, "w") as fh:
        json.dump(manifest, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())


def _publish(tmp: Path, path: Path, manifest: dict) -> None:
    """Rank 0: add the manifest, then move the finished directory into place."""
    _write_manifest(tmp, manifest)
    old = path.parent / f".{path.name}.replaced"
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(runtime, path, optimizer=None, step: int = 0, extra: Any = None, overwrite: bool = False,
                    allow_mid_sequence: bool = False) -> Path:
    """Write ``runtime``'s model (and ``optimizer``'s state, the step, RNG states, ``extra``) to the
    directory ``path``; a collective: call on every rank. Returns the path."""
    path = Path(path)
    _agree(_attempt(_check_save_inputs, runtime, path, step, extra, overwrite, allow_mid_sequence))
    tmp = path.parent / f".{path.name}.partial"
    if _rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _agree(None)  # the parent exists and the stale partial directory is gone before anyone writes
    module = runtime.module
    state = {f"model.{p}": _saveable(o, n, t) for p, o, n, t in _tensors(module)}
    if optimizer is not None:
        state.update(_optimizer_entries(module, optimizer))
    state[f"rng.{_rank()}"] = torch.get_rng_state()
    if torch.cuda.is_available() and runtime.device.type == "cuda":
        state[f"rng_cuda.{_rank()}"] = torch.cuda.get_rng_state(runtime.device)
    dcp.save(state, checkpoint_id=str(tmp), no_dist=not _distributed())
    manifest = _manifest(runtime, optimizer, step, extra, model_tensor_shapes(module))
    _agree(_attempt(_publish, tmp, path, manifest) if _rank() == 0 else None)
    return path


# ---- read and check ---------------------------------------------------------------------------------
def read_manifest(path) -> dict:
    """The manifest of the checkpoint at ``path``, after checking that the directory is a complete
    checkpoint of this format (every file present, none truncated). No process group needed."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: the directory does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a checkpoint directory")
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise CheckpointError(f"{path} is not a complete snn_explorer checkpoint: it has no {MANIFEST} "
                              "(an unfinished write, or another program's directory)")
    try:
        manifest = json.loads(manifest_file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{manifest_file} is not readable JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_file} is not an snn_explorer checkpoint manifest "
                              f"(format={manifest.get('format') if isinstance(manifest, dict) else None!r}, "
                              f"expected {FORMAT!r})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {manifest.get('format_version')!r}; this "
                              f"snn_explorer reads version {FORMAT_VERSION}")
    for name, size in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        if file.stat().st_size != size:
            raise CheckpointError(f"checkpoint {path} is damaged: {name} has {file.stat().st_size} bytes, "
                                  f"the manifest says {size} (truncated or modified)")
    if DCP_METADATA not in manifest.get("files", {}):
        raise CheckpointError(f"checkpoint {path} lists no {DCP_METADATA} file; it was not written by save_checkpoint")
    return manifest


def model_mismatch(manifest: dict, shapes: Dict[str, Tuple[Tuple[int, ...], str]]) -> Optional[str]:
    """Why the checkpoint's tensors are not this model's (None when path, shape and dtype all agree)."""
    saved = {p: (tuple(t["shape"]), t["dtype"]) for p, t in manifest["tensors"].items()}
    missing = sorted(set(shapes) - set(saved))
    unknown = sorted(set(saved) - set(shapes))
    differ = [f"{p}: checkpoint {saved[p][0]} {saved[p][1]}, model {shapes[p][0]} {shapes[p][1]}"
              for p in shapes if p in saved and saved[p] != shapes[p]]
    parts = []
    if missing:
        parts.append(f"tensors of the model not in the checkpoint: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unknown:
        parts.append(f"tensors in the checkpoint not in the model: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    if differ:
        parts.append("shapes or dtypes differ: " + "; ".join(differ[:5]) + (" ..." if len(differ) > 5 else ""))
    return ("the checkpoint is of another model: " + "; ".join(parts)) if parts else None


def reshard_problem(manifest: dict, plan: SNNDistributedPlan) -> Optional[str]:
    """Why ``plan`` cannot hold the checkpoint's tensors (a TP split that does not divide a saved
    dim); None when it can. Plan time: no process group needed."""
    from .styles import STYLES

    tensors = manifest["tensors"]
    for module_path, style_name in plan.tensor_parallel_plan.items():
        for name, dim in STYLES[style_name].split.items():
            saved = tensors.get(f"{module_path}.{name}" if module_path else name)
            if saved and saved["shape"] and saved["shape"][dim] % plan.tp_size:
                return (f"the plan's tp={plan.tp_size} cannot reshard {module_path}.{name} of shape "
                        f"{tuple(saved['shape'])} (dim {dim} is not divisible by {plan.tp_size})")
    return None


def check_checkpoint(path, model: nn.Module, plan: Optional[SNNDistributedPlan] = None) -> dict:
    """Plan-time check that ``path`` is a complete checkpoint of ``model`` (undistributed) that
    ``plan`` can load; returns its manifest, raises CheckpointError naming what differs."""
    manifest = read_manifest(path)
    problem = model_mismatch(manifest, model_tensor_shapes(model))
    problem = problem or (reshard_problem(manifest, plan) if plan is not None else None)
    if problem:
        raise CheckpointError(f"{path}: {problem}")
    return manifest


# ---- a directory of step checkpoints ------------------------------------------------------------------
STEP_PREFIX = "step-"


def step_path(directory, step: int) -> Path:
    """Where a run's checkpoint of ``step`` lives in ``directory``: ``step-000042``."""
    return Path(directory) / f"{STEP_PREFIX}{step:06d}"


def latest_checkpoint(directory) -> Optional[Path]:
    """The complete checkpoint (manifest written) of the highest step in ``directory``; None if none.
    Unfinished writes (hidden ``.partial`` directories) are never taken."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    steps = sorted((p for p in directory.iterdir() if p.name.startswith(STEP_PREFIX)
                    and p.name[len(STEP_PREFIX):].isdigit()
                    and (p / MANIFEST).is_file()), key=lambda p: int(p.name[len(STEP_PREFIX):]))
    return steps[-1] if steps else None


# ---- load -------------------------------------------------------------------------------------------
def _saved_shapes(path: Path) -> Dict[str, TensorStorageMetadata]:
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def _whole_like(owner, name, tensor: torch.Tensor) -> torch.Tensor:
    """An empty plain tensor of the full shape of ``owner.name`` (laid out like ``tensor``)."""
    return torch.empty(full_shape(owner, name, tensor), dtype=tensor.dtype, device=_local(tensor).device)


def _destination(owner, name, tensor: torch.Tensor) -> torch.Tensor:
    """Where DCP reads ``owner.name``: the tensor itself, or a whole tensor for a kept-whole one."""
    return _whole_like(owner, name, tensor) if _kept_whole(owner) else tensor.detach()


def _optimizer_destinations(module, optimizer, saved) -> Dict[str, Tuple[torch.Tensor, Any]]:
    """``key -> (tensor DCP fills, (param, state key, owner, name))`` for the parameters this rank's
    optimizer holds."""
    owners = _param_owners(module)
    out = {}
    for group in _local_optimizer(optimizer).param_groups:
        for param in group["params"]:
            path, owner, name = owners[id(param)]
            prefix = f"optim.{path}."
            for key, meta in saved.items():
                if not key.startswith(prefix) or "." in key[len(prefix):]:
                    continue
                state_key = key[len(prefix):]
                if tuple(meta.size) == _model_shape(owner, name, param):
                    dest = _destination(owner, name, torch.empty_like(param.detach()))
                else:
                    dest = torch.empty(meta.size, dtype=meta.properties.dtype)
                out[key] = (dest, (param, state_key, owner, name))
    return out


def _check_load(runtime, path: Path, optimizer) -> Tuple[dict, Dict[str, TensorStorageMetadata]]:
    check_plan_checkpointable(runtime.plan)
    manifest = read_manifest(path)
    problem = model_mismatch(manifest, model_tensor_shapes(runtime.module))
    if problem:
        raise CheckpointError(f"{path}: {problem}")
    saved_opt = manifest.get("optimizer")
    if optimizer is not None:
        if saved_opt is None:
            raise CheckpointError(f"{path} holds no optimizer state (saved without optimizer=); load without it")
        if saved_opt["class"] != _optimizer_class(optimizer):
            raise CheckpointError(f"{path} holds the state of a {saved_opt['class']} optimizer, not of the "
                                  f"{_optimizer_class(optimizer)} given")
        if len(saved_opt["param_groups"]) != len(optimizer.param_groups):
            raise CheckpointError(f"{path} has {len(saved_opt['param_groups'])} optimizer param group(s), the "
                                  f"optimizer given {len(optimizer.param_groups)}")
    return manifest, _saved_shapes(path)


def load_checkpoint(runtime, path, optimizer=None) -> LoadedCheckpoint:
    """Read the checkpoint at ``path`` into ``runtime``'s model (and ``optimizer``), resharding to
    the runtime's plan; a collective: call on every rank. Neuron state is reset."""
    path = Path(path)
    checked: list = []
    _agree(_attempt(lambda: checked.extend(_check_load(runtime, path, optimizer))))
    manifest, saved = checked
    module = runtime.module
    targets = {f"model.{p}": (o, n, t, _destination(o, n, t)) for p, o, n, t in _tensors(module)}
    state = {k: v[3] for k, v in targets.items()}
    optim = _optimizer_destinations(module, optimizer, saved) if optimizer is not None else {}
    state.update({k: v[0] for k, v in optim.items()})
    rng_keys = [f"rng.{_rank()}"] + ([f"rng_cuda.{_rank()}"] if runtime.device.type == "cuda" else [])
    restore_rng = manifest["world_size"] == _world() and all(k in saved for k in rng_keys)
    if restore_rng:
        state.update({k: torch.empty(saved[k].size, dtype=saved[k].properties.dtype) for k in rng_keys})
    dcp.load(state, checkpoint_id=str(path), no_dist=not _distributed())
    with torch.no_grad():
        for owner, name, tensor, dest in targets.values():
            if _kept_whole(owner):
                part = _from_whole(owner, name, tensor, dest)
                _local(tensor).copy_(_local(part))
    if optimizer is not None:
        _restore_optimizer(optimizer, optim, manifest["optimizer"]["param_groups"])
    if restore_rng:
        torch.set_rng_state(state[rng_keys[0]])
        if len(rng_keys) > 1:
            torch.cuda.set_rng_state(state[rng_keys[1]], runtime.device)
    runtime.reset_state()
    return LoadedCheckpoint(step=manifest["step"], extra=manifest["extra"],
                            plan=SNNDistributedPlan.from_dict(manifest["plan"]), world_size=manifest["world_size"],
                            rng_restored=restore_rng)


def _restore_optimizer(optimizer, loaded: Dict[str, Tuple[torch.Tensor, Any]], groups: List[dict]) -> None:
    local = _local_optimizer(optimizer)
    local.state.clear()
    for tensor, (param, key, owner, name) in loaded.values():
        like = tuple(tensor.shape) == _model_shape(owner, name, param)
        local.state[param][key] = _from_whole(owner, name, param, tensor) if like and _kept_whole(owner) else tensor
    for group, settings in zip(optimizer.param_groups, groups):
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()})
