"""A CIFAR10-DVS style spiking VGG (family ``cifar10dvs_vgg``)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch
from torch import nn

from ._neurons import MultiStep, SeqWise, conv_bn_lif, lif, scale_linear_init


class DVSVGG(nn.Module):
    """VGG over DVS event frames ``[T, N, in_channels, H, W]`` -> ``[T, N, num_classes]``.

    ``features``: an ``nn.Sequential`` of ``conv_bn_lif`` blocks (3x3 ``Conv2d(bias=False) ->
    BatchNorm2d -> Leaky``), one per entry of ``channels``, with a 2x2 pool (``pool`` = "max" or
    "avg") after block ``i`` for each ``i`` in ``pools``. Conv/BN/pool run with time folded into the
    batch (:class:`SeqWise`), neurons step over time (:class:`MultiStep`).
    ``classifier``: ``Flatten -> Linear(., hidden) -> MultiStep(Leaky) -> Linear(hidden, num_classes)``;
    the output is the head's current per step (no output neuron).
    """

    def __init__(self, channels: Sequence[int] = (64, 128, 256, 256, 512, 512, 512, 512),
                 pools: Sequence[int] = (0, 1, 3, 5, 7), image_size: int = 48, num_classes: int = 10, *,
                 in_channels: int = 2, hidden: int = 512, pool: str = "max", beta: float = 0.9,
                 init_gain: float = 1.0):
        super().__init__()
        if pool not in ("max", "avg"):
            raise ValueError(f"pool={pool!r} is not one of ('max', 'avg')")
        bad = [p for p in pools if not 0 <= p < len(channels)]
        if bad:
            raise ValueError(f"pool positions {bad} are outside the {len(channels)} blocks")
        side = image_size // 2 ** len(set(pools))
        if side < 1 or side * 2 ** len(set(pools)) != image_size:
            raise ValueError(f"image_size={image_size} is not divisible by 2**{len(set(pools))} (one per pool)")
        pool_cls = nn.MaxPool2d if pool == "max" else nn.AvgPool2d
        blocks: list[nn.Module] = []
        c_in = in_channels
        for i, c in enumerate(channels):
            blocks.append(conv_bn_lif(c_in, c, beta))
            if i in pools:
                blocks.append(SeqWise(pool_cls(2)))
            c_in = c
        self.features = nn.Sequential(*blocks)
        self.classifier = nn.Sequential(OrderedDict(
            flatten=nn.Flatten(2),
            fc1=nn.Linear(c_in * side * side, hidden),
            lif=MultiStep(lif(beta)),
            fc2=nn.Linear(hidden, num_classes),
        ))
        scale_linear_init(self, init_gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))
