"""Pipeline schedules: one object per ``pp_schedule`` name, in one registry (:data:`SCHEDULES`).

A plan keeps the schedule's *name* (plain JSON); whatever needs to know what it means asks its
object here: torch's schedule class (imported when first used), whether it runs several stages
per rank and how they are placed, its plan-time checks, the micro-batches whose activations a
rank holds at once, its bubble fraction, and each rank's order of compute actions as torch's own
schedule computes it (:meth:`PipelineSchedule.rank_actions`), replayed into a timeline by
:func:`replay`. Adding a schedule is adding a class here.

Action kinds: ``F`` forward, ``B`` whole backward, and for zero-bubble schedules ``I`` (the
backward for the stage's input, sent on at once) and ``W`` (the backward for its weights, run
later to fill what would be a bubble).
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Tuple

from ...compat_pipelining import pipeline_compute_order, pipelining

#: Time of one micro-batch's action through one stage, in forward units (a backward costs two
#: forwards; a zero-bubble schedule splits it into input and weight halves).
COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}

Action = Tuple[str, int, int]  #: (kind, stage, micro-batch)
Span = Tuple[str, int, int, float, float]  #: (kind, stage, micro-batch, start, end)


class PipelineSchedule:
    """What one ``pp_schedule`` name means. Subclasses set the attributes and override what differs."""
    name = ""
    torch_name = ""  #: its class in torch.distributed.pipelining
    multi_stage = False  #: several (virtual) stages per rank
    virtual_stages: Optional[int] = None  #: the exact stages per rank it needs (None: any allowed count)
    splits_backward = False  #: input and weight backwards run apart (zero-bubble)
    #: torch's step keeps every tensor it sent referenced until the step ends (its send works hold them)
    keeps_sent_tensors = True

    def __repr__(self) -> str:
        return f"<pipeline schedule {self.name!r} (torch {self.torch_name})>"

    def torch_class(self) -> type:
        """torch's schedule class (:func:`~..compat_pipelining.pipelining` imports torch's module on first use)."""
        return getattr(pipelining(), self.torch_name)

    def build(self, stages: list, **kwargs):
        """torch's schedule over this rank's ``stages`` (torch PipelineStage objects)."""
        return self.torch_class()(stages if self.multi_stage else stages[0], **kwargs)

    # ---- plan time
    def check(self, pp: int, micro: int, virtual: int) -> None:
        """Raise ValueError unless the schedule runs ``micro`` micro-batches with ``virtual`` stages per rank."""
        self.check_stages(virtual)
        self.check_micro(pp, micro)

    def check_micro(self, pp: int, micro: int) -> None:
        """Raise ValueError unless the schedule runs ``micro`` micro-batches on ``pp`` ranks (any, here)."""
    def check_stages(self, virtual: int) -> None:
        """Raise ValueError unless the schedule runs ``virtual`` stages per rank."""
        if not self.multi_stage and virtual != 1:
            raise ValueError(f"pp_schedule={self.name!r} runs one stage per rank, but pp_virtual_stages={virtual}; "
                             f"use one of {names_text(lambda s: s.multi_stage)} for several stages per rank")
        if self.multi_stage and self.virtual_stages is None and virtual < 2:
            raise ValueError(f"pp_schedule={self.name!r} needs pp_virtual_stages >= 2 (got {virtual}); use '1f1b' for "
                             "one stage per rank")
        if self.virtual_stages is not None and virtual != self.virtual_stages:
            raise ValueError(f"pp_schedule={self.name!r} needs exactly pp_virtual_stages={self.virtual_stages} "
                             f"(got {virtual})")

    # ---- placement
    def rank_stages(self, pp_rank: int, pp: int, virtual: int) -> Tuple[int, ...]:
        """The stage indices pp rank ``pp_rank`` holds (loop layout: ``pp_rank + k * pp``)."""
        return tuple(pp_rank + k * pp for k in range(virtual))

    def rank_of(self, stage: int, pp: int, virtual: int) -> int:
        """The pp rank that holds ``stage``."""
        return next(r for r in range(pp) if stage in self.rank_stages(r, pp, virtual))

    # ---- what a step does
    def rank_actions(self, pp: int, micro: int, virtual: int = 1) -> Dict[int, List[Action]]:
        """``{pp rank: [(kind, stage, micro-batch), ...]}`` in the order torch's schedule runs them."""
        self.check(pp, micro, virtual)
        return {r: list(acts) for r, acts in _torch_order(self, pp, micro, virtual).items()}

    def in_flight(self, pp: int, pp_rank: int, micro: int, virtual: int = 1) -> int:
        """Stage forwards whose activations rank ``pp_rank`` holds at once (until their backward, or
        weight backward, frees them): the peak over torch's order."""
        held = peak = 0
        for kind, _, _ in self.rank_actions(pp, micro, virtual)[pp_rank]:
            held += {"F": 1, "B": -1, "W": -1}.get(kind, 0)
            peak = max(peak, held)
        return peak

    def bubble_fraction(self, pp: int, micro: int, virtual: int = 1) -> float:
        """The share of a step each rank idles, actions costing :data:`COST`: the replayed timeline's."""
        return idle_fraction(replay(self.rank_actions(pp, micro, virtual), pp * virtual))


