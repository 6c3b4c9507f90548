"""The predicted time of one training step of a plan: compute, exposed communication, bubble.

Compute is the roofline time of the work one rank does (:mod:`.compute_work`: forward, backward
and optimizer of the model the rank runs, at its per-rank batch and time steps; the optimizer's
work scaled to the parameter shard the rank updates), times the slow-down measured when that
many ranks share one host's cores (:func:`host_sharing`). Under FSDP2's CPU offload the optimizer step is the
host CPU's instead (:func:`~..memory.fsdp_offload.host_optimizer_seconds`). On the machine the hardware profile was
calibrated on, each phase is also multiplied by the measured / modelled ratio of the unsharded
step without levers (a lever's recompute and replays are modelled work that the ratio scales; spike
compression's packing is added unscaled, as the estimate's ``extra_s``). The parallel wrappers' own cost,
where the profile was calibrated with it (:func:`framework_s`), is compute too.

Each collective of the estimate (:mod:`.comms`) is timed by the profile's alpha-beta model for
its kind and group size (on CPU ranks sharing a host, that world's: :meth:`HardwareProfile.seen_by`).
On CPU ranks nothing overlaps (:attr:`HardwareProfile.overlaps_comm`). Elsewhere, what is exposed, per row:

- DDP's bucketed all-reduce runs beside the rest of the backward: ``max(one bucket, all - backward)``;
- FSDP2's forward all-gathers are prefetched: the first is exposed, the rest beyond the forward;
  its backward all-gathers and reduce-scatters overlap the backward but for the last reduce-scatter;
- tensor-parallel collectives and everything else (ZeRO's broadcasts) are on the critical path.

The groups of one mesh dim on a host communicate at the same time (every TP pair of a ``(2, 2)`` mesh at
once); on a profile without peer-to-peer they share the host path (:meth:`HardwareProfile.collective_time`).

So a step is never faster than its compute. A pipeline plan's step (``bubble_s`` included) is its
schedule replayed with each stage's own cost: :mod:`.pipeline_time`.
"""
from __future__ import annotations

import dataclasses
import socket
from typing import Callable, Dict, Optional, Tuple

import pandas as pd

from ...core import SNNDistributedPlan
from ...core.common import Checkpointing, Collective
from ...core.parallelize import region_starts
from ...core.tp import STYLES
from ..instruments.tables import TIME_COLUMNS
from ..profile.checkpointed import unlevered
from .checkpoint_probe import reference_step_s
from .compute_work import PHASES, Work, local_correction, rank_work
from .hardware import HardwareProfile
from .pipeline_time import pipeline_time_table
from .placement import group_size, host_sharing, ranks_on_host, spans_nodes


def exposed_comm_s(plan: SNNDistributedPlan, collectives: pd.DataFrame, hw: HardwareProfile,
                   phase_s: Dict[str, float], fsdp_s: Optional[float] = None) -> float:
    """Seconds of communication not hidden behind compute (rules in the module doc); ``fsdp_s``: FSDP2's exposed
    seconds where the caller walked its collectives unit by unit (:mod:`.fsdp_overlap`), in place of the rule."""
    timed: Dict[Tuple[str, str, str], Tuple[float, int]] = {}
    for row in collectives.itertuples(index=False):
        size = group_size(plan, row.mesh_dim, row.kind)
        seconds = hw.collective_time(row.kind, size, row.bytes, row.count, spans_nodes(plan, row.mesh_dim, hw, size),
                                     burst=plan.uses_zero and row.kind == Collective.BROADCAST,  # ZeRO's, back to back
                                     concurrent=concurrent_groups(plan, hw, size))
        timed[(row.mesh_dim, row.kind, row.phase)] = (seconds, row.count)
    if not hw.overlaps_comm:
        return sum(seconds for seconds, _ in timed.values())
    exposed = 0.0
    ar, ar_n = timed.pop(("dp", Collective.ALL_REDUCE, "backward"), (0.0, 0))
    if ar_n:  # DDP buckets
        exposed += max(ar / ar_n, ar - phase_s["backward"])
    fwd, fwd_n = timed.pop(("dp", Collective.ALL_GATHER, "forward"), (0.0, 0))
    bag, _ = timed.pop(("dp", Collective.ALL_GATHER, "backward"), (0.0, 0))
    rs, rs_n = timed.pop(("dp", Collective.REDUCE_SCATTER, "backward"), (0.0, 0))
    if fsdp_s is not None:  # the unit-by-unit walk replaces the rules for FSDP2's gathers and scatters
        return exposed + fsdp_s + sum(seconds for seconds, _ in timed.values())
    if fwd_n:  # FSDP2 prefetch: the first gather waits, the rest hide behind the forward
        exposed += fwd / fwd_n + max(0.0, fwd - fwd / fwd_n - phase_s["forward"])
    if rs_n or bag:
        exposed += max(rs / rs_n if rs_n else 0.0, bag + rs - phase_s["backward"])
    return exposed + sum(seconds for seconds, _ in timed.values())  # TP, ZeRO: critical path


