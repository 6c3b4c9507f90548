"""enumerate_plans(): every plan the core accepts for a world size, and why the others are left out."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

from ..core import DistributedFeatureSet, PlanOptions, SNNDistributedAnalysis, SNNDistributedPlan, plan
from ..core.common import MAX_WORLD_SIZE, MODE_TABLE, dp_tp_splits, positive_int
from ..core.levers import checkpointing_variants
from ..core.planning import neuron_backend_arg
from ..core.planning.recommend import UNSET


class PlanList(list):
    """The feasible plans (a list); ``infeasible`` maps each left-out candidate to the reason."""

    def __init__(self, plans, infeasible: Dict[str, str]):
        super().__init__(plans)
        self.infeasible = dict(infeasible)


def _candidates(world_size: int) -> List[Tuple[str, Dict[str, int], bool]]:
    """(mode, topology, ZeRO) for each mode x dp x tp split of ``world_size`` that uses exactly the
    mode's dims: data-parallel modes first, then TP modes, fewer dims first; then pipelines, each
    pp size >= 2 that divides the world, the rest of the ranks split as dp x tp (mode ``pp``: dp only;
    ``pp_tp``: tp >= 2, a 3-D mesh pp x dp x tp; ``pp_fsdp2`` and ``pp_fsdp2_tp`` likewise with dp >= 2)."""
    splits = dp_tp_splits(world_size)
    if world_size == 1:
        return [(m.name, splits[0], False) for m in MODE_TABLE if not m.distributed]
    out = []
    for mode in sorted((m for m in MODE_TABLE if m.distributed), key=lambda m: (m.pp, m.tp, len(m.dims))):
        for dims in (_pipelines(world_size, mode.tp, mode.fsdp) if mode.pp else [d for d in splits if set(d) == set(mode.dims)]):
            out += [(mode.name, dims, zero) for zero in ((False, True) if mode.allows_zero else (False,))]
    return out


def _pipelines(world_size: int, tp: bool, fsdp: bool = False) -> List[Dict[str, int]]:
    """Topologies of each pp >= 2 dividing ``world_size``, the other ranks as dp (``tp``: as dp x tp, tp >= 2;
    ``fsdp``: dp >= 2, the ranks FSDP2 shards each stage over)."""
    out = []
    for pp in (p for p in range(2, world_size + 1) if world_size % p == 0):
        for rest in dp_tp_splits(world_size // pp):
            if ("tp" in rest) == tp and (not fsdp or rest.get("dp", 1) > 1):
                out.append({"pp": pp, **{n: s for n, s in rest.items() if s > 1}})
    return out


def _label(mode: str, topology: Dict[str, int], zero: bool) -> str:
    return mode + ("+zero" if zero else "") + " " + " x ".join(f"{n}={s}" for n, s in topology.items())


def enumerate_plans(analysis: SNNDistributedAnalysis, *, world_size: int, batch_size: int,
                    neuron_backend: str = "torch", features: Optional[DistributedFeatureSet] = None,
                    objective: str = "speed", backend=UNSET, time_step_module: Optional[str] = None) -> PlanList:
    """Every feasible plan for ``world_size`` ranks: each mode x each dp x tp factorisation x ZeRO on/off,
    mode ``pp`` on each pp x dp factorisation and mode ``pp_tp`` on each pp x dp x tp one, modes ``pp_fsdp2`` and
    ``pp_fsdp2_tp`` on those with dp >= 2 (their schedule,
    micro-batches and stage layout as ``plan`` picks them).

    ``batch_size`` is the global batch of one optimizer step; the dp ranks of each plan split it
    (tensor-parallel peers see the same samples). ``objective`` sets the memopt level the core
    gives each plan. Plans come from ``core.plan`` with an explicit mode, so each one is a plan
    ``apply`` accepts; a candidate the core refuses is left out and ``result.infeasible[label]``
    says why (e.g. ``"tp=4 does not divide head.out_features=10 ..."``). ZeRO is tried only for
    ``dp`` and only when ``features`` allows it. ``backend`` is the deprecated name of ``neuron_backend``.
    With ``features.allow_activation_checkpointing`` each plan also comes with ``blocks`` checkpointing, and
    with ``time_chunks`` when ``time_step_module`` names the module the model steps once per time step.
    """
    neuron_backend = neuron_backend_arg(neuron_backend, backend)
    world_size = positive_int("world_size", world_size, maximum=MAX_WORLD_SIZE, what="the number of ranks")
    if not isinstance(analysis, SNNDistributedAnalysis):
        raise TypeError(f"analysis must come from analyze(), got {type(analysis).__name__}")
    features = features if features is not None else DistributedFeatureSet()
    plans: List[SNNDistributedPlan] = []
    infeasible: Dict[str, str] = {}
    for mode, topology, zero in _candidates(world_size):
        label = _label(mode, topology, zero)
        if zero and not features.allow_zero_optimizer:
            infeasible[label] = "ZeRO is disabled by DistributedFeatureSet(allow_zero_optimizer=False)"
            continue
        try:
            plans.append(plan(analysis=analysis, objective=objective, topology=topology,
                              neuron_backend=neuron_backend,
                              batch_size=batch_size, mode=mode,
                              features=dataclasses.replace(features, allow_zero_optimizer=zero), options=PlanOptions(activation_checkpointing="none")))
            plans.extend(checkpointing_variants(plans[-1], time_step_module))
        except (ValueError, NotImplementedError) as exc:
            infeasible[label] = str(exc)
    return PlanList(plans, infeasible)
