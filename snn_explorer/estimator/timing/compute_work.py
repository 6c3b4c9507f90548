"""The compute work of one training step as a rank runs it: FLOPs, bytes moved and operators.

A dispatch mode (:class:`~.op_counter.OpCounter`) counts every operator of the forward (with the
loss), the backward and the optimizer step of the model one rank runs (the unsharded model, or
its TP replica with each rank's local layer shapes), at the profile's four sizes ``(N, T)``
(:func:`counted_pass`; the optimizer's once, :func:`optimizer_work`): FLOPs by the formulas of
torch's ``FlopCounterMode``, bytes as the sizes of each operator's tensor inputs and outputs,
and the operator count. Each is fitted bilinearly in ``N`` and ``T`` (the profile's :class:`Fit`)
and so scales to a plan's per-rank batch and time steps. :meth:`Work.seconds` turns a phase into
time on a :class:`~.hardware.HardwareProfile` by a roofline: ``max(flops / flop_rate,
bytes_of_flop_ops / bandwidth) + other_bytes / bandwidth + ops * op_overhead``.

On the machine a profile was calibrated on, :func:`local_correction` also times the real step of
the unsharded model once (at the example input's size, one thread as a rank runs; a model of
repeated blocks cut to 2 and 64 of them, the whole step composed from those: :func:`composed_step`)
and returns the ratio of measured to modelled time per phase, which the step-time model applies there.
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from typing import Dict, Iterator, Optional

import torch

from ...core.common import collector_paused
from ..instruments.isolation import one_thread
from ..instruments.op_counter import OpCounter, grad_names
from ..profile.profiling import SIZES, Fit, ModelProfile
from ..profile.repeats import CUT_FAILURES, NotRepeating, block_inputs, cut, extend_counts, find_repeats, names_as_run
from ..profile.step import OPTIMIZERS, batch_slice, forward_loss, input_as
from .chunk_work import chunked_work, time_chunks_of
from .hardware import HardwareProfile

PHASES = ("forward", "backward", "optimizer")
#: The repeats a model of repeated blocks is counted with (:func:`cut_counted_points`).
COUNT_CUTS = (2, 3, 4)


@dataclass(frozen=True)
class PhaseWork:
    """One phase's work, each a :class:`Fit` in ``(N, T)``."""

    flops: Fit
    flop_bytes: Fit
    other_bytes: Fit
    ops: Fit

    def seconds(self, hw: HardwareProfile, n: int, t: int, itemsize: int, scale: float = 1.0) -> float:
        """Roofline time of this phase for ``n`` samples and ``t`` steps; ``scale`` multiplies FLOPs and
        bytes (a shard of the optimizer's parameters), not the operator launches."""
        bw = hw.bandwidth()
        matmul = max(self.flops(n, t) * scale / hw.flops(itemsize), self.flop_bytes(n, t) * scale / bw)
        return matmul + self.other_bytes(n, t) * scale / bw + self.ops(n, t) * hw.op_overhead_s


@dataclass(frozen=True)
class Work:
    """The forward, backward and optimizer work of the model one rank runs; ``param_bytes`` its parameters."""

    forward: PhaseWork
    backward: PhaseWork
    optimizer: PhaseWork
    param_bytes: int

    def phase(self, name: str) -> PhaseWork:
        return getattr(self, name)


@contextlib.contextmanager
def restored(params) -> Iterator[None]:
    """Run the body (optimizer steps), then put the values of ``params`` back."""
    with torch.no_grad():
        saved = [p.detach().clone() for p in params]
    try:
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)


def count_step(model: torch.nn.Module, x: torch.Tensor, labels) -> list:
    """The counts of the forward (with the loss) and of the backward of one step of ``model``."""
    with OpCounter() as forward:
        loss = forward_loss(model, x, labels)
    with OpCounter() as backward:
        loss.backward()
    return [forward.counts, backward.counts]


