"""Channel tensor parallelism for convolutions and BatchNorm, and head-aligned fused q/k/v, as
torch ``ParallelStyle`` subclasses (applied with ``parallelize_module``).

``ConvColwiseParallel``: weight (and bias) sharded on output channels, input replicated; a forward
pre-hook makes the input's gradient a sum over the tp group. ``ConvRowwiseParallel``: weight sharded on
input channels; a forward hook sums the partial outputs over the tp group (the bias, which every
rank adds, counted once). ``NormLocalParallel``: a BatchNorm between such a pair holds its channel shard.
Only hooks and parameters change, never the module's forward, so wrappers such as
spikingjelly's multi-step layers (which call the convolution inside their own forward) keep
working. The shards are plain tensors (``DTensor`` has no channel-sharded convolution); each
sharded module records the group, the split dim per tensor and any row order in
``_snn_tp_shards``, and :func:`full_tensor` puts a full tensor back together from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, parallelize_module


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@dataclass
class ShardInfo:
    """How a module's tensors are split over a tp group: dim per tensor name, rows reordered by
    ``order`` (model order = ``local-major order[argsort]``) before the split."""

    group: object
    dims: Dict[str, int]
    order: Optional[torch.Tensor] = None


def _info(module: nn.Module, mesh: DeviceMesh) -> ShardInfo:
    info = getattr(module, "_snn_tp_shards", None)
    if info is None:
        info = ShardInfo(mesh.get_group(), {})
        module._snn_tp_shards = info
    return info


@torch.no_grad()
def _shard(module: nn.Module, name: str, dim: int, mesh: DeviceMesh) -> None:
    """Replace tensor ``name`` (parameter or buffer) by this rank's contiguous shard of ``dim``."""
    tensor = getattr(module, name, None)
    if tensor is None:
        return
    local = tensor.chunk(mesh.size(), dim=dim)[mesh.get_local_rank()].clone()
    if isinstance(tensor, nn.Parameter):
        setattr(module, name, nn.Parameter(local, requires_grad=tensor.requires_grad))
    else:
        setattr(module, name, local)
    _info(module, mesh).dims[name] = dim


def _channel_dim(module: nn.Module) -> int:
    return -1 - len(module.kernel_size)


class ConvColwiseParallel(ParallelStyle):
    """Output-channel sharded convolution (or Linear, as ``ColwiseParallel`` does it)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in ("weight", "bias"):
            _shard(module, name, 0, device_mesh)
        group = device_mesh.get_group()
        module.register_forward_pre_hook(
            lambda _m, args: (_CopyToGroup.apply(args[0], group),) + tuple(args[1:]))
        return module


class ConvRowwiseParallel(ParallelStyle):
    """Input-channel sharded convolution whose partial outputs are summed over the tp group."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _shard(module, "weight", 1, device_mesh)
        group, first = device_mesh.get_group(), device_mesh.get_local_rank() == 0

        def sum_partials(mod, _args, out):
            if mod.bias is not None and not first:  # every rank added the bias; keep rank 0's
                out = out - mod.bias.detach().view(-1, *([1] * len(mod.kernel_size)))
            return _SumOverGroup.apply(out, group)

        module.register_forward_hook(sum_partials)
        return module


class NormLocalParallel(ParallelStyle):
    """A BatchNorm holding this rank's channel shard of its parameters and running statistics."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in ("weight", "bias", "running_mean", "running_var"):
            _shard(module, name, 0, device_mesh)
        return module


def head_aligned_rows(width: int, size: int) -> torch.Tensor:
    """Row order of a fused ``[3 * width]`` q/k/v output that puts each rank's q, k and v shards
    (whole heads, as heads are contiguous within q, k and v) next to each other."""
    local = width // size
    return torch.cat([torch.arange(s * width + r * local, s * width + (r + 1) * local)
                      for r in range(size) for s in range(3)])


@torch.no_grad()
def _reorder_rows(module: nn.Module, width: int, mesh: DeviceMesh) -> None:
    """Permute dim 0 of the module's tensors into head-aligned order; keep the inverse so full
    tensors can be reported in the model's order."""
    order = head_aligned_rows(width, mesh.size())
    for name in ("weight", "bias", "running_mean", "running_var"):
        tensor = getattr(module, name, None)
        if tensor is not None:
            tensor.data = tensor.data[order].clone()
    _info(module, mesh).order = torch.argsort(order)


class FusedQkvColwiseParallel(ParallelStyle):
    """A fused q/k/v Linear or pointwise conv whose rows are split so each rank owns whole heads."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        linear = isinstance(module, nn.Linear)
        _reorder_rows(module, (module.out_features if linear else module.out_channels) // 3, device_mesh)
        return parallelize_module(module, device_mesh, ColwiseParallel() if linear else ConvColwiseParallel())


class FusedQkvNormParallel(ParallelStyle):
    """The BatchNorm on a fused q/k/v output, holding this rank's head-aligned channel shard."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _reorder_rows(module, module.num_features // 3, device_mesh)
        return parallelize_module(module, device_mesh, NormLocalParallel())


class HeadsLocalParallel(ParallelStyle):
    """An attention module computing ``num_heads / tp`` heads (its q/k/v come head-aligned)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.num_heads //= device_mesh.size()
        return module


def full_tensor(owner: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (the local value of ``owner.name``, or its gradient) as the full tensor in the
    model's row order; a collective over the tp group for split tensors. Others unchanged."""
    info = getattr(owner, "_snn_tp_shards", None)
    if info is None:
        return tensor
    if name in info.dims:
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(info.group))]
        dist.all_gather(parts, tensor.contiguous(), group=info.group)
        tensor = torch.cat(parts, dim=info.dims[name])
    return tensor[info.order] if info.order is not None and tensor.dim() else tensor


def full_shape(owner: nn.Module, name: str, tensor: torch.Tensor) -> torch.Size:
    """The shape :func:`full_tensor` would return for ``owner.name``, without a collective."""
    info = getattr(owner, "_snn_tp_shards", None)
    if info is None or name not in info.dims:
        return tensor.shape
    shape = list(tensor.shape)
    shape[info.dims[name]] *= dist.get_world_size(info.group)
    return torch.Size(shape)


def local_shard(owner: nn.Module, name: str, full: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`full_tensor`: this rank's shard of ``full`` (model row order) as
    ``owner.name`` holds it (rows reordered, then split). No collective."""
    info = owner._snn_tp_shards
    if info.order is not None and full.dim():
        full = full[torch.argsort(info.order)]
    if name not in info.dims:
        return full
    return full.chunk(dist.get_world_size(info.group), dim=info.dims[name])[dist.get_rank(info.group)].clone()
