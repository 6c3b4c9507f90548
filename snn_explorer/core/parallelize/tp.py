"""Tensor parallelism: the plan's styles through ``parallelize_module`` on the tp sub-mesh."""
from __future__ import annotations

from typing import Dict, Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from ..tp_plan import LINEAR_STYLES
from .channel_tp import shard_conv, shard_fused_qkv, shard_norm


def parallel_style(style: str) -> ParallelStyle:
    """The torch ParallelStyle for a Linear style name of a plan."""
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style == "colwise_gather":
        return ColwiseParallel(output_layouts=Replicate())
    raise ValueError(f"no ParallelStyle for TP style {style!r}")


def _local_widths(model: nn.Module, tp_plan: Mapping[str, str], tp: int) -> Dict[str, tuple]:
    """For each ``local`` module: (full, local, dim) of the nearest sharded layer before it.

    ``dim`` is -1 (features) after a column-sharded Linear and the channel dim after an
    output-channel-sharded convolution. "Before" is registration order, which is execution order
    for the chains and attention blocks the planner shards.
    """
    widths, width = {}, None
    for path, module in model.named_modules():
        style = tp_plan.get(path)
        if isinstance(module, nn.Linear) and style in LINEAR_STYLES:
            width = (module.out_features, -1) if style == "colwise" else None
        elif style == "qkv_colwise" and isinstance(module, nn.Linear):
            width = (module.out_features, -1)
        elif isinstance(module, nn.modules.conv._ConvNd) and style in ("conv_colwise", "conv_rowwise", "qkv_colwise"):
            width = (module.out_channels, -1 - len(module.kernel_size)) if style != "conv_rowwise" else None
        elif style == "local":
            if width is None:
                raise ValueError(f"tensor_parallel_plan marks {path!r} 'local' but no column-sharded layer "
                                 "precedes it")
            widths[path] = (width[0], width[0] // tp, width[1])
    return widths


def _shard_check(path: str, full: int, local: int, dim: int):
    def hook(module, args):
        if args and hasattr(args[0], "shape") and args[0].shape[dim] != local:
            raise RuntimeError(
                f"{path} keeps local neuron state for a 1/{full // local} shard of {full} features and "
                f"expects inputs with {local} features (dim {dim}) on this rank, got shape "
                f"{tuple(args[0].shape)}; the layer before it must be column-sharded (check the tensor_parallel_plan)")
    return hook


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, tp_plan: Mapping[str, str]) -> None:
    """Shard the plan's Linears, convolutions and norms; stateful modules after a column shard keep
    local state, checked."""
    styles = {p: parallel_style(s) for p, s in tp_plan.items() if s in LINEAR_STYLES}
    widths = _local_widths(model, tp_plan, tp_mesh.size())
    if styles:
        parallelize_module(model, tp_mesh, styles)
    for path, style in tp_plan.items():
        if style in ("conv_colwise", "conv_rowwise"):
            shard_conv(model.get_submodule(path), tp_mesh, style)
        elif style in ("norm_local", "qkv_norm_local"):
            shard_norm(model.get_submodule(path), tp_mesh, fused_qkv=style == "qkv_norm_local")
        elif style == "qkv_colwise":
            shard_fused_qkv(model.get_submodule(path), tp_mesh)
        elif style == "heads_local":
            model.get_submodule(path).num_heads //= tp_mesh.size()
    for path, (full, local, dim) in widths.items():
        model.get_submodule(path).register_forward_pre_hook(_shard_check(path, full, local, dim))