def counted_pass(model: torch.nn.Module, x: torch.Tensor, labels, warm_up: bool = True) -> list:
    """Counts of the forward (with the loss) and of the backward of one step of ``model``.

    Counted in the state of a training step: after a forward at the same size (the neuron state
    has the size of this batch; without autograd, as only sizes matter here) and with the gradients
    set to None, so the count does not depend on what ran before. ``warm_up=False`` skips that
    forward where the last step run had this batch size already (as the profile's own runs do)."""
    if warm_up:
        with torch.no_grad():
            forward_loss(model, x, labels)
    model.zero_grad(set_to_none=True)
    return count_step(model, x, labels)


def optimizer_work(model: torch.nn.Module, grad_params, optimizer: str) -> PhaseWork:
    """Counts of ``optimizer``'s step over ``model``'s parameters named in ``grad_params`` (those a
    backward gives a gradient): the second step, the first creating its state. The step's
    operators and bytes depend on the shapes of parameters and gradients, not on their values or on
    ``N`` and ``T``, so zero gradients stand in for real ones; the parameters are restored."""
    named = dict(model.named_parameters())
    params = [p for p in named.values() if p.requires_grad]
    with restored(params):
        for name in grad_params:
            named[name].grad = torch.zeros_like(named[name])
        counts = grouped_step_counts(params, optimizer) or step_counts(params, optimizer)
    model.zero_grad(set_to_none=True)
    return PhaseWork(*(Fit(c0=v) for v in counts))


def step_counts(params: list, optimizer: str) -> list:
    """The counts of ``optimizer``'s second step over ``params`` (the first creates its state)."""
    opt = OPTIMIZERS[optimizer].make(params, lr=1e-6)
    opt.step()
    with OpCounter() as step:
        opt.step()
    return step.counts


def grouped_step_counts(params: list, optimizer: str) -> Optional[list]:
    """:func:`step_counts` of ``params`` from one parameter of each group of alike ones (shape, dtype, with a
    gradient or not): the step's own operators plus, per group, one parameter's times the group's size. Exact
    where the step is affine in its parameters, which is checked on the largest group (one, two and three of
    them: the step's own operators are ``2 * one - two``); None where it is not, or where that saves little
    (fewer than half as many groups as parameters)."""
    groups: Dict[tuple, list] = {}
    for p in params:
        groups.setdefault((tuple(p.shape), p.dtype, p.grad is not None), []).append(p)
    largest = max(groups.values(), key=len, default=[])
    if len(largest) < 3 or 2 * len(groups) > len(params):
        return None
    one, two, three = (step_counts(largest[:k], optimizer) for k in (1, 2, 3))
    own = [2 * a - b for a, b in zip(one, two)]
    if three != [b + (b - a) for a, b in zip(one, two)]:
        return None
    total = own
    for group in groups.values():  # the largest group's one parameter is counted already
        single = one if group is largest else step_counts(group[:1], optimizer)
        total = [t + len(group) * (c - o) for t, c, o in zip(total, single, own)]
    return total


def fitted_work(points, optimizer: PhaseWork, model: torch.nn.Module) -> Work:
    """The :class:`Work` of ``model`` from :func:`counted_pass` counts at the :data:`SIZES` and its optimizer's."""
    phases = [PhaseWork(*(Fit.of(*(pt[i][k] for pt in points)) for k in range(4))) for i in range(2)]
    params = [p for p in model.parameters() if p.requires_grad]
    return Work(*phases, optimizer, param_bytes=sum(p.numel() * p.element_size() for p in params))


def count_work(model: torch.nn.Module, profile: ModelProfile, optimizer: str, convert=lambda x: x,
               repeat_cuts: Optional[tuple] = None) -> Work:
    """Count the step of ``model`` (the model one rank runs) at the profile's :data:`SIZES` and fit it;
    ``convert`` makes each batch the tensors ``model`` takes (fake ones for a shape-only run); ``repeat_cuts``:
    ``(repeats, cuts)`` of a lever variant's model (``ModelProfile.repeat_cuts``), else its own, cut at
    :data:`COUNT_CUTS`."""
    composed = cut_counted_points(model, profile, convert, repeat_cuts)
    if composed is None:
        points = counted_points(model, profile, convert)
        grads = grad_names(model)
    else:
        points, grads = composed
    model.zero_grad(set_to_none=True)
    return fitted_work(points, optimizer_work(model, grads, optimizer), model)


