"""Tensor parallelism: the plan's styles through ``parallelize_module`` on the tp sub-mesh."""
from __future__ import annotations

from typing import Dict, Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from ..analysis import SNNDistributedAnalysis


def parallel_style(style: str) -> ParallelStyle:
    """The torch ParallelStyle for a Linear style name of a plan."""
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style == "colwise_gather":
        return ColwiseParallel(output_layouts=Replicate())
    raise ValueError(f"no ParallelStyle for TP style {style!r}")


def _local_widths(analysis: SNNDistributedAnalysis, tp_plan: Mapping[str, str], tp: int) -> Dict[str, tuple]:
    """For each ``local`` module: (full, local) feature count of the column-sharded Linear before it."""
    widths, candidates = {}, set(analysis.tensor_parallel_candidate_names)
    for chain in analysis.tp_chains:
        width = None
        for path in chain:
            if path in candidates:
                width = analysis.shape(path).out_features if tp_plan.get(path) == "colwise" else None
            elif tp_plan.get(path) == "local" and width is not None:
                widths[path] = (width, width // tp)
    return widths


def _shard_check(path: str, full: int, local: int):
    def hook(module, args):
        if args and hasattr(args[0], "shape") and args[0].shape[-1] != local:
            raise RuntimeError(
                f"{path} keeps local neuron state for a 1/{full // local} shard of {full} features and "
                f"expects inputs with {local} features on this rank, got shape {tuple(args[0].shape)}; "
                "the Linear before it must be column-sharded (check the tensor_parallel_plan)")
    return hook


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, tp_plan: Mapping[str, str],
             analysis: SNNDistributedAnalysis) -> None:
    """Shard the plan's Linears; stateful modules after a column shard keep local state, checked."""
    styles = {p: parallel_style(s) for p, s in tp_plan.items() if s != "local"}
    parallelize_module(model, tp_mesh, styles)
    for path, (full, local) in _local_widths(analysis, tp_plan, tp_mesh.size()).items():
        model.get_submodule(path).register_forward_pre_hook(_shard_check(path, full, local))
