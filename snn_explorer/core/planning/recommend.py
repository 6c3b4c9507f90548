"""Rule-based strategy recommendation from objective, world size and model family."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from ..common.validate import UNSET, positive_int, renamed_keyword
from ..common.vocabulary import NeuronBackend
from ..model.families import VGG, resolve_family
from .pipeline_plan import recommend_pipeline
from .pipeline_schedules import default_schedule

#: Objectives the planner optimises for.
SNN_DISTRIBUTED_PREFERENCES = ("speed", "memory", "capacity")
#: Neuron compute backends (spikingjelly's kernels, or torch.compile); not the communication backend.
NEURON_BACKENDS = NeuronBackend.names()


@dataclass(frozen=True)
class StrategyRecommendation:
    """The rule-based pick: mode, optimizer sharding, memopt level and why; ``mesh_shape`` of the
    mode's dims on ``world_size`` ranks and, for ``pp``, the schedule, micro-batches and virtual stages."""

    mode: str
    optimizer_sharding: str
    memopt_level: int
    rationale: Tuple[str, ...]
    mesh_shape: Tuple[int, ...] = ()
    pp_schedule: Optional[str] = None
    pp_microbatches: Optional[int] = None
    pp_virtual_stages: int = 1


def check_objective(objective) -> str:
    if not isinstance(objective, str) or objective.lower() not in SNN_DISTRIBUTED_PREFERENCES:
        raise ValueError(f"unsupported objective={objective!r}; expected one of {SNN_DISTRIBUTED_PREFERENCES}")
    return objective.lower()


def check_backend(backend) -> NeuronBackend:
    """The neuron compute backend (:class:`~.vocabulary.NeuronBackend`; a name in any case)."""
    return NeuronBackend.check(backend, "neuron_backend", "the neuron compute backend")


def neuron_backend_arg(neuron_backend: Any, backend: Any = UNSET) -> Any:
    """``neuron_backend``, or the value of the deprecated ``backend`` keyword (with a DeprecationWarning)."""
    return renamed_keyword("neuron_backend", neuron_backend, "torch", "backend", backend,
                           what="the neuron compute backend")


def check_batch_size(batch_size) -> int:
    return positive_int("batch_size", batch_size, what="the global batch of one step")


def recommend_snn_distributed_strategy(model: str = "generic", *, world_size: int, prefer: str = "speed",
                                       batch_size: int = 1, backend: Any = UNSET,
                                       pipelining_available: bool = False,
                                       neuron_backend: str = "torch") -> StrategyRecommendation:
    """Recommend a mode for ``world_size`` ranks and objective ``prefer``, ignoring topology.

    The planner then fits the pick to the topology the user gave (see ``plan``).
    ``backend`` is the deprecated name of ``neuron_backend``. With ``pipelining_available``,
    ``capacity`` picks mode ``pp`` over all ranks when the batch allows it (see
    :func:`~snn_explorer.core.planning.pipeline_plan.recommend_pipeline`), else the memory decision.
    """
    prefer = check_objective(prefer)
    check_batch_size(batch_size)
    check_backend(neuron_backend_arg(neuron_backend, backend))
    positive_int("world_size", world_size)
    family, _ = resolve_family(None, model)
    memopt = 0 if prefer == "speed" else 1
    if world_size == 1:
        return StrategyRecommendation("none", "none", memopt, ("one rank: nothing to distribute.",), (1,))
    hybrid = world_size >= 4 and world_size % 2 == 0
    if prefer == "speed":
        if family == VGG and hybrid:
            why = (f"speed on {world_size} ranks for the VGG family: fsdp2_tp splits the wide conv/"
                   "classifier weights over tp=2 and shards the rest over dp.",)
            return StrategyRecommendation("fsdp2_tp", "none", memopt, why, (world_size // 2, 2))
        why = ("speed: data parallelism has the least communication per sample; ZeRO shards "
               "optimizer state at almost no extra cost.",)
        return StrategyRecommendation("dp", "zero", memopt, why, (world_size,))
    why = []
    if prefer == "capacity":
        pipeline = recommend_pipeline(batch_size, world_size) if pipelining_available else None
        if pipeline is not None:
            virtual, micro = pipeline
            why.append(f"capacity: pipeline parallelism over {world_size} ranks holds 1/{world_size} of the model "
                       f"per rank; batch {batch_size} gives {virtual} stage(s) per rank and {micro} micro-batches.")
            return StrategyRecommendation("pp", "none", 1, tuple(why), (world_size,), default_schedule(virtual),
                                          micro, virtual)
        why.append("capacity: pipeline parallelism is not available here (no pp dim)" if not pipelining_available
                   else f"capacity: batch {batch_size} fits no pipeline of {world_size} stages (it needs at least "
                        f"{world_size} samples and a micro-batch count between stages x V and 4 x stages x V "
                        "that divides it)")
        why.append("falling back to the memory decision.")
    if hybrid:
        why.append("memory: fsdp2_tp shards parameters, gradients and optimizer state over dp and "
                   "splits layers and neuron state over tp.")
        return StrategyRecommendation("fsdp2_tp", "none", 1, tuple(why), (world_size // 2, 2))
    why.append("memory: tensor parallelism splits weights and neuron state of each sharded layer.")
    return StrategyRecommendation("tp", "none", 1, tuple(why), (world_size,))
