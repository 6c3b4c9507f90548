"""This host's cost of one checkpointed call: the ``checkpoint_overhead`` of a :class:`~..timing.hardware.HardwareProfile`.

A checkpointed region costs more than the operators it runs and recomputes: torch's checkpoint frame and its
saved-tensor hooks, the copy of the region's neuron state taken at entry and put back around the recompute, and for
time chunks the RNG state and gradient flags kept per step. Most of it is Python work on the host CPU, which the
estimate's operator counts do not see. :func:`this_host_checkpoint_overhead` times a tiny spiking MLP (one hidden
Linear and its neuron, 8 wide, 8 time steps, batch 2) forward and backward here on one thread, plain and
checkpointed (every block, and time chunks of one step), and returns per granularity::

    (checkpointed - plain - (operators checkpointed - operators plain) * plain / operators plain) / checkpointed calls

the least of ``repeats`` steps each (the models run in turn), never below 0: the seconds one checkpointed call adds beyond the operators the
estimate already counts for it (its recompute and state copies), those at the plain step's own seconds per operator
(as the estimate's timing correction on this host charges them). An approximation: per call, whatever the region
holds (on this machine the probe gave 0.36 and 0.50 ms per block call with one and two neurons in the region, 1.34
and 1.26 ms per time-chunk call). Time chunks of one step copy a chunk's entry state at every call; longer chunks
copy less (operators the estimate counts): the per-call figure is the k = 1 one for every chunk size.
"""
from __future__ import annotations

import time
from typing import Dict, List, Sequence

import torch
from torch import nn

from ...core.neurons import detached_copy
from ...core.parallelize.checkpointing import checkpoint_blocks, checkpoint_time_chunks
from ...core.validate import positive_int
from ...core.vocabulary import Checkpointing
from ...zoo.mlp import SpikingMLP
from ..instruments.isolation import one_thread
from ..profile.step import forward_loss
from ..timing.compute_work import count_step

__all__ = ["this_host_checkpoint_overhead"]

#: The probe: hidden layers, their width, time steps, batch (a tiny region: the call's own cost dominates)
LAYERS, WIDTH, STEPS, BATCH = 1, 8, 8, 2


def _one_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Seconds of one forward and backward of ``model``."""
    started = time.perf_counter()
    forward_loss(model, x, y).backward()
    elapsed = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    return elapsed


def _least_steps(models: Sequence[nn.Module], x: torch.Tensor, y: torch.Tensor, repeats: int) -> List[float]:
    """The least seconds of ``repeats`` steps of each of ``models``, run in turn (load that comes and goes falls on
    every model alike), after one warm-up step each."""
    for model in models:
        _one_step(model, x, y)
    best = [float("inf")] * len(models)
    for _ in range(repeats):
        best = [min(b, _one_step(model, x, y)) for b, model in zip(best, models)]
    return best


def _ops(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    forward, backward = count_step(model, x, y)
    model.zero_grad(set_to_none=True)
    return float(forward[3] + backward[3])


def this_host_checkpoint_overhead(repeats: int = 40) -> Dict[str, float]:
    """Seconds per checkpointed call beyond its counted operators, per granularity (``"blocks"``, ``"time_chunks"``),
    on this host's CPU, one thread (see the module doc)."""
    repeats = positive_int("repeats", repeats)
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    plain = SpikingMLP(WIDTH, (WIDTH,) * LAYERS, 2, init_gain=3.0)
    x = torch.bernoulli(torch.full((STEPS, BATCH, WIDTH), 0.5), generator=generator)
    y = torch.randint(0, 2, (BATCH,), generator=generator)
    linears = [f"net.{name}" for name, m in plain.net.named_children() if isinstance(m, nn.Linear)]
    variants: Dict[str, tuple] = {  # granularity -> (how to checkpoint a copy, checkpointed calls per step)
        Checkpointing.BLOCKS.value: (lambda m: checkpoint_blocks(m, linears), len(linears) * STEPS),
        Checkpointing.TIME_CHUNKS.value: (lambda m: checkpoint_time_chunks(m, "net", 1), STEPS),
    }
    models = [plain]
    for apply, _ in variants.values():
        models.append(detached_copy(plain))
        apply(models[-1])
    with one_thread():  # the collector runs as in training: torch's checkpoint frames leave cycles to collect
        seconds = _least_steps(models, x, y, repeats)
        ops = [_ops(model, x, y) for model in models]
    per_op = seconds[0] / ops[0]  # the plain step's seconds per operator: what the estimate's correction charges
    return {name: max(0.0, (s - seconds[0] - (o - ops[0]) * per_op) / calls)
            for (name, (_, calls)), s, o in zip(variants.items(), seconds[1:], ops[1:])}