def cut_counted_points(model: torch.nn.Module, profile: ModelProfile, convert=lambda x: x,
                       repeat_cuts: Optional[tuple] = None) -> Optional[tuple]:
    """``(counted_points, parameters given a gradient)`` of a model of repeated blocks (:mod:`..profile.repeats`)
    from passes cut to 2, 3 and 4 of them at each size (or ``repeat_cuts``: ``(repeats, (k1, k2, k3))``, one
    stride apart): the run with 3 plus each later block's counts (the difference from 2), checked to give the
    run with 4 (and the blocks after the first to take one input signature, block for block a stride apart);
    None where it has no repeats or they disagree (then it is counted in full)."""
    repeats, cuts = repeat_cuts if repeat_cuts is not None else (find_repeats(model), COUNT_CUTS)
    if repeats is None:
        return None
    try:
        points = [_cut_counts(model, profile, convert, repeats, cuts, n, t) for n, t in SIZES]
        with cut(model, repeats, cuts[-1]):
            grads = grad_names(model)
    except CUT_FAILURES:  # the cut runs disagree, or the forward needs all its blocks: count in full
        return None
    names = tuple(n for n, _ in model.named_parameters())
    return points, names_as_run(names, grads, repeats, cuts[-1])


def _cut_counts(model, profile: ModelProfile, convert, repeats, cuts, n: int, t: int) -> list:
    x, y = batch_slice(profile.example_input, profile.labels, n, t, layout=profile.layout)
    x, y = convert(input_as(x, profile.dtype)), convert(y)
    counts, stride = [], cuts[1] - cuts[0]
    for k in cuts:
        with cut(model, repeats, k), block_inputs(model, repeats, tuple(range(1, k))) as inputs:
            counts.append(counted_pass(model, x, y))
        # a checkpointed block's first child also runs in the recompute: alike blocks are a stride apart
        if any(inputs[j] != inputs[j - stride] for j in inputs if j > stride) or not inputs[1]:
            raise NotRepeating("the repeats after the first do not all take the same input")
    short, middle, longer = counts
    if extend_counts(short, middle, 1) != longer:
        raise NotRepeating("the operator counts are not affine in the number of repeats")
    return extend_counts(short, middle, (repeats.count - cuts[1]) // (cuts[1] - cuts[0]))


def counted_points(model: torch.nn.Module, profile: ModelProfile, convert=lambda x: x) -> list:
    """:func:`counted_pass` of ``model`` at each of the profile's :data:`SIZES` (in that order), run by batch
    size so that a step warms the neuron state for the next one at its size (one warm-up per batch size)."""
    by_size, last_n = {}, None
    for n, t in sorted(SIZES):
        x, y = batch_slice(profile.example_input, profile.labels, n, t, layout=profile.layout)
        by_size[n, t] = counted_pass(model, convert(input_as(x, profile.dtype)), convert(y), warm_up=n != last_n)
        last_n = n
    return [by_size[size] for size in SIZES]


def rank_work(profile: ModelProfile, tp_plan, tp: int, optimizer: str) -> Work:
    """The :class:`Work` of the model one rank of a plan runs, cached on the profile per TP layout: the
    unsharded model's from the counts its profile runs took (``ModelProfile.step_counts``, taken in
    the state :func:`counted_pass` sets), any other's by :func:`count_work`; on FakeTensors for a
    shape-only profile. Time chunks of two or more steps: composed per chunk (:mod:`.chunk_work`). A profile that
    wraps a ``base`` (spike compression, activation offload) does its base's work: the lever's own time (check,
    pack, unpack; host copies) is the estimate's ``extra_s``, not counted again here."""
    if getattr(profile, "base", None) is not None:
        return rank_work(profile.base, tp_plan, tp, optimizer)
    cache = profile.__dict__.setdefault("_step_work", {})
    layout, model = profile.rank_model(tp_plan, tp)
    key = (layout, optimizer)
    if key not in cache:
        with profile.runner(tp_plan, tp, profile.shape_only) as (run_model, convert):
            if tp <= 1 and profile.step_counts:
                cache[key] = fitted_work(profile.step_counts,
                                         optimizer_work(run_model, profile.grad_params, optimizer), run_model)
            else:
                cache[key] = count_work(run_model, profile, optimizer, convert, profile.repeat_cuts(tp_plan, tp))
        chunks = time_chunks_of(profile)
        if chunks is not None:  # a fit in T misses the replays of chunks longer than the profile's time steps
            cache[key] = chunked_work(cache[key], chunks, tp_plan, tp, counted_pass)
    return cache[key]


#: The repeats a model of repeated blocks is timed with (:func:`local_correction`): the step's time is composed as
#: ``T(2) + (count - 2) * (T(64) - T(2)) / 62``, each phase alike. 64 repeats make a timed step long enough to read
#: a block's time from (benchmarks/calibration_composed.py measures the composed step against the whole one).
TIME_CUTS = (2, 64)


def timed_step(model: torch.nn.Module, x: torch.Tensor, labels, optimizer: str,
               clock=time.perf_counter) -> Dict[str, float]:
    """Seconds of each phase of ``model``'s second training step (the first creates the optimizer's state and
    warms the allocator); the parameters are restored after. Run it with one thread, as each rank runs, and the
    garbage collector paused (:func:`local_correction` does). ``clock`` reads the time (a test passes one that
    counts work)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = OPTIMIZERS[optimizer].make(params, lr=1e-6)
    times = {}
    with restored(params):
        for _ in range(2):
            start = clock()
            loss = forward_loss(model, x, labels)
            mid = clock()
            loss.backward()
            end = clock()
            opt.step()
            times = {"forward": mid - start, "backward": end - mid, "optimizer": clock() - end}
            opt.zero_grad(set_to_none=True)
    return times


def composed_step(model: torch.nn.Module, x: torch.Tensor, labels, optimizer: str,
                  clock=time.perf_counter) -> Optional[Dict[str, float]]:
    """:func:`timed_step` of a model of repeated blocks (:mod:`..profile.repeats`) composed from the model cut to
    :data:`TIME_CUTS` repeats: the rest of the model and two blocks timed as they are, each later block as the
    mean block of the longer cut. An approximation where blocks take different times (the error measured against
    the full step is in the README); None where the model has too few repeats, cannot run cut, or a phase is not
    longer with more blocks (then the whole step is timed)."""
    repeats = find_repeats(model)
    if repeats is None or repeats.count <= TIME_CUTS[1]:
        return None
    try:
        short, longer = (_timed_cut(model, repeats, k, x, labels, optimizer, clock) for k in TIME_CUTS)
    except CUT_FAILURES:  # the forward needs all its blocks
        return None
    if any(longer[p] <= short[p] for p in PHASES):
        return None
    per_block = {p: (longer[p] - short[p]) / (TIME_CUTS[1] - TIME_CUTS[0]) for p in PHASES}
    return {p: longer[p] + (repeats.count - TIME_CUTS[1]) * per_block[p] for p in PHASES}


def _timed_cut(model, repeats, k: int, x, labels, optimizer: str, clock) -> Dict[str, float]:
    with cut(model, repeats, k):
        return timed_step(model, x, labels, optimizer, clock)


def local_correction(profile: ModelProfile, work: Work, hw: HardwareProfile, optimizer: str) -> Dict[str, float]:
    """Measured / modelled seconds per phase of the unsharded step at the example input's size,
    timed here with one thread (as each rank runs): composed from the model cut to a few repeats where it is made
    of them (:func:`composed_step`), else the whole step; cached on the profile per hardware profile."""
    cache = profile.__dict__.setdefault("_step_correction", {})
    key = (json.dumps(hw.to_dict(), sort_keys=True), optimizer)
    if key in cache:
        return cache[key]
    model, n, t = profile.model, profile.example_input.shape[1], profile.example_input.shape[0]
    x, y = batch_slice(profile.example_input, profile.labels, n, t, layout=profile.layout)
    x = x.to(profile.dtype)
    with one_thread(), collector_paused():  # no collection timed as a step
        times = composed_step(model, x, y, optimizer) or timed_step(model, x, y, optimizer)
    itemsize = profile.compute_itemsize
    cache[key] = {p: times[p] / max(work.phase(p).seconds(hw, n, t, itemsize), 1e-9) for p in PHASES}
    return cache[key]
