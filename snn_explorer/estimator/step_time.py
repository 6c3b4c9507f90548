"""The predicted time of one training step of a plan: compute, exposed communication, bubble.

Compute is the roofline time of the work one rank does (:mod:`.compute_work`: forward, backward
and optimizer of the model the rank runs, at its per-rank batch and time steps; the optimizer's
work scaled to the parameter shard the rank updates), times the slow-down measured when that
many ranks share one host's cores (:func:`host_sharing`: for a pipeline, as many as are busy at
once on average). On the machine the hardware profile was calibrated on, each
phase is also multiplied by the measured / modelled ratio of the unsharded step. The parallel
wrappers' own cost, where the profile was calibrated with it (:func:`framework_s`), is compute too.

Each collective of the estimate (:mod:`.comms`) is timed by the profile's alpha-beta model for
its kind and group size (on CPU ranks sharing a host, that world's: :meth:`HardwareProfile.seen_by`).
On CPU ranks nothing overlaps (:attr:`HardwareProfile.overlaps_comm`). Elsewhere, what is exposed, per row:

- DDP's bucketed all-reduce runs beside the rest of the backward: ``max(one bucket, all - backward)``;
- FSDP2's forward all-gathers are prefetched: the first is exposed, the rest beyond the forward;
  its backward all-gathers and reduce-scatters overlap the backward but for the last reduce-scatter;
- tensor-parallel collectives and everything else (ZeRO's broadcasts) are on the critical path;
  of a pipeline's transfers, those its busiest rank sends or receives.

So a step is never faster than its compute. ``bubble_s`` is :func:`pipeline_bubble_s`.
"""
from __future__ import annotations

import socket
from typing import Dict, Tuple

import pandas as pd
import torch

from ..core import SNNDistributedPlan
from .compute_work import PHASES, Work, local_correction, rank_work
from .hardware import HardwareProfile

TIME_COLUMNS = ("rank", "compute_s", "exposed_comm_s", "bubble_s", "step_s")


def _bubble_fraction(plan: SNNDistributedPlan) -> float:
    """The fraction of a step a rank idles in the pipeline schedule (0 without pipelining)."""
    if not plan.uses_pp:
        return 0.0
    from .pipeline_estimate import bubble_fraction

    return bubble_fraction(plan.pp_schedule, plan.pp_size, plan.pp_microbatches, plan.pp_virtual_stages)


def pipeline_bubble_s(plan: SNNDistributedPlan, phase_s: Dict[str, float]) -> float:
    """Idle time of a rank waiting for pipeline stages in one step (0 without pipelining): the
    schedule's bubble fraction ``f`` of the whole step (:func:`.pipeline_estimate.bubble_fraction`),
    so ``f / (1 - f)`` times the rank's own forward and backward."""
    f = _bubble_fraction(plan)
    return f / (1.0 - f) * (phase_s["forward"] + phase_s["backward"])


def _stride(plan: SNNDistributedPlan, mesh_dim: str) -> int:
    """Rank distance between neighbours of a ``mesh_dim`` group (mesh order pp, dp, tp: tp innermost)."""
    return {"tp": 1, "dp": plan.tp_size}.get(mesh_dim, plan.tp_size * plan.dp_size)


def spans_nodes(plan: SNNDistributedPlan, mesh_dim: str, hw: HardwareProfile, size: int = 0) -> bool:
    """Whether a ``mesh_dim`` group (of ``size`` ranks; default the whole dim) crosses nodes."""
    if hw.ranks_per_node is None:
        return False
    size = size or _group_size(plan, mesh_dim, "")
    return (size - 1) * _stride(plan, mesh_dim) + 1 > hw.ranks_per_node


def _group_size(plan: SNNDistributedPlan, mesh_dim: str, kind: str) -> int:
    """Ranks taking part: a pipeline send joins two neighbouring stages, any other collective the dim."""
    if mesh_dim == "pp":
        return 2 if kind == "send" else plan.pp_size
    return plan.tp_size if mesh_dim == "tp" else plan.dp_size


