"""One TP rank's compute, in one process: a copy of the model with TP-local layer shapes.

The dynamic memory of a TP rank (activations, temporaries, gradients of activations) is that of
the unsharded model with each sharded Linear cut to its local shape, plus the buffers the
collectives allocate. :func:`tp_replica` builds that model for a plan's ``path -> style`` map:

- ``colwise``: ``out_features / tp`` rows; in backward the input gradient is all-reduced (a
  second, full-size input gradient);
- ``rowwise``: ``in_features / tp`` columns; the partial output is all-reduced into a new tensor;
- ``colwise_gather``: ``colwise``, and the local output is all-gathered into a full-size one;
- ``local``: unchanged (neurons take the local width from their input).

The profile measures its peak like the unsharded model's (:meth:`ModelProfile.dynamic_peak`).
"""
from __future__ import annotations

import copy
from typing import Mapping

import torch
from torch import nn

from ..core.neurons import reset_all


class _GradAllReduce(torch.autograd.Function):
    """Identity forward; backward returns a new tensor, like an all-reduce of a partial gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.clone()


def _input_grad_reduce(module, args):
    return tuple(_GradAllReduce.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)


def _all_reduce_output(module, args, out):
    return out.clone()


def _all_gather_output(tp: int):
    def hook(module, args, out):
        return torch.cat([out] * tp, dim=-1)
    return hook


@torch.no_grad()
def _cut(linear: nn.Linear, rows: int = None, cols: int = None) -> None:
    if rows is not None:
        linear.weight = nn.Parameter(linear.weight[:rows].clone(), linear.weight.requires_grad)
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias[:rows].clone(), linear.bias.requires_grad)
        linear.out_features = rows
    if cols is not None:
        linear.weight = nn.Parameter(linear.weight[:, :cols].clone(), linear.weight.requires_grad)
        linear.in_features = cols


def tp_replica(model: nn.Module, tp_plan: Mapping[str, str], tp: int) -> nn.Module:
    """A copy of ``model`` computing what one rank of ``tp`` computes under ``tp_plan`` (see module doc)."""
    reset_all(model)  # neuron state left by a forward is part of its graph and cannot be deep-copied
    replica = copy.deepcopy(model)
    for path, style in tp_plan.items():
        module = replica.get_submodule(path)
        if style == "local":
            continue
        if not isinstance(module, nn.Linear):
            raise NotImplementedError(f"the TP replica models Linear styles, not {style!r} on {path!r}")
        if style in ("colwise", "colwise_gather"):
            _cut(module, rows=module.out_features // tp)
            module.register_forward_pre_hook(_input_grad_reduce)
            if style == "colwise_gather":
                module.register_forward_hook(_all_gather_output(tp))
        elif style == "rowwise":
            _cut(module, cols=module.in_features // tp)
            module.register_forward_hook(_all_reduce_output)
        else:
            raise NotImplementedError(f"the TP replica does not model the style {style!r} of {path!r}")
    return replica
