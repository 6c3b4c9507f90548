"""This host's cost of checkpointed calls: ``checkpoint_overhead`` and ``checkpoint_overhead_per_op`` of a
:class:`~..timing.hardware.HardwareProfile`.

A checkpointed region costs more than the operators it runs and recomputes: torch's checkpoint frame and its
saved-tensor hooks, the copy of the region's neuron state taken at entry and put back around the recompute, and for
time chunks the RNG state and gradient flags kept per step. Most of it is Python work on the host CPU, which the
estimate's operator counts do not see. :func:`this_host_checkpoint_overhead` times tiny spiking MLPs (hidden Linear
layers and their neurons, 8 wide, 8 time steps, batch 2: :mod:`..timing.checkpoint_probe`) forward and backward here on one thread, plain and
checkpointed, the least of ``repeats`` steps each (the models run in turn), and returns per granularity:

- ``"blocks"`` (one hidden layer, every block checkpointed): per call,
  ``(checkpointed - plain - (operators checkpointed - operators plain) * plain / operators plain) / calls``, the
  extra operators at the plain step's mean seconds per operator; no per-operator figure.
- ``"time_chunks"`` (chunks of one step): the recompute and the state copies are forward work, so the estimate
  charges them at the forward's own rate (:func:`~..timing.step_time.compute_phases`), and so does the probe:
  ``excess = (checkpointed - plain - extra operators * plain forward / forward operators) / calls``. The excess
  grows with what the region holds (a pack per saved tensor in the forward, an unpack and a recompute pack in the
  backward; the figures per hidden-layer count are in benchmarks/results/calibration.md).
  It is timed with :data:`CHUNK_LAYERS` hidden layers and taken as ``per_call + per_op * region operators`` through
  the two, the region's operators counted per call as the estimate counts them (:func:`region_ops`). ``per_op`` is
  the ``checkpoint_overhead_per_op``.

``reference_s`` is the plain one-layer probe's step in the same run (``checkpoint_reference_s``): on the host it was
calibrated on, the estimate scales these costs by the same step timed when it estimates
(:mod:`..timing.checkpoint_probe`).

Each figure is never below 0. An approximation: Python work does not scale exactly with operators; time chunks of one
step copy a chunk's entry state at every call, longer chunks copy less (operators the estimate counts), so the
figures of chunks of one step are used for every chunk size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn

from ...core.common import Checkpointing, positive_int
from ...core.model import detached_copy
from ...core.parallelize import checkpoint_blocks, checkpoint_time_chunks
from ..instruments.isolation import one_thread
from ..timing.checkpoint_probe import REFERENCE_LAYERS, STEPS, least_steps, probe_batch, probe_model
from ..timing.compute_work import count_step, counted_pass

__all__ = ["CHUNK_LAYERS", "CheckpointCost", "region_ops", "this_host_checkpoint_overhead"]

#: Hidden layers of the two time-chunk probes the per-operator cost is read between (the block probe: the reference)
CHUNK_LAYERS = (REFERENCE_LAYERS, 5)


@dataclass(frozen=True)
class CheckpointCost:
    """Seconds per checkpointed call (``per_call``) and per operator of a call's region (``per_op``), by
    granularity name, and the seconds of the reference step (:func:`~..timing.checkpoint_probe.reference_step_s`'s
    probe) as fast as the host ran then (``reference_s``)."""

    per_call: Dict[str, float]
    per_op: Dict[str, float]
    reference_s: Optional[float]


def _ops(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Tuple[float, float]:
    """(forward, backward) operators of one step of ``model``."""
    forward, backward = count_step(model, x, y)
    model.zero_grad(set_to_none=True)
    return float(forward[3]), float(backward[3])


def region_ops(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Operators per call of the module ``model`` steps once per time step, as the estimate reads them: the plain
    forward's operators per time step (at ``x``'s time steps less those at one step fewer)."""
    counts = [counted_pass(model, steps, y)[0][3] for steps in (x, x[:-1])]  # each after a forward at its size
    model.zero_grad(set_to_none=True)
    return float(counts[0] - counts[1])


def _checkpointed(plain: nn.Module, apply: Callable[[nn.Module], object]) -> nn.Module:
    model = detached_copy(plain)
    apply(model)
    return model


def this_host_checkpoint_overhead(repeats: int = 40) -> CheckpointCost:
    """Seconds per checkpointed call beyond its counted operators, per granularity (``"blocks"``, ``"time_chunks"``),
    and per operator of a call's region (``"time_chunks"``), on this host's CPU, one thread (see the module doc)."""
    repeats = positive_int("repeats", repeats)
    x, y = probe_batch()
    chunk_plain = [probe_model(layers) for layers in CHUNK_LAYERS]
    reference = chunk_plain[0]  # the reference step's probe, also the block probe's
    linears = [f"net.{name}" for name, m in reference.net.named_children() if isinstance(m, nn.Linear)]
    chunked = [_checkpointed(plain, lambda m: checkpoint_time_chunks(m, "net", 1)) for plain in chunk_plain]
    # plain reference, its blocks checkpointed, its chunks of one step, the larger probe plain and in chunks
    models = [reference, _checkpointed(reference, lambda m: checkpoint_blocks(m, linears)), chunked[0],
              chunk_plain[1], chunked[1]]
    with one_thread():  # the collector runs as in training: torch's checkpoint frames leave cycles to collect
        seconds = least_steps(models, x, y, repeats)
        ops = [_ops(model, x, y) for model in models]
        regions = [region_ops(plain, x, y) for plain in chunk_plain]
    plain_s_per_op = sum(seconds[0]) / sum(ops[0])  # the plain step's mean seconds per operator
    blocks = (sum(seconds[1]) - sum(seconds[0]) - (sum(ops[1]) - sum(ops[0])) * plain_s_per_op) / (len(linears) * STEPS)
    excess = []
    for plain, chunks in ((0, 2), (3, 4)):  # each time-chunk probe: plain, chunks of one step
        forward_rate = seconds[plain][0] / ops[plain][0]
        extra = sum(ops[chunks]) - sum(ops[plain])
        excess.append((sum(seconds[chunks]) - sum(seconds[plain]) - extra * forward_rate) / STEPS)
    chunk_per_op = max(0.0, (excess[1] - excess[0]) / (regions[1] - regions[0]))
    chunk_per_call = max(0.0, excess[0] - chunk_per_op * regions[0])
    return CheckpointCost(per_call={Checkpointing.BLOCKS.value: max(0.0, blocks),
                                    Checkpointing.TIME_CHUNKS.value: chunk_per_call},
                          per_op={Checkpointing.TIME_CHUNKS.value: chunk_per_op}, reference_s=sum(seconds[0]))
