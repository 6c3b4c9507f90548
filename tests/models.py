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


def wide_jelly():
    """(model, input, labels): a plain chain of wide spikingjelly layer.Linear (multi-step); FSDP2's
    units are the Linears, two of which dominate (estimator accuracy tests and benchmark)."""
    from spikingjelly.activation_based import functional, layer, neuron

    torch.manual_seed(0)
    model = nn.Sequential(layer.Linear(64, 1024), neuron.LIFNode(), layer.Linear(1024, 1024), neuron.LIFNode(),
                          layer.Linear(1024, 1024), neuron.LIFNode(), layer.Linear(1024, 10))
    functional.set_step_mode(model, "m")
    return model, torch.rand(2, 4, 64, generator=torch.Generator().manual_seed(1)) * 2, torch.arange(4) % 10


class _DominantClassifier(nn.Module):
    """VGG-style: a small conv feature stack, then a classifier whose first Linear (4096 x 1024)
    holds most of the parameters (VGG's 25088 x 4096, scaled down)."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(2, 16, 3, padding=1), nn.BatchNorm2d(16),
                                      leaky(), nn.AvgPool2d(2))
        self.classifier = nn.Sequential(nn.Linear(16 * 16 * 16, 1024), leaky(),
                                        nn.Linear(1024, 10))

    def forward(self, x):
        return torch.stack([self.classifier(self.features(x_t).flatten(1)) for x_t in x])


def dominant_classifier():
    """(model, input [2, 4, 2, 32, 32], labels) of :class:`_DominantClassifier`."""
    torch.manual_seed(0)
    return _DominantClassifier(), torch.rand(2, 4, 2, 32, 32, generator=torch.Generator().manual_seed(1)), \
        torch.arange(4) % 10
