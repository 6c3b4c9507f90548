"""The predicted time of a pipeline plan's step (mode ``pp``): torch's schedule replayed with each
stage's own cost.

Each stage's forward (with the loss on the last stage) and backward of one micro-batch are counted
(:class:`~.op_counter.OpCounter`) on the profile's model copy as mode ``pp`` runs them
(:func:`~..core.parallelize.pipeline.build_stage`, its output cast to the compute dtype under bf16 / fp16):
:func:`stage_work`. Their roofline
time (:meth:`~.compute_work.PhaseWork.seconds`, with the measured correction and the host's
slow-down, as any plan's compute) plus the schedule's own cost per action (calibrated per schedule:
``pp_action:<schedule>``, see :mod:`.calibration`) is the cost of each action of the ranks'
orders, as torch's schedule runs them, replayed into time lines (:func:`replay_plan`; a zero-bubble
schedule's input and weight backwards half a backward each). So stages of unequal cost set the
step, not their average. A transfer between ranks delays the action that waits for it by its
alpha-beta time plus the schedule's calibrated latency beyond it (``pp_link:<schedule>``). Ranks
sharing a host slow each other by as many as are busy at once on average (:func:`busy_share`).
On a GPU kernel-model profile each stage's micro-batch is timed instead from its kernels as the GPU runs
them (:func:`.gpu_kernels.gpu_pipeline_time` passes ``stage_s``); the schedule is replayed the same way.

After the schedule each rank all-reduces its stages' gradients over dp (FSDP2 stages: reduce-scatters them,
and their once-per-step all-gathers are counted there too, unhidden), every rank joins the
loss broadcast (so all end the schedule together) and steps its optimizer over its stages'
parameters. Per rank: ``compute_s`` its actions and its optimizer step, ``exposed_comm_s`` the
waits for transfers (:func:`waited_on_transfers`) and its collectives, ``bubble_s`` the rest of
its step.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Dict, List, Sequence, Tuple

import pandas as pd
import torch

from ...core.common import Collective
from ...core.model import pipeline_units
from ...core.parallelize import StageConfig, build_stage
from ...core.planning import check_pp_model, needs, passes, replay, stage_units
from ...core.tp import STYLES
from ..instruments.op_counter import OpCounter
from ..instruments.tables import TIME_COLUMNS, boundary_stages, gather_phase, reduce_phase
from ..profile.profiling import Fit
from ..profile.stage_repeats import composed_stages
from ..profile.step import batch_slice, input_as, loss_of
from .collectives import stage_tp_rows
from .compute_work import PhaseWork
from .hardware import HardwareProfile
from .placement import spans_nodes

#: The share of a whole backward each backward action does.
BACKWARD_SHARE = {"B": 1.0, "I": 0.5, "W": 0.5}


@dataclass(frozen=True)
class StageWork:
    """The counted work of one micro-batch through one stage, and the bytes of the output it sends on (in the
    compute dtype under bf16 / fp16, as ``apply``'s stages send it)."""

    forward: PhaseWork
    backward: PhaseWork
    sent_bytes: int


def _phase_work(counts: Sequence[float]) -> PhaseWork:
    return PhaseWork(*(Fit(c0=v) for v in counts))


def stage_work(profile, stages: Sequence[Sequence[str]], n: int, t: int, tp_plan=None, tp: int = 1) -> List[StageWork]:
    """:class:`StageWork` of every stage (``stages``: unit paths) for ``n`` samples and ``t`` steps,
    cached on the profile (with ``tp_plan`` over ``tp`` ranks: on one TP rank's replica). Counted in the
    state of a step: after a forward at the same size, the stage's gradients None, its input a received
    activation that requires grad (the first stage's the batch), the gradient of its output given."""
    cache = profile.__dict__.setdefault("_stage_work", {})
    key = (tuple(map(tuple, stages)), n, t) + profile.rank_model(tp_plan, tp)[0]
    if key not in cache:
        with profile.runner(tp_plan, tp, profile.shape_only) as (model, convert):  # FakeTensors when shape-only
            run = lambda cut: _count_stages(profile, model, convert, cut, n, t)  # noqa: E731
            composed = composed_stages(profile.composed if tp == 1 else None, stages, run, _counts)  # deep stages
            cache[key] = run(stages) if composed is None else [_stage_work(c) for c in composed]
    return cache[key]


def _counts(work: StageWork) -> Tuple[float, ...]:
    """The figures of a :class:`StageWork`, flat: forward's counts, backward's, then the bytes it sends."""
    return tuple(getattr(phase, f.name).c0 for phase in (work.forward, work.backward)
                 for f in fields(PhaseWork)) + (work.sent_bytes,)


def _stage_work(figures: Sequence[float]) -> StageWork:
    """The :class:`StageWork` of :func:`_counts`' flat figures."""
    half = (len(figures) - 1) // 2
    return StageWork(_phase_work(figures[:half]), _phase_work(figures[half:2 * half]), int(figures[-1]))


def _count_stages(profile, model, convert, stages: Sequence[Sequence[str]], n: int, t: int) -> List[StageWork]:
    x, y = batch_slice(profile.example_input, profile.labels, n, t, layout=profile.layout)
    x, y, out = convert(input_as(x, profile.dtype)), convert(y), []  # token ids stay ints
    config = StageConfig(per_step=profile.layout.per_step, precision=profile.precision,
                         autocast_device="cpu")  # as apply runs CPU ranks
    for i, paths in enumerate(stages):
        stage = build_stage(i, paths, model, config)  # autocast, its output cast to the compute dtype it sends
        inp = x if i == 0 else x.detach().requires_grad_()
        with torch.no_grad():
            grad_out = torch.ones_like(stage(inp))
        with OpCounter() as forward:
            y_stage = stage(inp)
            # labels beside the outputs: a meta (shape-only) model's are on meta, the batch's on the CPU
            loss = loss_of(y_stage, y if y is None else y.to(y_stage.device), profile.layout) \
                if i == len(stages) - 1 else None
        with OpCounter() as backward:
            if loss is not None:
                loss.backward()
            elif y_stage.requires_grad:
                torch.autograd.backward([y_stage], [grad_out])
        for p in stage.parameters():
            p.grad = None
        out.append(StageWork(_phase_work(forward.counts), _phase_work(backward.counts), y_stage.nbytes))
        x = y_stage.detach()
    return out


def plan_stages(plan, profile) -> Tuple[Tuple[str, ...], ...]:
    """The unit paths of each stage of ``plan`` on the profile's model."""
    units = pipeline_units(profile.model)[0]
    return stage_units(units, check_pp_model(plan, units))


def transfer_s(plan, collectives: pd.DataFrame, hw: HardwareProfile) -> Dict[Tuple[int, int], float]:
    """Seconds of one micro-batch's transfer across each stage boundary, by ``(src, dst)`` stage."""
    out = {}
    sends = collectives[(collectives["mesh_dim"] == "pp") & (collectives["kind"] == Collective.SEND)]
    for row in sends.itertuples(index=False):
        out[boundary_stages(row.phase)] = hw.collective_time(Collective.SEND, 2, row.bytes, row.count,
                                                             spans_nodes(plan, "pp", hw, 2)) / row.count
    return out


def _action_costs(plan, work: List[StageWork], hw: HardwareProfile, t: int, itemsize: int,
                  scale: Dict[str, float]) -> Dict[Tuple[str, int], float]:
    """Compute seconds of each ``(action kind, stage)`` (``scale``: per phase, correction x sharing)."""
    n = plan.per_rank_batch // plan.pp_microbatches
    costs = {}
    for s, w in enumerate(work):
        costs[("F", s)] = w.forward.seconds(hw, n, t, itemsize) * scale["forward"]
        backward = w.backward.seconds(hw, n, t, itemsize) * scale["backward"]
        costs.update({(kind, s): share * backward for kind, share in BACKWARD_SHARE.items()})
    return costs


def _timed_costs(timed: Sequence[Tuple[float, float]], scale: Dict[str, float]) -> Dict[Tuple[str, int], float]:
    """:func:`_action_costs` from each stage's ``(forward, backward)`` seconds of one micro-batch."""
    costs = {}
    for s, (forward, backward) in enumerate(timed):
        costs[("F", s)] = forward * scale["forward"]
        costs.update({(kind, s): share * backward * scale["backward"] for kind, share in BACKWARD_SHARE.items()})
    return costs


def replay_plan(plan, costs: Dict[Tuple[str, int], float], links: Dict[Tuple[int, int], float]):
    """The time lines of ``plan``'s schedule (:func:`~..core.pipeline_schedules.replay`), each action
    costing ``costs[(kind, stage)]``, each transfer ``links[(src, dst)]`` between its two actions."""
    orders = plan.pp_schedule_spec.rank_actions(plan.pp_size, plan.pp_microbatches, plan.pp_virtual_stages)
    return replay(orders, plan.pp_stages, lambda kind, s: costs[(kind, s)], lambda src, dst: links.get((src, dst), 0.0))


def waited_on_transfers(lines, rank: int, links: Dict[Tuple[int, int], float], stages: int) -> float:
    """Seconds ``rank``'s actions started later than they would have without the transfers of their
    inputs (``lines``: a replay's time lines of every rank; ``links``: seconds per transfer)."""
    ends = {(passes(kind), s, i): end for spans in lines.values() for kind, s, i, _, end in spans}
    waited, free = 0.0, 0.0
    for kind, s, i, start, end in lines[rank]:
        need = needs(kind, s, i, stages)
        link = links.get((need[1], s), 0.0) if need is not None else 0.0
        if link:
            waited += max(0.0, min(link, start - max(free, ends[need])))
        free = end
    return waited


def busy_share(plan, costs: Dict[Tuple[str, int], float]) -> float:
    """The share of the schedule's time the average rank computes (transfers left out)."""
    lines = replay_plan(plan, costs, {})
    end = max(span[-1] for spans in lines.values() for span in spans)
    busy = sum(span[-1] - span[-2] for spans in lines.values() for span in spans)
    return busy / (end * plan.pp_size) if end else 1.0


def pipeline_time_table(plan, profile, collectives: pd.DataFrame, per_rank: pd.DataFrame, hw: HardwareProfile,
                        t: int, itemsize: int, correction: Dict[str, float], ranks_on_host: int,
                        optimizer_s, stage_s=None) -> pd.DataFrame:
    """The ``rank, compute_s, exposed_comm_s, bubble_s, step_s`` table of pipeline ``plan`` (see the
    module doc); ``optimizer_s(params_bytes)``: seconds of the optimizer step over that many bytes,
    before the host's slow-down. ``stage_s(stages, n)``: seconds of one micro-batch of ``n`` samples
    through each stage, a list of ``(forward, backward)`` pairs, where the hardware times stages
    itself (a GPU's kernel model, :func:`.gpu_kernels.gpu_pipeline_time`); else the stages' counted
    operators (:func:`stage_work`) on the profile's roofline."""
    stages = plan_stages(plan, profile)
    n = plan.per_rank_batch // plan.pp_microbatches
    if stage_s is None:
        work = stage_work(profile, stages, n, t, plan.tensor_parallel_plan, plan.tp_size)
        action_costs = lambda scale: _action_costs(plan, work, hw, t, itemsize, scale)
    else:
        timed = stage_s(stages, n)
        action_costs = lambda scale: _timed_costs(timed, scale)
    unit = {p: correction.get(p, 1.0) for p in ("forward", "backward", "optimizer")}
    slow = hw.sharing(ranks_on_host * busy_share(plan, action_costs(unit)))
    per_action = hw.overhead(f"pp_action:{plan.pp_schedule}", plan.pp_size)
    inside = stage_tp_s(plan, profile, stages, hw, n, t, itemsize)
    costs = {k: c + per_action + inside.get(k, 0.0)
             for k, c in action_costs({p: c * slow for p, c in unit.items()}).items()}
    extra = hw.overhead(f"pp_link:{plan.pp_schedule}", plan.pp_size)
    links = {boundary: seconds + extra for boundary, seconds in transfer_s(plan, collectives, hw).items()}
    lines = replay_plan(plan, costs, links)
    reduce_s, broadcast = _collectives_after(plan, collectives, hw)
    rows = []
    for pp_rank, spans in sorted(lines.items()):
        params = float(per_rank["params_bytes"].iloc[pp_rank * plan.dp_size * plan.tp_size])
        optimizer = optimizer_s(params) * unit["optimizer"] * slow
        rows.append(dict(end=spans[-1][-1] + reduce_s[pp_rank], optimizer=optimizer,
                         compute=sum(costs[(kind, s)] for kind, s, *_ in spans) + optimizer,
                         comm=waited_on_transfers(lines, pp_rank, links, plan.pp_stages) + reduce_s[pp_rank] + broadcast))
    joined = max(r["end"] for r in rows) + broadcast  # the loss broadcast: every rank waits for the last
    table = []
    for rank in range(plan.world_size):
        r = rows[rank // (plan.dp_size * plan.tp_size)]  # mesh order pp, dp, tp
        step = joined + r["optimizer"]
        table.append(dict(rank=rank, compute_s=r["compute"], exposed_comm_s=r["comm"],
                          bubble_s=max(0.0, step - r["compute"] - r["comm"]), step_s=step))
    return pd.DataFrame(table, columns=list(TIME_COLUMNS))


def stage_tp_s(plan, profile, stages: Sequence[Sequence[str]], hw: HardwareProfile, n: int, t: int,
               itemsize: int) -> Dict[Tuple[str, int], float]:
    """Seconds each action of a 3-D plan spends in its stage's tensor-parallel collectives (on the critical
    path, over the tp group's link: inside a node when tp fits in one) and in the calibrated DTensor
    dispatch of each call of a module a TP style wraps (counted with the forward); empty without tp."""
    if plan.tp_size == 1:
        return {}
    out: Dict[Tuple[str, int], float] = {}
    link = spans_nodes(plan, "tp", hw)
    for s, units in enumerate(stages):
        phase_s = {"forward": 0.0, "backward": 0.0}
        for row in stage_tp_rows(plan, profile, units, n, t, itemsize):
            phase_s[row["phase"]] += hw.collective_time(row["kind"], plan.tp_size, row["bytes"], row["count"], link)
        calls = sum(profile.modules[path].calls(n, t) for path, style in plan.tensor_parallel_plan.items()
                    if path in profile.modules and STYLES[style].wraps_calls
                    and any(path == u or path.startswith(u + ".") for u in units))
        out[("F", s)] = phase_s["forward"] + calls * hw.overhead("tp_module", plan.tp_size)
        out.update({(kind, s): share * phase_s["backward"] for kind, share in BACKWARD_SHARE.items()})
    return out


def _collectives_after(plan, collectives: pd.DataFrame, hw: HardwareProfile) -> Tuple[List[float], float]:
    """Seconds of each pp rank's dp all-reduce of its stages' gradients (FSDP2 stages: their reduce-scatters and
    all-gathers, once per step each), and of the loss broadcast."""
    spec = plan.pp_schedule_spec
    reduce_s = []
    for pp_rank in range(plan.pp_size):
        own = spec.rank_stages(pp_rank, plan.pp_size, plan.pp_virtual_stages)
        rows = collectives[(collectives["mesh_dim"] == "dp")  # FSDP2 stages: their gathers, exposed, too
                           & collectives["phase"].isin((reduce_phase(own), gather_phase(own)))]
        reduce_s.append(sum(hw.collective_time(r.kind, plan.dp_size, r.bytes, r.count, spans_nodes(plan, "dp", hw))
                            for r in rows.itertuples()))
    loss = collectives[(collectives["mesh_dim"] == "pp") & (collectives["kind"] == Collective.BROADCAST)]
    broadcast = sum(hw.collective_time(Collective.BROADCAST, plan.pp_size, r.bytes, r.count, spans_nodes(plan, "pp", hw))
                    for r in loss.itertuples())
    return reduce_s, broadcast
