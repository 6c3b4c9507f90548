"""A fully connected spiking classifier with two interchangeable ways of stepping over time."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ._neurons import MultiStep, lif, scale_linear_init

STEPPINGS = ("per_step", "all_steps")


class SpikingMLP(nn.Module):
    """``Linear -> Leaky (-> Dropout)`` per hidden width, then a ``Linear`` head with no neuron.

    Input ``[T, N, in_features]``, output ``[T, N, num_classes]``: the head's input current at
    every time step (its would-be membrane drive; differentiable through the surrogate spikes).
    All layers are consecutive children of the ``nn.Sequential`` ``net``.

    ``stepping="per_step"``: ``net`` holds plain ``Leaky`` neurons and ``forward`` calls
    ``net(x[t])`` once per step (a tensor-parallel Linear communicates ``T`` times).
    ``stepping="all_steps"``: ``net`` holds ``MultiStep(Leaky)`` and runs once on ``[T, N, F]``;
    each Linear sees all steps at once and only the neurons loop. Both compute the same function.
    ``init_gain`` scales the default Linear init so the hidden layers fire at moderate rates.
    """

    def __init__(self, in_features: int, hidden: Sequence[int], num_classes: int, *,
                 stepping: str = "per_step", beta: float = 0.9, dropout: float = 0.0,
                 init_gain: float = 1.0):
        super().__init__()
        if stepping not in STEPPINGS:
            raise ValueError(f"stepping={stepping!r} is not one of {STEPPINGS}")
        self.stepping = stepping
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            neuron = lif(beta)
            layers += [nn.Linear(width, h), neuron if stepping == "per_step" else MultiStep(neuron)]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)
        scale_linear_init(self, init_gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stepping == "all_steps":
            return self.net(x)
        return torch.stack([self.net(x_t) for x_t in x.unbind(0)])
