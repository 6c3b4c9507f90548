"""Rule-based strategy recommendation from objective, world size and model family."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from .plans.families import VGG, resolve_family

#: Objectives the planner optimises for.
SNN_DISTRIBUTED_PREFERENCES = ("speed", "memory", "capacity")
#: Modes the unified API applies ("pp" is recognised only to be refused clearly).
MODES = ("none", "dp", "tp", "fsdp2", "fsdp2_tp")
BACKENDS = ("torch", "cupy", "triton", "inductor")


@dataclass(frozen=True)
class StrategyRecommendation:
    """The rule-based pick: mode, optimizer sharding, memopt level and why."""

    mode: str
    optimizer_sharding: str
    memopt_level: int
    rationale: Tuple[str, ...]


def check_objective(objective) -> str:
    if not isinstance(objective, str) or objective.lower() not in SNN_DISTRIBUTED_PREFERENCES:
        raise ValueError(f"unsupported objective={objective!r}; expected one of {SNN_DISTRIBUTED_PREFERENCES}")
    return objective.lower()


def check_backend(backend) -> str:
    if not isinstance(backend, str) or backend.lower() not in BACKENDS:
        raise ValueError(f"unsupported backend={backend!r} (the neuron compute backend); expected one of {BACKENDS}")
    return backend.lower()


def check_batch_size(batch_size) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive int (the global batch of one step)")
    return batch_size


def recommend_snn_distributed_strategy(model: str = "generic", *, world_size: int, prefer: str = "speed",
                                       batch_size: int = 1, backend: str = "torch",
                                       pipelining_available: bool = False) -> StrategyRecommendation:
    """Recommend a mode for ``world_size`` ranks and objective ``prefer``, ignoring topology.

    The planner then fits the pick to the topology the user gave (see ``plan``).
    """
    prefer = check_objective(prefer)
    check_batch_size(batch_size)
    check_backend(backend)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive int")
    family, _ = resolve_family(None, model)
    memopt = 0 if prefer == "speed" else 1
    if world_size == 1:
        return StrategyRecommendation("none", "none", memopt, ("one rank: nothing to distribute.",))
    hybrid = world_size >= 4 and world_size % 2 == 0
    if prefer == "speed":
        if family == VGG and hybrid:
            why = (f"speed on {world_size} ranks for the VGG family: fsdp2_tp splits the wide conv/"
                   "classifier weights over tp=2 and shards the rest over dp.",)
            return StrategyRecommendation("fsdp2_tp", "none", memopt, why)
        why = ("speed: data parallelism has the least communication per sample; ZeRO shards "
               "optimizer state at almost no extra cost.",)
        return StrategyRecommendation("dp", "zero", memopt, why)
    why = []
    if prefer == "capacity":
        why.append("capacity: pipeline parallelism is not available through this API"
                   if not pipelining_available else
                   "capacity: pipeline parallelism is available but configured outside this API")
        why.append("falling back to the memory decision.")
    if hybrid:
        why.append("memory: fsdp2_tp shards parameters, gradients and optimizer state over dp and "
                   "splits layers and neuron state over tp.")
        return StrategyRecommendation("fsdp2_tp", "none", 1, tuple(why))
    why.append("memory: tensor parallelism splits weights and neuron state of each sharded layer.")
    return StrategyRecommendation("tp", "none", 1, tuple(why))
