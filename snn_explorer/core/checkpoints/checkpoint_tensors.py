"""The tensors a checkpoint holds, by their full path in the user's model: parameters, persistent
buffers and optimizer state, as DCP writes them (DTensors shard by shard, channel / head TP shards
gathered whole) and read back into this rank's layout. No file access here."""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Tuple

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, distribute_tensor

from ...compat import non_persistent_buffer_names
from ..parallelize.pipeline import PipelinedModel
from ..tp.channel_styles import full_shape, full_tensor, local_shard
from .checkpoint_files import CheckpointError


# ---- the model's tensors, by full path ------------------------------------------------------------
def _module_tensors(module: nn.Module, prefix: str = "") -> Iterator[Tuple[str, nn.Module, str, torch.Tensor]]:
    for owner_path, owner in module.named_modules(prefix=prefix):
        skip = non_persistent_buffer_names(owner)
        items = list(owner.named_parameters(recurse=False))
        items += [(n, b) for n, b in owner.named_buffers(recurse=False) if n not in skip and b is not None]
        for name, tensor in items:
            yield (f"{owner_path}.{name}" if owner_path else name), owner, name, tensor


def model_tensors(module: nn.Module) -> Iterator[Tuple[str, nn.Module, str, torch.Tensor]]:
    """``(path, owner, name, tensor)`` of every parameter and persistent buffer this rank holds, by
    its path in the user's model (neuron state, which lives in non-persistent buffers or
    spikingjelly memories, is left out). A pipeline rank holds its stages' units only."""
    if isinstance(module, PipelinedModel):
        for stage in module.stages:
            for path, unit in zip(stage.paths, stage.units):
                yield from _module_tensors(unit, path)
        return
    yield from _module_tensors(module)


def _whole_model_tensors(module: nn.Module) -> Iterator[Tuple[str, nn.Module, str, torch.Tensor]]:
    """Like :func:`model_tensors` over the whole model: a pipeline rank also walks the other
    stages, whose shapes it keeps on the meta device."""
    if isinstance(module, PipelinedModel):
        for paths, meta_stage in zip(module.stage_paths, module._meta_stages):
            for path, unit in zip(paths, meta_stage):
                yield from _module_tensors(unit, path)
        return
    yield from _module_tensors(module)


def kept_whole(owner: nn.Module) -> bool:
    """Whether ``owner``'s tensors are saved whole: a module sharded by a channel / head TP style
    (plain shards, or rows in head-aligned order), which DCP could not reshard as they are."""
    return getattr(owner, "_snn_tp_shards", None) is not None


def saveable(owner: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """What DCP writes for ``owner.name`` (or a tensor laid out like it): DTensors as they are,
    channel / head shards gathered whole in the model's row order (a collective)."""
    tensor = tensor.detach()
    if not kept_whole(owner):
        return tensor
    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return full_tensor(owner, name, whole.contiguous())


def from_whole(owner: nn.Module, name: str, like: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`saveable` for a kept-whole tensor: this rank's part of ``whole``, laid
    out like ``like`` (a DTensor with its placements, else a plain shard). No collective."""
    local = local_shard(owner, name, whole)
    if isinstance(like, DTensor):
        return distribute_tensor(local, like.device_mesh, like.placements, src_data_rank=None)
    return local


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def model_shape(owner: nn.Module, name: str, tensor: torch.Tensor) -> Tuple[int, ...]:
    """The global shape of ``owner.name`` as the checkpoint stores it."""
    return tuple(full_shape(owner, name, tensor))


def model_tensor_shapes(module: nn.Module) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """Full path -> (global shape, dtype) of what a checkpoint of ``module`` holds; no collective."""
    return {path: (model_shape(owner, name, t), _dtype_name(t.dtype))
            for path, owner, name, t in _whole_model_tensors(module)}


# ---- the optimizer ---------------------------------------------------------------------------------
def local_optimizer(optimizer):
    """The optimizer holding this rank's state: ZeRO's partition optimizer, else ``optimizer``."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def optimizer_class(optimizer) -> str:
    return type(local_optimizer(optimizer)).__name__


def param_owners(module: nn.Module) -> Dict[int, Tuple[str, nn.Module, str]]:
    return {id(t): (path, owner, name) for path, owner, name, t in model_tensors(module) if isinstance(t, nn.Parameter)}


def group_settings(optimizer) -> List[Dict[str, Any]]:
    """The hyperparameters of each param group (JSON values), without the parameters."""
    def plain(value):
        return value.item() if isinstance(value, torch.Tensor) else value

    return [{k: plain(v) for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def _like(value: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether optimizer state ``value`` is laid out like its parameter (``exp_avg``; not ``step``)."""
    return value.shape == param.shape and isinstance(value, DTensor) == isinstance(param, DTensor)


def optimizer_entries(module: nn.Module, optimizer) -> Dict[str, torch.Tensor]:
    owners = param_owners(module)
    out = {}
    for param, state in local_optimizer(optimizer).state.items():
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
            out[f"optim.{path}.{key}"] = saveable(owner, name, value) if _like(value, param) else value.detach()
    return out


def _whole_like(owner, name, tensor: torch.Tensor) -> torch.Tensor:
    """An empty plain tensor of the full shape of ``owner.name`` (laid out like ``tensor``)."""
    return torch.empty(full_shape(owner, name, tensor), dtype=tensor.dtype, device=local_part(tensor).device)


def destination(owner, name, tensor: torch.Tensor) -> torch.Tensor:
    """A fresh tensor DCP reads ``owner.name`` into (a staging copy: the live one changes only once
    everything is read and checked): laid out like ``tensor`` (a DTensor keeps its placements),
    or whole for a kept-whole one."""
    return _whole_like(owner, name, tensor) if kept_whole(owner) else torch.empty_like(tensor.detach())


def non_finite(state: Dict[str, torch.Tensor]) -> List[str]:
    """The keys of ``state`` whose floating-point values (this rank's part) are not all finite."""
    return [key for key, t in state.items()
            if t.is_floating_point() and not bool(torch.isfinite(local_part(t)).all())]


def optimizer_destinations(module, optimizer, saved) -> Dict[str, Tuple[torch.Tensor, Any]]:
    """``key -> (tensor DCP fills, (param, state key, owner, name))`` for the parameters this rank's
    optimizer holds."""
    owners = param_owners(module)
    out = {}
    for group in local_optimizer(optimizer).param_groups:
        for param in group["params"]:
            path, owner, name = owners[id(param)]
            prefix = f"optim.{path}."
            for key, meta in saved.items():
                if not key.startswith(prefix) or "." in key[len(prefix):]:
                    continue
                state_key = key[len(prefix):]
                if tuple(meta.size) == model_shape(owner, name, param):
                    dest = destination(owner, name, param)
                else:
                    dest = torch.empty(meta.size, dtype=meta.properties.dtype)
                out[key] = (dest, (param, state_key, owner, name))
    return out


def restore_optimizer(optimizer, loaded: Dict[str, Tuple[torch.Tensor, Any]], groups: List[dict]) -> None:
    local = local_optimizer(optimizer)
    local.state.clear()
    for tensor, (param, key, owner, name) in loaded.values():
        like = tuple(tensor.shape) == model_shape(owner, name, param)
        local.state[param][key] = from_whole(owner, name, param, tensor) if like and kept_whole(owner) else tensor
    for group, settings in zip(optimizer.param_groups, groups):
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()})
