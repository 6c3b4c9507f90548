"""Small models and helpers shared by the unit and multi-rank tests."""
import snntorch as snn
import torch
import torch.distributed as dist
from torch import nn

from snn_explorer.core.model import reset_all


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


def _sj_lif():
    from spikingjelly.activation_based import neuron

    return neuron.LIFNode(tau=2.0, v_threshold=0.5, step_mode="m", detach_reset=True)


class SpikeDrivenAttention(nn.Module):
    """Spike-driven self-attention on ``[T, N, C, L]`` tokens: q/k/v branches of 1x1 Conv1d +
    BatchNorm + LIF, heads, ``(q @ k^T) @ v`` scaled (no softmax), a LIF, a 1x1 conv + BN projection."""

    def __init__(self, dim: int = 8, num_heads: int = 2):
        from spikingjelly.activation_based import layer

        super().__init__()
        self.num_heads = num_heads
        for role in ("q", "k", "v"):
            setattr(self, f"{role}_conv", layer.Conv1d(dim, dim, 1, bias=False, step_mode="m"))
            setattr(self, f"{role}_bn", layer.BatchNorm1d(dim, step_mode="m"))
            setattr(self, f"{role}_lif", _sj_lif())
        self.attn_lif = _sj_lif()
        self.proj_conv = layer.Conv1d(dim, dim, 1, step_mode="m")
        self.proj_bn = layer.BatchNorm1d(dim, step_mode="m")

    def forward(self, x):
        q, k, v = (getattr(self, f"{r}_lif")(getattr(self, f"{r}_bn")(getattr(self, f"{r}_conv")(x))) for r in "qkv")
        t, n, c, length = q.shape  # c: this rank's channels (whole heads) under TP, read from q, not x
        q, k, v = (y.reshape(t, n, self.num_heads, c // self.num_heads, length) for y in (q, k, v))
        attn = (q.transpose(-2, -1) @ k) @ v.transpose(-2, -1) * 0.25  # [t, n, h, L, d]
        out = self.attn_lif(attn.transpose(-2, -1).reshape(t, n, c, length))
        return self.proj_bn(self.proj_conv(out))


class SpikeDrivenNet(nn.Module):
    """SpikeDrivenAttention with a residual add, then a Linear head on ``[T, N, C * L]``."""

    def __init__(self, dim: int = 8, length: int = 4):
        super().__init__()
        self.attn = SpikeDrivenAttention(dim)
        self.lif = _sj_lif()
        self.head = nn.Linear(dim * length, 6)

    def forward(self, x):
        return self.head(self.lif(x + self.attn(x)).flatten(2))


class SEWBlock(nn.Module):
    """SEW-ResNet block: conv -> BN -> LIF -> conv -> BN -> LIF, added to the input."""

    def __init__(self, channels: int, groups: int = 1):
        from spikingjelly.activation_based import layer

        super().__init__()
        self.conv1 = layer.Conv2d(channels, channels, 3, padding=1, bias=False, step_mode="m")
        self.bn1 = layer.BatchNorm2d(channels, step_mode="m")
        self.sn1 = _sj_lif()
        self.conv2 = layer.Conv2d(channels, channels, 3, padding=1, bias=False, groups=groups, step_mode="m")
        self.bn2 = layer.BatchNorm2d(channels, step_mode="m")
        self.sn2 = _sj_lif()

    def forward(self, x):
        return self.sn2(self.bn2(self.conv2(self.sn1(self.bn1(self.conv1(x)))))) + x


class SEWResNet(nn.Module):
    """A stem conv + two SEW blocks + a Linear head on ``[T, N, 2, 4, 4]`` frames."""

    def __init__(self, channels: int = 8, groups: int = 1):
        from spikingjelly.activation_based import layer

        super().__init__()
        self.stem = nn.Sequential(layer.Conv2d(2, channels, 3, padding=1, bias=False, step_mode="m"),
                                  layer.BatchNorm2d(channels, step_mode="m"), _sj_lif())
        self.blocks = nn.Sequential(SEWBlock(channels, groups), SEWBlock(channels, groups))
        self.head = nn.Linear(channels * 16, 6)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).flatten(2))


