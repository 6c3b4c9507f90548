"""The tiny spiking MLPs the checkpointing machinery's cost is timed on, and the reference step that puts a
calibrated cost into the host's speed of the moment.

The costs (:mod:`..calibration.checkpoint_call`) are Python work on the host CPU, in seconds as fast as the host ran
when it was calibrated. On cores shared with other work that speed changes (two calibrations minutes apart, about twice as slow in
every figure: benchmarks/results/calibration.md), while the estimate's timing correction is measured
when the estimate is made. :func:`reference_step_s` times the plain probe step (one hidden layer) now, and the
estimate scales the costs by it over the same step's seconds at calibration (``checkpoint_reference_s``).
"""
from __future__ import annotations

import time
from typing import Sequence, Tuple

import torch
from torch import nn

from ...zoo.mlp import SpikingMLP
from ..instruments.isolation import one_thread
from ..profile.step import forward_loss

__all__ = ["WIDTH", "STEPS", "BATCH", "REFERENCE_LAYERS", "probe_model", "probe_batch", "one_step", "least_steps", "reference_step_s"]

#: The probes: width, time steps, batch (tiny regions: the calls' own cost dominates)
WIDTH, STEPS, BATCH = 8, 8, 2
#: Hidden layers of the reference step
REFERENCE_LAYERS = 1


def probe_model(layers: int) -> nn.Module:
    """A spiking MLP of ``layers`` hidden layers, :data:`WIDTH` wide, its weights seeded."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return SpikingMLP(WIDTH, (WIDTH,) * layers, 2, init_gain=3.0)


def probe_batch() -> Tuple[torch.Tensor, torch.Tensor]:
    """The probes' input spikes ``[STEPS, BATCH, WIDTH]`` and labels, seeded."""
    generator = torch.Generator().manual_seed(0)
    x = torch.bernoulli(torch.full((STEPS, BATCH, WIDTH), 0.5), generator=generator)
    return x, torch.randint(0, 2, (BATCH,), generator=generator)


def one_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Tuple[float, float]:
    """Seconds of one forward and of its backward of ``model``."""
    started = time.perf_counter()
    loss = forward_loss(model, x, y)
    mid = time.perf_counter()
    loss.backward()
    elapsed = (mid - started, time.perf_counter() - mid)
    model.zero_grad(set_to_none=True)
    return elapsed


def least_steps(models: Sequence[nn.Module], x: torch.Tensor, y: torch.Tensor,
                repeats: int) -> list:
    """The least (forward, backward) seconds of ``repeats`` steps of each of ``models``, run in turn (load that comes
    and goes falls on every model alike), after one warm-up step each."""
    for model in models:
        one_step(model, x, y)
    best = [(float("inf"), float("inf"))] * len(models)
    for _ in range(repeats):
        best = [tuple(map(min, b, one_step(model, x, y))) for b, model in zip(best, models)]
    return best


def reference_step_s(repeats: int = 20) -> float:
    """The least seconds of ``repeats`` forward and backward steps of the plain reference probe, one thread."""
    x, y = probe_batch()
    with one_thread():
        return sum(least_steps([probe_model(REFERENCE_LAYERS)], x, y, repeats)[0])
