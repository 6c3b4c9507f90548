"""The one table of distribution modes: which mesh dims each uses and what it does with them.

Everything that asks "does this plan use FSDP / TP / DDP?" asks a :class:`Mode` (or the plan's
predicates built on it), never a mode name; a new mode is one more row of :data:`MODE_TABLE`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from .topology import SNNDistributedTopology


@dataclass(frozen=True)
class Mode:
    """One distribution mode.

    ``dims``: the named mesh dims it uses (every other dim must have size 1), ``optional_dims``
    those of them the topology may leave out. ``ddp``: replicate the model over ``dp`` with
    DistributedDataParallel; ``fsdp``: shard parameters, gradients and optimizer state over ``dp``
    with FSDP2; ``tp``: split layers over ``tp`` with DTensor TP; ``pp``: cut the model's sequence
    of modules into stages over ``pp`` (torch.distributed.pipelining), replicated over ``dp``, or with
    ``fsdp`` too FSDP2-sharded over ``dp`` (and, with ``tp`` too, each stage's layers split over ``tp``:
    a 3-D mesh pp x dp x tp, in that order, tp innermost).
    """

    name: str
    dims: Tuple[str, ...]
    ddp: bool = False
    fsdp: bool = False
    tp: bool = False
    pp: bool = False
    optional_dims: Tuple[str, ...] = ()
    summary: str = ""
    #: what the mode buys, as the plan's rationale says it ("<objective>: <mode> on <mesh> <benefit>")
    benefit: str = ""

    @property
    def distributed(self) -> bool:
        """Whether the mode needs a process group and a device mesh (``none`` runs one process)."""
        return bool(self.dims)

    @property
    def splits_batch(self) -> bool:
        """Whether the ranks of the ``dp`` dim see different samples."""
        return "dp" in self.dims

    @property
    def allows_zero(self) -> bool:
        """Whether ZeroRedundancyOptimizer applies (replicated parameters over ``dp``)."""
        return self.ddp

    def topology_problem(self, topology: SNNDistributedTopology) -> Optional[str]:
        """Why this mode cannot run on ``topology`` (None when it can)."""
        if not self.distributed:
            if topology.world_size != 1:
                return f"mode {self.name!r} runs one process but the topology has world_size={topology.world_size}"
            return None
        missing = [d for d in self.dims if d not in topology.dims and d not in self.optional_dims]
        if missing:
            return (f"mode {self.name!r} needs the dim(s) {missing} in the topology, which has "
                    f"{dict(topology.dims)}")
        later = _not_yet(self, topology)
        if later:
            return later
        idle = {n: s for n, s in topology.dims.items() if n not in self.dims and s > 1}
        if idle:
            return (f"mode {self.name!r} uses only the dim(s) {list(self.dims)}; the dim(s) {idle} would hold "
                    "unsynchronised replicas (give them size 1 or pick a mode that uses them)")
        return None


def _not_yet(mode: Mode, topology: SNNDistributedTopology) -> Optional[str]:
    """Why ``mode`` does not use a pp or tp dim of ``topology`` that has ranks, naming the mode that would."""
    sizes = topology.dims
    if mode.pp and sizes.get("tp", 1) > 1 and not mode.tp:
        instead = "'pp_fsdp2_tp' (stages FSDP2-sharded over dp" if mode.fsdp else "'pp_tp' (stages replicated over dp"
        return (f"mode {mode.name!r} does not split the stages' layers over tp={sizes['tp']}; use mode {instead}, "
                "each stage tensor-parallel over tp)")
    if not mode.pp and sizes.get("pp", 1) > 1 and mode.distributed:
        instead = ("'pp_fsdp2' (stages FSDP2-sharded over dp) or 'pp_fsdp2_tp' (also split over tp)" if mode.fsdp
                   else "'pp' (stages replicated over dp) or 'pp_tp' (stages also split over tp)")
        return (f"mode {mode.name!r} does not cut the model into pipeline stages; with pp={sizes['pp']} use mode "
                f"{instead}, or give pp size 1")
    return None


#: Every mode the unified API applies, in display order.
MODE_TABLE: Tuple[Mode, ...] = (
    Mode("none", (), summary="one process, the model unchanged",
         benefit="runs the model unchanged in one process: there is nothing to distribute"),
    Mode("dp", ("dp",), ddp=True, summary="DistributedDataParallel over dp (optionally ZeRO)",
         benefit="keeps a whole copy of the model on every rank and only all-reduces the gradients, "
                 "the least communication per sample"),
    Mode("tp", ("tp",), tp=True, summary="tensor parallelism over tp",
         benefit="splits each shardable layer and its neurons' state over the ranks, which all see the "
                 "same samples, at the cost of collectives inside every layer call"),
    Mode("fsdp2", ("dp",), fsdp=True, summary="FSDP2 over dp",
         benefit="shards parameters, gradients and optimizer state over the ranks and gathers one "
                 "unit's parameters at a time"),
    Mode("fsdp2_tp", ("dp", "tp"), fsdp=True, tp=True, summary="TP over tp, then FSDP2 over dp",
         benefit="splits layers and neuron state over tp and shards parameters, gradients and "
                 "optimizer state over dp"),
    Mode("pp", ("pp", "dp"), pp=True, optional_dims=("dp",),
         summary="pipeline stages over pp (torch.distributed.pipelining), replicated over dp",
         benefit="cuts the model's sequence of modules into stages, so each rank holds only its stages' "
                 "parameters and activations, at the cost of pipeline bubbles and point-to-point sends"),
    Mode("pp_tp", ("pp", "dp", "tp"), tp=True, pp=True, optional_dims=("dp",),
         summary="pipeline stages over pp, each stage's layers split over tp, replicated over dp "
                 "(mesh pp x dp x tp, tp innermost)",
         benefit="cuts the model into stages and splits each stage's layers and neuron state over tp, so a rank "
                 "holds 1/(pp*tp) of the parameters; tp's collectives stay among neighbouring ranks (inside a "
                 "node), pp's sends and dp's gradient all-reduce cross nodes"),
    Mode("pp_fsdp2", ("pp", "dp"), fsdp=True, pp=True,
         summary="pipeline stages over pp, each stage's parameters FSDP2-sharded over dp (mesh pp x dp)",
         benefit="cuts the model into stages and shards each stage's parameters, gradients and optimizer state over "
                 "dp, so a rank keeps 1/(pp*dp) of them between steps; each stage gathers its parameters once per "
                 "step and reduce-scatters its gradients once, after the last micro-batch"),
    Mode("pp_fsdp2_tp", ("pp", "dp", "tp"), fsdp=True, tp=True, pp=True,
         summary="pipeline stages over pp, each stage's layers split over tp, then FSDP2-sharded over dp "
                 "(mesh pp x dp x tp, tp innermost)",
         benefit="cuts the model into stages, splits each stage's layers and neuron state over tp (inside a node) and "
                 "shards the stage's parameters, gradients and optimizer state over dp, so a rank keeps "
                 "1/(pp*dp*tp) of them between steps; pp's sends and dp's gathers and reduce-scatters cross nodes"),
)
MODES_BY_NAME: Dict[str, Mode] = {m.name: m for m in MODE_TABLE}
#: Mode names, in display order.
MODES: Tuple[str, ...] = tuple(MODES_BY_NAME)
#: Names recognised only to be refused with a reason (not yet implemented).
REFUSED_MODES: Dict[str, str] = {}


def mode_of(name: Any) -> Mode:
    """The :class:`Mode` called ``name`` (exact); NotImplementedError for a refused name, else ValueError."""
    if isinstance(name, str) and name in REFUSED_MODES:
        raise NotImplementedError(REFUSED_MODES[name])
    try:
        return MODES_BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(f"unsupported mode={name!r}; expected one of {MODES}") from None


def names_where(predicate) -> Tuple[str, ...]:
    """Names of the modes for which ``predicate(mode)`` holds, e.g. ``names_where(lambda m: m.tp)``."""
    return tuple(m.name for m in MODE_TABLE if predicate(m))


def names_text(predicate, noun: bool = True) -> str:
    """``names_where(predicate)`` for a message: "mode 'dp'", "modes 'tp' and 'fsdp2_tp'"
    (without "mode(s) " when ``noun`` is False)."""
    names = [repr(n) for n in names_where(predicate)]
    text = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return (("mode " if len(names) == 1 else "modes ") if noun else "") + text