#: channels of CIFAR10DVSVGG's 8 blocks, shrunk from (64, 128, 256, 256, 512, 512, 512, 512); pooling before 3, 5, 7
SMALL_VGG_CHANNELS = (4, 4, 8, 8, 8, 8, 8, 8)


def small_reference_vgg(kaiming: bool = False) -> nn.Module:
    """spikingjelly 2.0.0's ``CIFAR10DVSVGG``, its own class and forward, with the package's own
    ``VGGBlock``s of a few channels each for 16x16 inputs (four 2x2 poolings leave 1x1), in float64;
    ``kaiming``: the convolutions re-initialised as the reference's training script does (more neurons fire)."""
    from spikingjelly.activation_based import functional, surrogate  # optional dependency: only these tests need it
    from spikingjelly.activation_based.examples.memopt.models import CIFAR10DVSVGG, VGGBlock

    torch.manual_seed(0)
    model = CIFAR10DVSVGG(dropout=0.0)
    kwargs = dict(tau=1.333, decay_input=False, detach_reset=True, surrogate_function=surrogate.ATan(),
                  step_mode="m")
    blocks, c_in = [], 2
    for i, c_out in enumerate(SMALL_VGG_CHANNELS):
        blocks.append(VGGBlock(c_in, c_out, 3, 1, 1, i in (2, 4, 6), **kwargs))
        c_in = c_out
    model.features = nn.Sequential(*blocks, type(model.features[-1])(2))
    model.classifier = nn.Sequential(nn.Linear(c_in, 10))
    for module in model.modules() if kaiming else ():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
    functional.set_step_mode(model, "m")
    return model.double()


def train_share(runtime, zoo, steps: int) -> dict:
    """``steps`` Adam steps of an applied zoo model on this rank's share of its batch (float64): outputs
    and losses per step, the last step's gradients, the final parameters, and each snntorch neuron's
    mean spike rate over the run."""
    plan = runtime.plan
    start = runtime.dp_rank * plan.per_rank_batch
    inputs = zoo.example_input.double()[:, start:start + plan.per_rank_batch]
    labels = zoo.labels[start:start + plan.per_rank_batch]
    rates = {}
    hooks = [m.register_forward_hook(lambda _m, _i, out, n=n: rates.setdefault(n, []).append(float(out.detach().mean())))
             for n, m in runtime.module.named_modules() if isinstance(m, snn.SpikingNeuron)]
    optimizer = runtime.build_optimizer(torch.optim.Adam, lr=1e-2)
    outs, losses, grads = [], [], None
    for step in range(steps):
        loss, out = runtime.forward_loss(nn.CrossEntropyLoss(), inputs, labels)
        optimizer.zero_grad()
        loss.backward()
        if step == steps - 1:
            grads = runtime.full_gradients()
        optimizer.step()
        outs.append(out.detach().clone())
        losses.append(loss.detach().clone())
    for hook in hooks:
        hook.remove()
    return dict(outs=outs, losses=losses, grads=grads, params=runtime.full_parameters(),
                rates={n: sum(v) / len(v) for n, v in rates.items()})


def adam_steps_recording_spikes(model, zoo, steps=3):
    """``steps`` Adam steps (lr 1e-2) of a time-major zoo model on its example batch in float64, neuron state
    reset each step: (losses, parameters after, every snntorch neuron call's mean spike rate)."""
    rates, losses = [], []
    hooks = [m.register_forward_hook(lambda _m, _i, out: rates.append(float(out.detach().mean())))
             for m in model.modules() if isinstance(m, snn.SpikingNeuron)]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        reset_all(model)
        loss = nn.functional.cross_entropy(model(zoo.example_input.double()).mean(0), zoo.labels)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    for h in hooks:
        h.remove()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, rates
