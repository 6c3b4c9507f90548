"""Built-in example spiking models (snntorch) with deterministic example inputs.

``build(name, size)`` returns a :class:`ZooModel`. Every model maps time-first input ``[T, N, ...]``
to ``[T, N, num_classes]`` (the head's per-step current). All but ``mlp_tutorial`` use stateful
``snntorch.Leaky(init_hidden=True)`` neurons that their ``forward`` never resets: call
:func:`reset_state` (or the runtime's reset) before each batch. ``mlp_tutorial`` is written as
snntorch's tutorials write models: ``init_hidden=False`` neurons whose membrane ``forward`` passes
explicitly and starts fresh on every call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import snntorch
import torch
from torch import nn

from ..core.common import positive_int
from ._neurons import ATanSurrogate, MultiStep, SeqWise, conv_bn_lif, lif
from .mlp import SpikingMLP
from .spikformer import Spikformer, SpikformerBlock, SpikingSelfAttention
from .tutorial import TutorialMLP
from .vgg import DVSVGG

__all__ = ["ZOO_NAMES", "SIZES", "ZooModel", "build", "reset_state", "SpikingMLP", "DVSVGG", "Spikformer",
           "SpikformerBlock", "SpikingSelfAttention", "TutorialMLP", "MultiStep", "SeqWise", "conv_bn_lif", "lif",
           "ATanSurrogate"]

ZOO_NAMES = ("mlp", "mlp_all_steps", "mlp_tutorial", "vgg", "spikformer")
SIZES = ("tiny", "small", "full")


@dataclass(frozen=True, eq=False)
class ZooModel:
    """A built model with a deterministic example batch ``example_input`` ``[T, N, ...]`` and ``labels`` ``[N]``."""

    name: str
    family: str
    model: nn.Module
    example_input: torch.Tensor
    time_steps: int
    num_classes: int
    batch_size: int
    labels: torch.Tensor
    size: str = "tiny"


def reset_state(model: nn.Module) -> None:
    """Zero the membrane of every snntorch spiking neuron in ``model``."""
    for m in model.modules():
        if isinstance(m, snntorch.SpikingNeuron):
            m.reset_mem()


# Per name and size: constructor kwargs, default T and N. Tiny sizes are tuned (init_gain,
# input rate) so every Leaky layer fires at 2%..98% on the example input.
_MLP = {
    "tiny": dict(kw=dict(in_features=64, hidden=(64, 64), num_classes=8, init_gain=2.0), T=8, N=8),
    "small": dict(kw=dict(in_features=784, hidden=(512, 512), num_classes=10, init_gain=2.0), T=25, N=128),
    "full": dict(kw=dict(in_features=2 * 34 * 34, hidden=(2048, 2048, 2048), num_classes=10, init_gain=2.0),
                 T=25, N=128),
}
_VGG = {
    "tiny": dict(kw=dict(channels=(8, 16, 16, 32), pools=(0, 1, 3), image_size=16, num_classes=8, hidden=32,
                         init_gain=2.0), T=4, N=4),
    "small": dict(kw=dict(channels=(64, 128, 256, 256), pools=(0, 1, 2, 3), image_size=48, num_classes=10,
                          hidden=512, init_gain=2.0), T=10, N=16),
    "full": dict(kw=dict(channels=(64, 128, 256, 256, 512, 512, 512, 512), pools=(0, 1, 3, 5, 7),
                         image_size=128, num_classes=10, hidden=1024, init_gain=2.0), T=10, N=16),
}
_SPIKFORMER = {
    "tiny": dict(kw=dict(image_size=16, patch_size=4, dim=32, depth=2, num_heads=4, num_classes=8,
                         attn_scale=0.5, init_gain=3.0), T=4, N=4),
    "small": dict(kw=dict(image_size=32, patch_size=4, dim=256, depth=2, num_heads=8, num_classes=10,
                          init_gain=3.0), T=4, N=32),
    "full": dict(kw=dict(image_size=32, patch_size=4, dim=384, depth=4, num_heads=8, num_classes=10,
                         init_gain=3.0), T=4, N=64),
}


def _rate_coded(g: torch.Generator, T: int, shape: tuple, max_rate: float) -> torch.Tensor:
    """Bernoulli spikes ``[T, *shape]`` with a fixed random rate in ``[0, max_rate)`` per element."""
    rates = torch.rand(shape, generator=g) * max_rate
    return torch.bernoulli(rates.expand(T, *shape).contiguous(), generator=g)


def _mlp_input(kw, T, N, g):
    return _rate_coded(g, T, (N, kw["in_features"]), 0.6)


def _vgg_input(kw, T, N, g):
    s = kw["image_size"]
    return _rate_coded(g, T, (N, kw.get("in_channels", 2), s, s), 0.4)


def _spikformer_input(kw, T, N, g):
    """A static normalised image, repeated over time (direct encoding)."""
    s = kw["image_size"]
    return torch.randn((N, kw.get("in_channels", 3), s, s), generator=g).expand(T, -1, -1, -1, -1).contiguous()


_REGISTRY: Dict[str, tuple] = {
    "mlp": ("mlp", lambda kw: SpikingMLP(**kw, stepping="per_step"), _MLP, _mlp_input),
    "mlp_all_steps": ("mlp", lambda kw: SpikingMLP(**kw, stepping="all_steps"), _MLP, _mlp_input),
    "mlp_tutorial": ("generic", lambda kw: TutorialMLP(kw["in_features"], kw["hidden"][0], kw["num_classes"],
                                                      init_gain=kw["init_gain"]), _MLP, _mlp_input),
    "vgg": ("cifar10dvs_vgg", lambda kw: DVSVGG(**kw), _VGG, _vgg_input),
    "spikformer": ("spikformer", lambda kw: Spikformer(**kw), _SPIKFORMER, _spikformer_input),
}


def build(name: str, size: str = "tiny", *, seed: int = 0, batch_size: Optional[int] = None,
          time_steps: Optional[int] = None) -> ZooModel:
    """Build zoo model ``name`` (one of :data:`ZOO_NAMES`) at ``size`` (one of :data:`SIZES`).

    Weights are initialised under ``torch.manual_seed(seed)`` without disturbing the global RNG;
    the example input and labels come from a ``torch.Generator`` seeded with ``seed``.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown zoo model name {name!r}; expected one of {ZOO_NAMES}")
    if size not in SIZES:
        raise ValueError(f"unknown zoo model size {size!r}; expected one of {SIZES}")
    family, make, table, make_input = _REGISTRY[name]
    cfg = table[size]
    kw = cfg["kw"]
    T = cfg["T"] if time_steps is None else time_steps
    N = cfg["N"] if batch_size is None else batch_size
    T, N = positive_int("time_steps", T), positive_int("batch_size", N)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make(kw)
    g = torch.Generator().manual_seed(seed)
    x = make_input(kw, T, N, g)
    labels = torch.randint(0, kw["num_classes"], (N,), generator=g, dtype=torch.int64)
    return ZooModel(name=name, family=family, model=model, example_input=x, time_steps=T,
                    num_classes=kw["num_classes"], batch_size=N, labels=labels, size=size)