class GPipe(PipelineSchedule):
    name, torch_name = "gpipe", "ScheduleGPipe"

    def in_flight(self, pp: int, pp_rank: int, micro: int, virtual: int = 1) -> int:
        return micro

    def bubble_fraction(self, pp: int, micro: int, virtual: int = 1) -> float:
        """``(pp - 1) / (micro + pp - 1)``: the pipe fills and drains once over ``micro`` micro-batches."""
        return (pp - 1) / (micro + pp - 1)


class OneFOneB(GPipe):
    name, torch_name, keeps_sent_tensors = "1f1b", "Schedule1F1B", False

    def in_flight(self, pp: int, pp_rank: int, micro: int, virtual: int = 1) -> int:
        """Its warm-up: ``pp - pp_rank`` forwards (at most ``micro``)."""
        return min(micro, pp - pp_rank)


class Interleaved(PipelineSchedule):
    name, torch_name, multi_stage = "interleaved", "ScheduleInterleaved1F1B", True

    def check_micro(self, pp: int, micro: int) -> None:
        rounds = max(1, micro // pp)
        if micro % rounds:
            raise ValueError(f"pp_schedule={self.name!r} runs micro-batches in rounds of pp={pp}: "
                             f"pp_microbatches={micro} must be a multiple of {rounds} (= {micro} // {pp})")

    def in_flight(self, pp: int, pp_rank: int, micro: int, virtual: int = 1) -> int:
        """Its warm-up ``(virtual - 1) * micro_per_round + 2 * (pp - 1 - pp_rank)`` plus the one in flight."""
        per_round = micro // max(1, micro // pp)
        return min((virtual - 1) * per_round + 2 * (pp - 1 - pp_rank) + 1, virtual * micro)

    def bubble_fraction(self, pp: int, micro: int, virtual: int = 1) -> float:
        """``(pp - 1) / (virtual * micro + pp - 1)``: each rank's work is cut in ``virtual`` stages, so the
        fill and drain cost ``1 / virtual`` as much."""
        return (pp - 1) / (virtual * micro + pp - 1)


class InterleavedZeroBubble(Interleaved):
    name, torch_name, splits_backward = "interleaved_zb", "ScheduleInterleavedZeroBubble", True
    in_flight = PipelineSchedule.in_flight
    bubble_fraction = PipelineSchedule.bubble_fraction


class ZeroBubbleV(PipelineSchedule):
    name, torch_name, multi_stage, virtual_stages = "zbv", "ScheduleZBVZeroBubble", True, 2
    splits_backward = True

    def rank_stages(self, pp_rank: int, pp: int, virtual: int) -> Tuple[int, ...]:
        return pp_rank, 2 * pp - 1 - pp_rank


#: Every schedule, by the name a plan stores.
SCHEDULES: Dict[str, PipelineSchedule] = {s.name: s for s in (GPipe(), OneFOneB(), Interleaved(),
                                                               InterleavedZeroBubble(), ZeroBubbleV())}


def names_text(which) -> str:
    """The names of the schedules ``which(schedule)`` accepts, quoted, for an error message."""
    return ", ".join(repr(n) for n, s in SCHEDULES.items() if which(s))


def schedule_of(name) -> PipelineSchedule:
    """The schedule object of ``name``; ValueError names the accepted ones."""
    if not isinstance(name, str) or name not in SCHEDULES:
        raise ValueError(f"pp_schedule={name!r}; expected one of {tuple(SCHEDULES)}")
    return SCHEDULES[name]


def default_schedule(virtual: int) -> str:
    """The name of the schedule a plan with ``virtual`` stages per rank gets: ``interleaved`` for
    several, else ``1f1b``."""
    return Interleaved.name if virtual > 1 else OneFOneB.name


@functools.lru_cache(maxsize=64)
def _torch_order(schedule: PipelineSchedule, pp: int, micro: int, virtual: int) -> Dict[int, Tuple[Action, ...]]:
    order = pipeline_compute_order(schedule.torch_class(), pp, micro,
                                   lambda rank: schedule.rank_stages(rank, pp, virtual))
    return {r: tuple(acts) for r, acts in order.items()}


# ---- the timeline -----------------------------------------------------------------------------------

def passes(kind: str) -> str:
    """What an action of ``kind`` hands on: a forward its output (``F``), a backward (whole or input)
    the gradient of its input to the previous stage (``G``), a weight backward nothing (``W``)."""
    return "G" if kind in ("B", "I") else kind


def needs(kind: str, stage: int, micro: int, stages: int) -> Optional[Tuple[str, int, int]]:
    """What the action ``(kind, stage, micro)`` waits for, as ``(passes, stage, micro)`` of the action
    that hands it on: a forward the previous stage's forward, a backward (whole or input) the next
    stage's; None for the first stage's forward, the last stage's backward and weight backwards."""
    if kind == "F":
        return ("F", stage - 1, micro) if stage else None
    return ("G", stage + 1, micro) if passes(kind) == "G" and stage < stages - 1 else None


def replay(orders: Dict[int, List[Action]], stages: int, cost: Optional[Callable[[str, int], float]] = None,
           link: Optional[Callable[[int, int], float]] = None) -> Dict[int, List[Span]]:
    """Per rank ``(kind, stage, micro-batch, start, end)`` of every action of ``orders`` (rank ->
    its actions in order), each taking ``cost(kind, stage)`` (default :data:`COST`) and waiting for
    the action it needs: a forward for the previous stage's forward of that micro-batch, a backward
    (whole or input) for the next stage's, plus ``link(src stage, dst stage)`` (default 0) when that
    action ran on another rank; the last stage's backward and any weight backward follow on the rank."""
    cost = cost or (lambda kind, stage: COST[kind])
    done: Dict[Tuple[str, int, int], Tuple[float, int]] = {}  # what an action passes on: (when, its rank)
    out: Dict[int, list] = {r: [] for r in orders}
    position, free = {r: 0 for r in orders}, {r: 0.0 for r in orders}
    while any(position[r] < len(orders[r]) for r in orders):
        progressed = False
        for r, acts in orders.items():
            if position[r] == len(acts):
                continue
            kind, s, i = acts[position[r]]
            need = needs(kind, s, i, stages)
            if need is not None and need not in done:
                continue
            ready = 0.0
            if need is not None:
                ready, src = done[need]
                ready += link(need[1], s) if link is not None and src != r else 0.0
            start = max(free[r], ready)
            free[r] = start + cost(kind, s)
            done[(passes(kind), s, i)] = (free[r], r)
            out[r].append((kind, s, i, start, free[r]))
            position[r] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"the action orders deadlock: {orders}")
    return out


def idle_fraction(lines: Dict[int, List[Span]]) -> float:
    """The idle share of all ranks' time up to the last action of a :func:`replay`."""
    end = max(a[-1] for acts in lines.values() for a in acts)
    busy = sum(a[-1] - a[-2] for acts in lines.values() for a in acts)
    return 1.0 - busy / (end * len(lines))