def _busiest_pp_rank_s(plan: SNNDistributedPlan, sends: Dict[str, float]) -> float:
    """Seconds of the pipeline transfers (``{phase: seconds}`` of each stage boundary) that the pp rank
    with the most of them sends or receives."""
    from .pipeline_estimate import boundary_stages

    spec, per_rank = plan.pp_schedule_spec, [0.0] * plan.pp_size
    for phase, seconds in sends.items():
        ends = {spec.rank_of(s, plan.pp_size, plan.pp_virtual_stages) for s in boundary_stages(phase)}
        for rank in ends:
            per_rank[rank] += seconds
    return max(per_rank)


def exposed_comm_s(plan: SNNDistributedPlan, collectives: pd.DataFrame, hw: HardwareProfile,
                   phase_s: Dict[str, float]) -> float:
    """Seconds of communication not hidden behind compute (rules in the module doc); of a pipeline's
    transfers, those of its busiest rank."""
    timed: Dict[Tuple[str, str, str], Tuple[float, int]] = {}
    sends: Dict[str, float] = {}
    for row in collectives.itertuples(index=False):
        size = _group_size(plan, row.mesh_dim, row.kind)
        seconds = hw.collective_time(row.kind, size, row.bytes, row.count, spans_nodes(plan, row.mesh_dim, hw, size))
        if row.mesh_dim == "pp" and row.kind == "send":
            sends[row.phase] = seconds
        else:
            timed[(row.mesh_dim, row.kind, row.phase)] = (seconds, row.count)
    if sends:
        timed[("pp", "send", "busiest rank")] = (_busiest_pp_rank_s(plan, sends), 0)
    if not hw.overlaps_comm:
        return sum(seconds for seconds, _ in timed.values())
    exposed = 0.0
    ar, ar_n = timed.pop(("dp", "all_reduce", "backward"), (0.0, 0))
    if ar_n:  # DDP buckets
        exposed += max(ar / ar_n, ar - phase_s["backward"])
    fwd, fwd_n = timed.pop(("dp", "all_gather", "forward"), (0.0, 0))
    if fwd_n:  # FSDP2 prefetch: the first gather waits, the rest hide behind the forward
        exposed += fwd / fwd_n + max(0.0, fwd - fwd / fwd_n - phase_s["forward"])
    bag, _ = timed.pop(("dp", "all_gather", "backward"), (0.0, 0))
    rs, rs_n = timed.pop(("dp", "reduce_scatter", "backward"), (0.0, 0))
    if rs_n or bag:
        exposed += max(rs / rs_n if rs_n else 0.0, bag + rs - phase_s["backward"])
    return exposed + sum(seconds for seconds, _ in timed.values())  # TP, ZeRO, pipeline sends: critical path


def ranks_on_host(plan: SNNDistributedPlan, hw: HardwareProfile) -> int:
    """How many of the plan's ranks share one host (all of them on a profile without nodes)."""
    return min(plan.world_size, hw.ranks_per_node or plan.world_size)


def host_sharing(plan: SNNDistributedPlan, hw: HardwareProfile) -> float:
    """How much slower each rank runs when the plan's ranks on one host share its cores (calibrated):
    the slow-down of as many ranks as are busy at once on average, since a pipeline rank idle in
    its schedule's bubble leaves its share of the cores to the others."""
    return hw.sharing(ranks_on_host(plan, hw) * (1.0 - _bubble_fraction(plan)))


def compute_phases(plan: SNNDistributedPlan, work: Work, hw: HardwareProfile, t: int, itemsize: int,
                   local_params_bytes: float, correction: Dict[str, float]) -> Dict[str, float]:
    """Seconds of forward, backward and optimizer on one rank of ``plan`` (a pipeline rank runs
    its ``1 / pp`` of the model, the stages taken as balanced, and updates its stages' parameters)."""
    n = plan.per_rank_batch
    share = local_params_bytes / work.param_bytes if work.param_bytes else 1.0
    slow = host_sharing(plan, hw)
    stage = 1.0 / plan.pp_size
    calls = plan.pp_microbatches * stage if plan.uses_pp else 1.0
    return {p: (work.phase(p).seconds(hw, n, t, itemsize, share) if p == "optimizer"
                else work.phase(p).seconds(hw, n, t, itemsize, stage, calls)) * correction.get(p, 1.0) * slow
            for p in PHASES}


