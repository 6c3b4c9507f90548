"""snntorch's tutorial style: neurons created with ``init_hidden=False`` whose membrane the model's
``forward`` passes in and gets back (``spk, mem = self.lif(cur, mem)``)."""
from __future__ import annotations

import snntorch
import torch
from torch import nn

from ._neurons import ATanSurrogate, scale_linear_init


class TutorialMLP(nn.Module):
    """``fc1 -> lif1 -> fc2 -> lif2 -> fc3``, stepped over time by ``forward`` as snntorch's tutorials do.

    The membranes are local variables of ``forward``, started fresh (``init_leaky()``) on every
    call, so nothing carries over between batches. Input ``[T, N, in_features]``, output
    ``[T, N, num_classes]`` (the head's current at every step).
    """

    def __init__(self, in_features: int, hidden: int, num_classes: int, *, beta: float = 0.9,
                 init_gain: float = 1.0):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.lif1 = snntorch.Leaky(beta=beta, init_hidden=False, spike_grad=ATanSurrogate())
        self.fc2 = nn.Linear(hidden, hidden)
        self.lif2 = snntorch.Leaky(beta=beta, init_hidden=False, spike_grad=ATanSurrogate())
        self.fc3 = nn.Linear(hidden, num_classes)
        scale_linear_init(self, init_gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mem1, mem2 = self.lif1.init_leaky(), self.lif2.init_leaky()
        out = []
        for x_t in x.unbind(0):
            spk1, mem1 = self.lif1(self.fc1(x_t), mem1)
            spk2, mem2 = self.lif2(self.fc2(spk1), mem2)
            out.append(self.fc3(spk2))
        return torch.stack(out)
