"""An snntorch-tutorial-style net (tutorial 5): a forward that loops a fixed ``num_steps`` and indexes
``x[step]``, returning the stacked ``(spk, mem)`` records; ``make_net`` and ``make_input`` for the CLI."""
import snntorch as snn
import torch
from torch import nn

NUM_STEPS = 8


class FixedLoopNet(nn.Module):
    def __init__(self, num_steps: int = NUM_STEPS):
        super().__init__()
        self.num_steps = num_steps
        self.fc1, self.lif1 = nn.Linear(16, 32), snn.Leaky(beta=0.9)
        self.fc2, self.lif2 = nn.Linear(32, 4), snn.Leaky(beta=0.9)

    def forward(self, x):
        mem1, mem2 = self.lif1.init_leaky(), self.lif2.init_leaky()
        spk_rec = []
        for step in range(self.num_steps):
            spk1, mem1 = self.lif1(self.fc1(x[step]), mem1)
            spk2, mem2 = self.lif2(self.fc2(spk1), mem2)
            spk_rec.append(spk2)
        return torch.stack(spk_rec)


def make_net():
    return FixedLoopNet()


def make_input():
    return torch.rand(NUM_STEPS, 8, 16)