def framework_s(plan: SNNDistributedPlan, profile, collectives: pd.DataFrame, hw: HardwareProfile, t: int) -> float:
    """The calibrated cost of the parallel wrappers themselves (DTensor dispatch of each TP-sharded
    module call, FSDP2's work around each of its collectives, DDP's and ZeRO's work around a step);
    0 on profiles without it."""
    seconds = 0.0
    if plan.dp_size > 1:
        seconds += hw.overhead("ddp_step", plan.dp_size) * plan.uses_ddp + \
            hw.overhead("zero_step", plan.dp_size) * plan.uses_zero
    if plan.uses_tp:
        calls = sum(profile.modules[path].calls(plan.per_rank_batch, t)
                    for path in plan.tensor_parallel_plan if path in profile.modules)
        seconds += calls * hw.overhead("tp_module", plan.tp_size)
    if plan.uses_fsdp:
        fsdp = collectives[(collectives["mesh_dim"] == "dp") & collectives["kind"].isin(("all_gather", "reduce_scatter"))]
        seconds += int(fsdp["count"].sum()) * hw.overhead("fsdp_collective", plan.dp_size)
    return seconds


def time_table(plan: SNNDistributedPlan, collectives: pd.DataFrame, hw: HardwareProfile,
               phase_s: Dict[str, float]) -> pd.DataFrame:
    """The ``rank, compute_s, exposed_comm_s, bubble_s, step_s`` table (every rank alike)."""
    compute = sum(phase_s.values())
    comm = exposed_comm_s(plan, collectives, hw, phase_s)
    bubble = pipeline_bubble_s(plan, phase_s)
    row = dict(compute_s=compute, exposed_comm_s=comm, bubble_s=bubble, step_s=compute + comm + bubble)
    table = pd.DataFrame([row] * plan.world_size)
    table.insert(0, "rank", range(plan.world_size))
    return table[list(TIME_COLUMNS)]


def resolve_hardware(hardware) -> HardwareProfile:
    """``hardware`` as a profile: None is this machine's calibration, a string a built-in profile's name."""
    from .calibration import default_hardware
    from .hardware import hardware_profile

    if hardware is None:
        return default_hardware()
    if isinstance(hardware, str):
        return hardware_profile(hardware)
    if not isinstance(hardware, HardwareProfile):
        raise TypeError(f"hardware must be a HardwareProfile (calibrate(), hardware_profile(name)), a built-in "
                        f"profile's name or None, got {type(hardware).__name__}")
    return hardware


def is_local(hw: HardwareProfile) -> bool:
    """Whether ``hw`` was calibrated on this host's CPU (where the measured step corrects the model)."""
    return hw.device == "cpu" and hw.host is not None and hw.host == socket.gethostname()


def plan_time(plan: SNNDistributedPlan, profile, collectives: pd.DataFrame, per_rank: pd.DataFrame,
              hw: HardwareProfile, t: int, optimizer: str) -> pd.DataFrame:
    """The time table of ``plan`` (see the module doc) from the estimate's other tables."""
    work = rank_work(profile, plan.tensor_parallel_plan, plan.tp_size, optimizer)
    itemsize = torch.empty((), dtype=profile.dtype).element_size()
    correction = {}
    if is_local(hw):
        correction = local_correction(profile, rank_work(profile, None, 1, optimizer), hw, optimizer)
    hw = hw.seen_by(ranks_on_host(plan, hw))
    local = float(per_rank["params_bytes"].iloc[0]) / (plan.dp_size if plan.uses_zero else 1)
    phases = compute_phases(plan, work, hw, t, itemsize, local, correction)
    phases["framework"] = framework_s(plan, profile, collectives, hw, t)
    return time_table(plan, collectives, hw, phases)


def fastest_first(estimates, memory_budget=None) -> list:
    """``estimates`` by predicted step time, those whose peak fits ``memory_budget`` (bytes) first."""
    fits = lambda e: memory_budget is None or e.peak_bytes <= memory_budget
    return sorted(estimates, key=lambda e: (not fits(e), e.step_time_s))
