"""Small models and helpers shared by the unit and multi-rank tests."""
import snntorch as snn
import torch
import torch.distributed as dist
from torch import nn


def leaky():
    return snn.Leaky(beta=0.9, init_hidden=True)


class MLP(nn.Module):
    """body: Linear(8,16) -> Leaky -> Linear(16,8); head: Linear(8,10) (a singleton chain)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), leaky(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.body(x))


class TimeLoop(nn.Module):
    """Run a single-step ``net`` over dim 0 (time) of ``[T, N, ...]`` and stack the outputs."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return torch.stack([self.net(x[t]) for t in range(x.shape[0])])


def gather_over_dp(runtime, out: torch.Tensor) -> torch.Tensor:
    """This rank's ``[T, n, C]`` outputs concatenated along the batch over the dp ranks."""
    if runtime.plan.dp_size == 1:
        return out.detach()
    parts = [torch.empty_like(out) for _ in range(runtime.plan.dp_size)]
    dist.all_gather(parts, out.detach().contiguous(), group=runtime.mesh.get_group("dp"))
    return torch.cat(parts, dim=1)
