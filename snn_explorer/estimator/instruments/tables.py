"""The shape of the tables an estimate and a measurement share: their columns and phase texts.

Both sides build the same three tables (per rank memory, collectives per step, step time) and
label collectives by the same phases, so the names live here, below both.
"""
from __future__ import annotations

from typing import Sequence, Tuple

PER_RANK_COLUMNS = ("rank", "params_bytes", "grads_bytes", "optimizer_bytes", "buffers_bytes", "activations_bytes",
                    "neuron_state_bytes", "transient_bytes", "peak_bytes")
COLLECTIVE_COLUMNS = ("mesh_dim", "kind", "phase", "count", "bytes")
TIME_COLUMNS = ("rank", "compute_s", "exposed_comm_s", "bubble_s", "step_s")


def boundary_phase(direction: str, src: int, dst: int) -> str:
    """The ``phase`` of a pipeline transfer from stage ``src`` to ``dst`` (as the recorder labels it)."""
    return f"{direction} {src}->{dst}"


def reduce_phase(stages: Sequence[int]) -> str:
    """The ``phase`` of a pp rank's dp all-reduce of the gradients of its ``stages``."""
    return f"after backward (stages {','.join(map(str, stages))})"


def gather_phase(stages: Sequence[int]) -> str:
    """The ``phase`` of a pp rank's FSDP2 all-gathers of its ``stages``' parameters (modes ``pp_fsdp2``,
    ``pp_fsdp2_tp``; once per step)."""
    return f"gathers (stages {','.join(map(str, stages))})"


def tp_phase(stages: Sequence[int]) -> str:
    """The ``phase`` of a pp rank's tensor-parallel collectives inside its ``stages`` (mode ``pp_tp``)."""
    return f"inside stages {','.join(map(str, stages))}"


def boundary_stages(phase: str) -> Tuple[int, int]:
    """``(src, dst)`` stages of a :func:`boundary_phase`."""
    src, dst = phase.split(" ", 1)[1].split("->")
    return int(src), int(dst)