def concurrent_groups(plan: SNNDistributedPlan, hw: HardwareProfile, size: int) -> int:
    """Groups of ``size`` ranks of one mesh dim on a host that communicate at once (each rank is in one), where
    that matters: on a profile without peer-to-peer, whose groups share the host path; else 1."""
    return max(1, ranks_on_host(plan, hw) // size) if hw.peer_to_peer is False else 1


def compute_phases(plan: SNNDistributedPlan, work: Work, hw: HardwareProfile, t: int, itemsize: int,
                   local_params_bytes: float, correction: Dict[str, float],
                   plain: Optional[Work] = None) -> Dict[str, float]:
    """Seconds of forward, backward and optimizer on one rank of ``plan`` (the optimizer over the
    ``local_params_bytes`` it updates). ``plain``: the same rank's work without checkpointing, given where the
    backward's extra work (``work``'s backward less ``plain``'s: the recompute, the replays, the state copies) is
    forward work, which the forward's correction then times (as the calibration's probe does:
    :mod:`..calibration.checkpoint_call`)."""
    n = plan.per_rank_batch
    share = local_params_bytes / work.param_bytes if work.param_bytes else 1.0
    slow = host_sharing(plan, hw)
    phases = {p: work.phase(p).seconds(hw, n, t, itemsize, share if p == "optimizer" else 1.0)
              * correction.get(p, 1.0) * slow for p in PHASES}
    if plain is not None:
        before = plain.backward.seconds(hw, n, t, itemsize)
        recompute = work.backward.seconds(hw, n, t, itemsize) - before
        phases["backward"] = (before * correction.get("backward", 1.0)
                              + recompute * correction.get("forward", 1.0)) * slow
    return phases


def checkpointed_calls(plan: SNNDistributedPlan, profile, t: int) -> int:
    """Checkpointed calls of one step of ``plan`` at ``t`` time steps: each call of a checkpointed block's first
    module (blocks, ops), or of the time-step module (time chunks: one region per step); 0 without checkpointing."""
    granularity = Checkpointing(plan.activation_checkpointing)
    if granularity == Checkpointing.TIME_CHUNKS:
        paths = [plan.time_step_module]
    elif granularity.recomputes:
        paths = [path for path, _ in region_starts(profile.model, plan, profile.fsdp_units)]
    else:
        return 0
    missing = [path for path in paths if path not in profile.modules]
    if missing:
        raise ValueError(f"checkpointed module(s) {missing} did not run in the profile's forward: their calls, "
                         "which the checkpointing cost is paid per, cannot be counted")
    return round(sum(profile.modules[path].calls(plan.per_rank_batch, t) for path in paths))


def checkpoint_overhead_s(plan: SNNDistributedPlan, profile, hw: HardwareProfile, t: int,
                          region_ops: float = 0.0) -> float:
    """The calibrated cost of the checkpointing machinery: per checkpointed call (:func:`checkpointed_calls`), the
    profile's ``checkpoint_overhead`` of the plan's granularity (ops: the blocks' figure), plus its
    ``checkpoint_overhead_per_op`` times ``region_ops``, the operators of one call's region; 0 where not measured."""
    granularity = Checkpointing(plan.activation_checkpointing)
    key = Checkpointing.TIME_CHUNKS if granularity == Checkpointing.TIME_CHUNKS else Checkpointing.BLOCKS
    if not granularity.recomputes:
        return 0.0
    per_op = hw.checkpoint_overhead_per_op.get(key.value, 0.0)
    per_call = hw.checkpoint_overhead.get(key.value, 0.0) + per_op * region_ops
    return checkpointed_calls(plan, profile, t) * per_call if per_call else 0.0


def time_step_ops(plain: Work, n: int, t: int) -> float:
    """Operators of one call of the module stepped once per time step, read from ``plain`` (the rank's work
    without checkpointing): its forward's operators per time step at ``n`` samples (``t`` steps less ``t - 1``).
    An approximation where the forward runs other operators per time step outside that module."""
    return max(0.0, plain.forward.ops(n, t) - plain.forward.ops(n, t - 1))


def framework_s(plan: SNNDistributedPlan, profile, collectives: pd.DataFrame, hw: HardwareProfile, t: int,
                region_ops: float = 0.0) -> float:
    """The calibrated cost of the parallel wrappers themselves (DTensor dispatch of each call of a
    module a TP style wraps, not of neurons left to run on their local shard; FSDP2's work around
    each of its collectives, DDP's and ZeRO's work around a step) and of activation checkpointing's
    machinery (:func:`checkpoint_overhead_s`, ``region_ops`` operators per checkpointed call; timed in one process,
    so slowed as compute is where the plan's ranks share a host's cores: :func:`host_sharing`); 0 on profiles
    without them."""
    seconds = checkpoint_overhead_s(plan, profile, hw, t, region_ops) * host_sharing(plan, hw)
    if plan.dp_size > 1:
        seconds += hw.overhead("ddp_step", plan.dp_size) * plan.uses_ddp + \
            hw.overhead("zero_step", plan.dp_size) * plan.uses_zero
    if plan.uses_tp:
        calls = sum(profile.modules[path].calls(plan.per_rank_batch, t)
                    for path, style in plan.tensor_parallel_plan.items()
                    if path in profile.modules and STYLES[style].wraps_calls)
        seconds += calls * hw.overhead("tp_module", plan.tp_size)
    if plan.uses_fsdp:
        fsdp = collectives[(collectives["mesh_dim"] == "dp") & collectives["kind"].isin((Collective.ALL_GATHER, Collective.REDUCE_SCATTER))]
        seconds += int(fsdp["count"].sum()) * hw.overhead("fsdp_collective", plan.dp_size)
    return seconds


def time_table(plan: SNNDistributedPlan, collectives: pd.DataFrame, hw: HardwareProfile,
               phase_s: Dict[str, float], fsdp_s: Optional[float] = None) -> pd.DataFrame:
    """The ``rank, compute_s, exposed_comm_s, bubble_s, step_s`` table of a plan without pipelining
    (every rank alike, none idles); ``fsdp_s``: as :func:`exposed_comm_s` takes it."""
    compute = sum(phase_s.values())
    comm = exposed_comm_s(plan, collectives, hw, phase_s, fsdp_s)
    row = dict(compute_s=compute, exposed_comm_s=comm, bubble_s=0.0, step_s=compute + comm)
    table = pd.DataFrame([row] * plan.world_size)
    table.insert(0, "rank", range(plan.world_size))
    return table[list(TIME_COLUMNS)]


def at_host_speed(hw: HardwareProfile, plain) -> HardwareProfile:
    """``hw`` with its checkpointing costs scaled to the host's speed of the moment: by the reference probe step
    timed now (once per ``plain``, the profile the timing correction is also timed for) over its seconds when they
    were calibrated (``checkpoint_reference_s``; :mod:`.checkpoint_probe`)."""
    cache = plain.__dict__.setdefault("_reference_step_now_s", {})
    if hw.checkpoint_reference_s not in cache:
        cache[hw.checkpoint_reference_s] = reference_step_s()
    speed = cache[hw.checkpoint_reference_s] / hw.checkpoint_reference_s
    return dataclasses.replace(
        hw, checkpoint_overhead={k: v * speed for k, v in hw.checkpoint_overhead.items()},
        checkpoint_overhead_per_op={k: v * speed for k, v in hw.checkpoint_overhead_per_op.items()})


def is_local(hw: HardwareProfile) -> bool:
    """Whether ``hw`` was calibrated on this host's CPU (where the measured step corrects the model)."""
    return hw.device == "cpu" and hw.host is not None and hw.host == socket.gethostname()


def plan_time(plan: SNNDistributedPlan, profile, collectives: pd.DataFrame, per_rank: pd.DataFrame,
              hw: HardwareProfile, t: int, optimizer: str,
              host_optimizer_s: Optional[Callable[[float], float]] = None) -> pd.DataFrame:
    """The time table of ``plan`` (see the module doc) from the estimate's other tables; ``host_optimizer_s(ops)``:
    the optimizer step's seconds on the host CPU given its operator count, in place of the device's (FSDP2's CPU
    offload, :mod:`..memory.fsdp_offload`)."""
    hw = hw.in_precision(plan.precision)  # a calibration's own bf16 / fp16 rates for a half-precision plan
    work = rank_work(profile, plan.tensor_parallel_plan, plan.tp_size, optimizer)
    itemsize = profile.compute_itemsize  # the precision's compute dtype: half-precision FLOP rates under bf16
    correction = {}
    if is_local(hw) and not profile.shape_only:  # a shape-only profile has no real step to time
        # measured / modelled of the step without levers, which times the model itself: a lever's own work
        # (recompute, replays) stays in the modelled phases it scales
        plain = unlevered(profile)
        correction = local_correction(plain, rank_work(plain, None, 1, optimizer), hw, optimizer)
        if hw.checkpoint_reference_s and Checkpointing(plan.activation_checkpointing).recomputes:
            hw = at_host_speed(hw, plain)
    hw = hw.seen_by(ranks_on_host(plan, hw))
    if plan.uses_pp:
        whole = rank_work(profile, None, 1, optimizer)
        optimizer_s = lambda params_bytes: whole.optimizer.seconds(hw, plan.per_rank_batch, t, itemsize,
                                                                    params_bytes / max(whole.param_bytes, 1))
        return pipeline_time_table(plan, profile, collectives, per_rank, hw, t, itemsize, correction,
                                   ranks_on_host(plan, hw), optimizer_s)
    local = float(per_rank["params_bytes"].iloc[0]) / (plan.dp_size if plan.uses_zero else 1)
    plain_work, region_ops = None, 0.0
    costed = correction or hw.checkpoint_overhead_per_op  # else (a datasheet profile) neither figure is used
    if plan.activation_checkpointing == Checkpointing.TIME_CHUNKS and costed:  # the region: a time-step module call
        plain_work = rank_work(unlevered(profile), plan.tensor_parallel_plan, plan.tp_size, optimizer)
        region_ops = time_step_ops(plain_work, plan.per_rank_batch, t)
    phases = compute_phases(plan, work, hw, t, itemsize, local, correction, plain_work if correction else None)
    if host_optimizer_s is not None:
        phases["optimizer"] = host_optimizer_s(work.optimizer.ops(plan.per_rank_batch, t))
    phases["framework"] = framework_s(plan, profile, collectives, hw, t, region_ops)
    return time_table(plan, collectives, hw, phases)


def fastest_first(estimates, memory_budget=None) -> list:
    """``estimates`` by predicted step time, those whose peak fits ``memory_budget`` (bytes) first."""
    fits = lambda e: memory_budget is None or e.peak_bytes <= memory_budget
    return sorted(estimates, key=lambda e: (not fits(e), e.step_time_s))
