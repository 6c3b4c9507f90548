"""Channel tensor parallelism for convolutions and BatchNorm, and head-aligned fused q/k/v.

``conv_colwise``: weight (and bias) sharded on output channels, input replicated; the input's
gradient is summed over the tp group. ``conv_rowwise``: weight sharded on input channels; partial
outputs are summed over the tp group before the (replicated) bias. Their parameters are DTensors
on the tp mesh (FSDP2 composes, ``full_tensor()`` recovers them), and only the convolution itself
is replaced (``_conv_forward``), so wrappers such as spikingjelly's multi-step layers keep working.
``norm_local``: a BatchNorm between such a pair holds its channel shard as plain tensors; the
runtime gathers them over ``_snn_tp_group`` when it reports full parameters.
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


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, placement) -> None:
    param = getattr(module, name)
    if param is not None:
        setattr(module, name, nn.Parameter(distribute_tensor(param.data, mesh, [placement]),
                                           requires_grad=param.requires_grad))


def _local(t):
    return None if t is None else t.to_local()


def _colwise_conv(self, x, weight, bias):
    return type(self)._conv_forward(self, _CopyToGroup.apply(x, self._tp_group), _local(weight), _local(bias))


def _rowwise_conv(self, x, weight, bias):
    out = _SumOverGroup.apply(type(self)._conv_forward(self, x, _local(weight), None), self._tp_group)
    return out if bias is None else out + _local(bias).view(-1, *([1] * len(self.kernel_size)))


def _colwise_linear(self, x):
    return F.linear(_CopyToGroup.apply(x, self._tp_group), _local(self.weight), _local(self.bias))


def shard_conv(module: nn.Module, mesh: DeviceMesh, style: str) -> None:
    """Shard a Conv1d/2d/3d in place as ``conv_colwise`` or ``conv_rowwise`` (a Linear: colwise)."""
    colwise = style == "conv_colwise"
    _distribute(module, "weight", mesh, Shard(0) if colwise else Shard(1))
    _distribute(module, "bias", mesh, Shard(0) if colwise else Replicate())
    module._tp_group = mesh.get_group()
    if isinstance(module, nn.Linear):
        module.forward = types.MethodType(_colwise_linear, module)
    else:
        module._conv_forward = types.MethodType(_colwise_conv if colwise else _rowwise_conv, module)


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
    rank, width = mesh.get_local_rank(), module.num_features // mesh.size()
    rows = slice(rank * width, (rank + 1) * width)
    for name in ("weight", "bias"):
        param = getattr(module, name)
        if param is not None:
            setattr(module, name, nn.Parameter(param.data[rows].clone(), requires_grad=param.requires_grad))
    for name in ("running_mean", "running_var"):
        stat = getattr(module, name)
        if stat is not None:
            setattr(module, name, stat[rows].clone())
    module._snn_tp_group = mesh.get_group()
