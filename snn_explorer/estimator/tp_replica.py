"""One TP rank's compute, in one process: a copy of the model with TP-local layer shapes.

The dynamic memory of a TP rank (activations, neuron state, temporaries, gradients of
activations) is that of the model with each sharded layer cut to its local shape, plus the
buffers its collectives allocate. :func:`tp_replica` builds that model for a plan's
``path -> style`` map (the styles of ``core.tp_plan``):

- ``colwise`` / ``conv_colwise`` / ``qkv_colwise``: ``1/tp`` of the output features or channels;
  in backward the input gradient is all-reduced (a second, full-size input gradient);
- ``rowwise`` / ``conv_rowwise``: ``1/tp`` of the input features or channels; the partial output
  is all-reduced into a new tensor (before a convolution's bias);
- ``colwise_gather``: ``colwise``, and the local output is all-gathered into a full-size one;
- ``norm_local`` / ``qkv_norm_local``: a BatchNorm over ``1/tp`` of the channels;
- ``heads_local``: ``num_heads / tp``; ``local``: unchanged (neurons take the width of their input).

Values differ from a real rank's (the cut keeps the first rows); sizes, which are all the
estimate reads, do not.
"""
from __future__ import annotations

import types
from typing import Mapping

import torch
from torch import nn

from ..core.neurons import detached_copy

COLWISE = ("colwise", "colwise_gather", "conv_colwise", "qkv_colwise")
ROWWISE = ("rowwise", "conv_rowwise")
NORMS = ("norm_local", "qkv_norm_local")
MODELLED = COLWISE + ROWWISE + NORMS + ("heads_local", "local")


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


def _rowwise_conv(self, x, weight, bias):
    out = type(self)._conv_forward(self, x, weight, None).contiguous().clone()
    return out if bias is None else out + bias.view(-1, *([1] * len(self.kernel_size)))


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


def tp_replica(model: nn.Module, tp_plan: Mapping[str, str], tp: int) -> nn.Module:
    """A copy of ``model`` computing what one rank of ``tp`` computes under ``tp_plan`` (see module doc)."""
    unknown = sorted({s for s in tp_plan.values() if s not in MODELLED})
    if unknown:
        raise NotImplementedError(f"the estimator models the TP styles {MODELLED}, not {unknown}")
    replica = detached_copy(model)
    for path, style in tp_plan.items():
        module = replica.get_submodule(path)
        if style in COLWISE:
            _cut_outputs(module, tp)
            module.register_forward_pre_hook(_input_grad_reduce)
            if style == "colwise_gather":
                module.register_forward_hook(_all_gather_output(tp))
        elif style in ROWWISE:
            _cut_inputs(module, tp)
            if isinstance(module, nn.Linear):
                module.register_forward_hook(_all_reduce_output)
            else:
                module._conv_forward = types.MethodType(_rowwise_conv, module)
        elif style in NORMS:
            _cut_norm(module, tp)
        elif style == "heads_local":
            module.num_heads //= tp
    return replica
