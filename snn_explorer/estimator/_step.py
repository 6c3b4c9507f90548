"""The training step that the profile and measure() both run, so their numbers describe the same work."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..core import SNNDistributedRuntime
from ..core.neurons import reset_all

OPTIMIZERS = {
    "adam": (torch.optim.Adam, {}),
    "adamw": (torch.optim.AdamW, {}),
    "sgd": (torch.optim.SGD, {}),
    "sgd_momentum": (torch.optim.SGD, {"momentum": 0.9}),
}


def check_optimizer(name: str) -> str:
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer={name!r}; expected one of {tuple(OPTIMIZERS)}")
    return name


def loss_of(outputs: torch.Tensor, labels: Optional[torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of the time-mean output when ``labels`` are given, else the mean square output."""
    if labels is None:
        return outputs.square().mean()
    outputs, labels = SNNDistributedRuntime.prepare_classification_output(outputs, labels)
    return nn.functional.cross_entropy(outputs, labels)


def forward_loss(model: nn.Module, inputs: torch.Tensor, labels: Optional[torch.Tensor]) -> torch.Tensor:
    """Reset every stateful neuron, run the model on ``[T, N, ...]`` and return the loss."""
    reset_all(model)
    return loss_of(model(inputs), labels)


def batch_slice(example_input: torch.Tensor, labels: Optional[torch.Tensor], n: int, t: int, start: int = 0):
    """``n`` samples from ``start`` and ``t`` steps of ``[T, N, ...]`` (indices wrap), as fresh tensors."""
    steps = torch.arange(t) % example_input.shape[0]
    samples = (torch.arange(n) + start) % example_input.shape[1]
    x = example_input[steps][:, samples].contiguous()
    y = None if labels is None else labels[samples].contiguous()
    return x, y
