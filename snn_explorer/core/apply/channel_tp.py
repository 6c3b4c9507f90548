"""Channel tensor parallelism for convolutions and BatchNorm (behind ``allow_experimental_conv_tp``).

``conv_colwise``: weight (and bias) sharded on output channels, input replicated; the input's
gradient is summed over the tp group. ``conv_rowwise``: weight sharded on input channels; partial
outputs are summed over the tp group before the (replicated) bias. ``norm_local``: a BatchNorm
between them holds its channel shard (affine parameters and running statistics).
Parameters are DTensors on the tp mesh, so FSDP2 composes and ``full_tensor()`` recovers them.
"""
from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


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


def _shard_param(module: nn.Module, name: str, mesh: DeviceMesh, placement) -> None:
    param = getattr(module, name)
    if param is not None:
        setattr(module, name, nn.Parameter(distribute_tensor(param.data, mesh, [placement]),
                                           requires_grad=param.requires_grad))


def _local(t):
    return None if t is None else t.to_local()


def _colwise_forward(self, x):
    x = _CopyToGroup.apply(x, self._tp_group)
    if isinstance(self, nn.Linear):
        return F.linear(x, _local(self.weight), _local(self.bias))
    return self._conv_forward(x, _local(self.weight), _local(self.bias))


def _conv_rowwise_forward(self, x):
    out = _SumOverGroup.apply(self._conv_forward(x, _local(self.weight), None), self._tp_group)
    if self.bias is not None:
        out = out + _local(self.bias).view(-1, *([1] * len(self.kernel_size)))
    return out


def _norm_local_forward(self, x):
    factor = 0.0 if self.momentum is None else self.momentum
    if self.training and self.track_running_stats and self.num_batches_tracked is not None:
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
    batch_stats = self.training or (self.running_mean is None and self.running_var is None)
    keep = not self.training or self.track_running_stats
    return F.batch_norm(x, self.running_mean if keep else None, self.running_var if keep else None,
                        _local(self.weight), _local(self.bias), batch_stats, factor, self.eps)


def shard_conv(module: nn.Module, mesh: DeviceMesh, style: str) -> None:
    """Shard a Conv1d/2d/3d (or a Linear, for ``conv_colwise``) in place."""
    if style == "conv_colwise":
        _shard_param(module, "weight", mesh, Shard(0))
        _shard_param(module, "bias", mesh, Shard(0))
        forward = _colwise_forward
    else:
        _shard_param(module, "weight", mesh, Shard(1))
        _shard_param(module, "bias", mesh, Replicate())
        forward = _conv_rowwise_forward
    module._tp_group = mesh.get_group()
    module.forward = types.MethodType(forward, module)


def head_aligned_rows(width: int, size: int) -> torch.Tensor:
    """Row order of a fused ``[3 * width]`` q/k/v output that puts each rank's q, k and v shards
    (whole heads, as heads are contiguous within q, k and v) next to each other."""
    local = width // size
    return torch.cat([torch.arange(s * width + r * local, s * width + (r + 1) * local)
                      for r in range(size) for s in range(3)])


def _reorder_rows(module: nn.Module, order: torch.Tensor) -> None:
    """Permute dim 0 of the module's parameters and running statistics; keep the inverse so the
    runtime can report full tensors in the original order."""
    for name in ("weight", "bias", "running_mean", "running_var"):
        tensor = getattr(module, name, None)
        if tensor is not None:
            tensor.data = tensor.data[order].clone()
    module._snn_row_order = torch.argsort(order)


def shard_fused_qkv(module: nn.Module, mesh: DeviceMesh) -> None:
    """Shard a fused q/k/v Linear or pointwise conv so each rank owns whole heads of q, k and v."""
    width = (module.out_features if isinstance(module, nn.Linear) else module.out_channels) // 3
    _reorder_rows(module, head_aligned_rows(width, mesh.size()))
    shard_conv(module, mesh, "conv_colwise")


def shard_norm(module: nn.Module, mesh: DeviceMesh, fused_qkv: bool = False) -> None:
    """Give a BatchNorm this rank's channel shard of its parameters and running statistics
    (the head-aligned q/k/v shard when ``fused_qkv``)."""
    if fused_qkv:
        _reorder_rows(module, head_aligned_rows(module.num_features // 3, mesh.size()))
    rank, size = mesh.get_local_rank(), mesh.size()
    width = module.num_features // size
    _shard_param(module, "weight", mesh, Shard(0))
    _shard_param(module, "bias", mesh, Shard(0))
    for name in ("running_mean", "running_var"):
        stat = getattr(module, name)
        if stat is not None:
            setattr(module, name, stat[rank * width:(rank + 1) * width].clone())
    module.forward = types.MethodType(_norm_local_forward, module)
