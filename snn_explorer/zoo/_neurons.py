"""Shared building blocks: the zoo's LIF neuron and the two time-handling wrappers.

Tensors are time-first ``[T, N, ...]``. Stateless layers either work on leading dims as they
are (``nn.Linear``) or run with time folded into the batch (:class:`SeqWise`); stateful neurons
always step over time (:class:`MultiStep`), so their membrane carries over from ``t`` to ``t+1``.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import snntorch
import torch
from snntorch import surrogate
from torch import nn


class ATanSurrogate:
    """snntorch's arctan surrogate (``surrogate.atan``), but spikes keep the membrane's dtype.

    Stock ``surrogate.atan()`` always returns float32 spikes, which breaks float64/bf16 models;
    being a plain class instance (not a closure), this one also pickles.
    """

    def __init__(self, alpha: float = 2.0):
        self.alpha = alpha

    def __call__(self, mem_shift: torch.Tensor) -> torch.Tensor:
        return surrogate.ATan.apply(mem_shift, self.alpha).to(mem_shift.dtype)


def lif(beta: float) -> snntorch.Leaky:
    """A stateful leaky integrate-and-fire neuron (threshold 1, reset by subtraction, atan surrogate)."""
    return snntorch.Leaky(beta=beta, init_hidden=True, spike_grad=ATanSurrogate())


class MultiStep(nn.Module):
    """Run a stateful single-step ``neuron`` over dim 0 (time) of ``[T, N, ...]`` and stack the spikes."""

    def __init__(self, neuron: nn.Module):
        super().__init__()
        self.neuron = neuron

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.neuron(x_t) for x_t in x.unbind(0)])


class SeqWise(nn.Module):
    """Apply a stateless ``module`` to ``[T, N, ...]`` with time folded into the batch (``[T*N, ...]``)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x.flatten(0, 1)).unflatten(0, x.shape[:2])


def conv_bn_lif(c_in: int, c_out: int, beta: float, kernel: int = 3, stride: int = 1,
                padding: int = 1, conv_gain: float = 2.5) -> nn.Sequential:
    """``Conv2d(bias=False) -> BatchNorm2d`` (time folded into batch) ``-> Leaky`` (stepping over time).

    Children are named ``conv``, ``bn``, ``lif``; the first two are :class:`SeqWise`, the last
    :class:`MultiStep`. The conv init is normal with std ``conv_gain / sqrt(fan_in)``: about
    unit-scale currents from ~15%-rate spikes, so neurons also fire in eval mode, where BN still
    has its initial running stats (mean 0, var 1).
    """
    conv = nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=padding, bias=False)
    nn.init.normal_(conv.weight, std=conv_gain / math.sqrt(c_in * kernel * kernel))
    return nn.Sequential(OrderedDict(
        conv=SeqWise(conv),
        bn=SeqWise(nn.BatchNorm2d(c_out)),
        lif=MultiStep(lif(beta)),
    ))


@torch.no_grad()
def scale_linear_init(module: nn.Module, gain: float) -> None:
    """Multiply the default init of every ``nn.Linear`` under ``module`` by ``gain``."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            m.weight.mul_(gain)
            if m.bias is not None:
                m.bias.mul_(gain)
