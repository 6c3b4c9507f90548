"""Tensor parallelism: each path of the plan sharded by its style (``core.styles``) on the tp sub-mesh."""
from __future__ import annotations

from typing import Dict, Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..tp.styles import SHARDED, STYLES


def _local_widths(model: nn.Module, tp_plan: Mapping[str, str], tp: int) -> Dict[str, tuple]:
    """For each ``local`` module: (full, local, dim) of the nearest sharded layer before it.

    ``dim`` is the sharded dim of that layer's output (-1 for features, the channel dim after an
    output-channel-sharded convolution). "Before" is registration order, which is execution order
    for the chains and attention blocks the planner shards (checked at plan time).
    """
    widths, width = {}, None
    for path, module in model.named_modules():
        style = STYLES.get(tp_plan.get(path))
        if style is None:
            continue
        if style.takes == SHARDED and style.gives == SHARDED and style.kind == "neuron":
            if width is None:
                raise ValueError(f"tensor_parallel_plan marks {path!r} {style.name!r} but no column-sharded layer "
                                 "precedes it")
            widths[path] = (width[0], width[0] // tp, width[1])
        elif style.cut in ("outputs", "inputs"):
            width = style.sharded_width(module)
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
    """Shard the plan's Linears, convolutions, norms and attention modules by their styles; stateful
    modules after a column shard keep local state, checked."""
    widths = _local_widths(model, tp_plan, tp_mesh.size())
    for path, name in tp_plan.items():
        STYLES[name].apply(model.get_submodule(path), tp_mesh)
    for path, (full, local, dim) in widths.items():
        model.get_submodule(path).register_forward_pre_hook(_shard_check(path, full, local, dim))
