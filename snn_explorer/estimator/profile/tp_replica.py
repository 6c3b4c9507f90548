"""One TP rank's compute, in one process: a copy of the model with TP-local layer shapes.

The dynamic memory of a TP rank (activations, neuron state, temporaries, gradients of
activations) is that of the model with each sharded layer cut to its local shape, plus the
buffers its collectives allocate. :func:`tp_replica` builds that model for a plan's
``path -> style`` map, each module cut as its style (``core.styles``) says:

- ``cut="outputs"``: ``1/tp`` of the output features or channels;
- ``cut="inputs"``: ``1/tp`` of the input features or channels;
- ``cut="norm"``: a BatchNorm over ``1/tp`` of the channels; ``cut="heads"``: ``num_heads / tp``;
- a style that all-reduces its input gradient gets a second, full-size input gradient in
  backward; one that all-reduces its partial output returns a new tensor; one that gathers its
  output returns a full-size one. Neurons take the width of their input.

Values differ from a real rank's (the cut keeps the first rows); sizes, which are all the
estimate reads, do not.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from ...core.model import shared_storage_copy
from ...core.tp import STYLES


class _GradAllReduce(torch.autograd.Function):
    """Identity forward; backward returns a new tensor, like an all-reduce of a partial gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous().clone()


def _input_grad_reduce(module, args):
    return tuple(_GradAllReduce.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)


def _all_reduce_output(module, args, out):
    return out.contiguous().clone()


def _all_gather_output(tp: int):
    def hook(module, args, out):
        return torch.cat([out] * tp, dim=-1)
    return hook


def _keep(param, index) -> nn.Parameter:
    return nn.Parameter(param.data[index].clone(), requires_grad=param.requires_grad)


@torch.no_grad()
def _cut_outputs(module: nn.Module, tp: int) -> None:
    rows = slice(0, (module.out_features if isinstance(module, nn.Linear) else module.out_channels) // tp)
    module.weight = _keep(module.weight, rows)
    if module.bias is not None:
        module.bias = _keep(module.bias, rows)
    if isinstance(module, nn.Linear):
        module.out_features = rows.stop
    else:
        module.out_channels = rows.stop


@torch.no_grad()
def _cut_inputs(module: nn.Module, tp: int) -> None:
    if isinstance(module, nn.Linear):
        module.in_features //= tp
        module.weight = _keep(module.weight, (slice(None), slice(0, module.in_features)))
    else:
        module.in_channels //= tp
        module.weight = _keep(module.weight, (slice(None), slice(0, module.in_channels // module.groups)))


@torch.no_grad()
def _cut_norm(module: nn.Module, tp: int) -> None:
    module.num_features //= tp
    rows = slice(0, module.num_features)
    for name in ("weight", "bias"):
        if getattr(module, name) is not None:
            setattr(module, name, _keep(getattr(module, name), rows))
    for name in ("running_mean", "running_var"):
        if getattr(module, name) is not None:
            setattr(module, name, getattr(module, name)[rows].clone())


def _cut_heads(module: nn.Module, tp: int) -> None:
    module.num_heads //= tp


_CUTS = {"outputs": _cut_outputs, "inputs": _cut_inputs, "norm": _cut_norm, "heads": _cut_heads}


def tp_replica(model: nn.Module, tp_plan: Mapping[str, str], tp: int) -> nn.Module:
    """A copy of ``model`` computing what one rank of ``tp`` computes under ``tp_plan`` (see module doc).
    The layers it leaves whole share ``model``'s parameter storage (:func:`~...core.neurons.shared_storage_copy`):
    forward and backward read those weights and write the replica's own gradients; the optimizer steps the estimator
    counts on it write them and are undone (``compute_work.restored``)."""
    unknown = sorted({s for s in tp_plan.values() if s not in STYLES})
    if unknown:
        raise NotImplementedError(f"the estimator models the TP styles {tuple(STYLES)}, not {unknown}")
    replica = shared_storage_copy(model)
    for path, name in tp_plan.items():
        style, module = STYLES[name], replica.get_submodule(path)
        if style.cut:
            _CUTS[style.cut](module, tp)
        if style.reduces_input_grad:
            module.register_forward_pre_hook(_input_grad_reduce)
        if style.gathers_output:
            module.register_forward_hook(_all_gather_output(tp))
        if style.reduces_output:
            module.register_forward_hook(_all_reduce_output)
    return replica
