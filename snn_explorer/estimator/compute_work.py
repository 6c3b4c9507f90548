"""The compute work of one training step as a rank runs it: FLOPs, bytes moved and operators.

A dispatch mode counts every operator of the forward (with the loss), the backward and the
optimizer step of the model one rank runs (the unsharded model, or its TP replica with each
rank's local layer shapes), at the profile's four sizes ``(N, T)``: FLOPs by the formulas of
torch's ``FlopCounterMode``, bytes as the sizes of each operator's tensor inputs and outputs,
and the operator count. Each is fitted bilinearly in ``N`` and ``T`` (the profile's :class:`Fit`)
and so scales to a plan's per-rank batch and time steps. :meth:`Work.seconds` turns a phase into
time on a :class:`~.hardware.HardwareProfile` by a roofline: ``max(flops / flop_rate,
bytes_of_flop_ops / bandwidth) + other_bytes / bandwidth + ops * op_overhead``.

On the machine a profile was calibrated on, :func:`local_correction` also times the real step of
the unsharded model once (at the example input's size, one thread as a rank runs) and returns
the ratio of measured to modelled time per phase, which the step-time model applies there.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from typing import Dict

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..compat import TorchDispatchMode
from ._step import OPTIMIZERS, batch_slice, forward_loss
from .hardware import HardwareProfile
from .profile import SIZES, Fit, ModelProfile

PHASES = ("forward", "backward", "optimizer")
_FLOP_FORMULAS = FlopCounterMode(display=False).flop_registry


def _nbytes(values) -> int:
    """Bytes of the tensors in an operator's arguments or outputs (nested tuples, lists, dicts).

    A plain recursion: aten operators take and return only these containers, and pytree's
    generic flattening cost most of the counting time on deep models."""
    if isinstance(values, torch.Tensor):
        return values.numel() * values.element_size()
    if isinstance(values, (tuple, list)):
        return sum(_nbytes(v) for v in values)
    if isinstance(values, dict):
        return sum(_nbytes(v) for v in values.values())
    return 0


class _Counter(TorchDispatchMode):
    """Per operator: FLOPs (torch's formulas), bytes of its tensors, and one operator."""

    def __init__(self):
        super().__init__()
        self.counts = [0.0, 0.0, 0.0, 0.0]  # flops, bytes of ops with FLOPs, other bytes, ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = _FLOP_FORMULAS.get(func.overloadpacket)
        moved = _nbytes((args, kwargs, out))
        if formula is not None:
            self.counts[0] += formula(*args, **kwargs, out_val=out)
            self.counts[1] += moved
        else:
            self.counts[2] += moved
        self.counts[3] += 1
        return out


@dataclass(frozen=True)
class PhaseWork:
    """One phase's work, each a :class:`Fit` in ``(N, T)``."""

    flops: Fit
    flop_bytes: Fit
    other_bytes: Fit
    ops: Fit

    def seconds(self, hw: HardwareProfile, n: int, t: int, itemsize: int, scale: float = 1.0,
                op_scale: float = 1.0) -> float:
        """Roofline time of this phase for ``n`` samples and ``t`` steps; ``scale`` multiplies FLOPs and
        bytes, ``op_scale`` the operator launches (a pipeline stage: its share, once per micro-batch)."""
        bw = hw.bandwidth()
        matmul = max(self.flops(n, t) * scale / hw.flops(itemsize), self.flop_bytes(n, t) * scale / bw)
        return matmul + self.other_bytes(n, t) * scale / bw + self.ops(n, t) * op_scale * hw.op_overhead_s


@dataclass(frozen=True)
class Work:
    """The forward, backward and optimizer work of the model one rank runs; ``param_bytes`` its parameters."""

    forward: PhaseWork
    backward: PhaseWork
    optimizer: PhaseWork
    param_bytes: int

    def phase(self, name: str) -> PhaseWork:
        return getattr(self, name)


def _count_step(model, x, y, opt=None) -> list:
    """Counts of the forward and the backward (and of ``opt``'s step when given)."""
    out = []
    with _Counter() as c:
        loss = forward_loss(model, x, y)
    out.append(c.counts)
    with _Counter() as c:
        loss.backward()
    out.append(c.counts)
    if opt is not None:
        with _Counter() as c:
            opt.step()
        out.append(c.counts)
    model.zero_grad(set_to_none=True)
    return out


def count_work(model: torch.nn.Module, profile: ModelProfile, optimizer: str) -> Work:
    """Count the step of ``model`` (the model one rank runs) at the profile's :data:`SIZES` and fit it."""
    cls, kw = OPTIMIZERS[optimizer]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = cls(params, lr=1e-6, **kw)
    points = []
    with torch.no_grad():
        saved = [p.detach().clone() for p in params]
    try:
        for n, t in SIZES:
            x, y = batch_slice(profile.example_input, profile.labels, n, t)
            points.append(_count_step(model, x.to(profile.dtype), y))
        forward_loss(model, x.to(profile.dtype), y).backward()
        opt.step()  # the optimizer creates its state here; its work does not depend on N or T
        step = _count_step(model, x.to(profile.dtype), y, opt)[2]
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
    phases = [PhaseWork(*(Fit.of(*(pt[i][k] for pt in points)) for k in range(4))) for i in range(2)]
    return Work(*phases, PhaseWork(*(Fit(c0=v) for v in step)), param_bytes=sum(p.numel() * p.element_size() for p in params))


def rank_work(profile: ModelProfile, tp_plan, tp: int, optimizer: str) -> Work:
    """:func:`count_work` of the model one rank of a plan runs, cached on the profile per TP layout."""
    cache = profile.__dict__.setdefault("_step_work", {})
    layout, model = profile._rank_model(tp_plan, tp)
    key = (layout, optimizer)
    if key not in cache:
        cache[key] = count_work(model, profile, optimizer)
    return cache[key]


def local_correction(profile: ModelProfile, work: Work, hw: HardwareProfile, optimizer: str) -> Dict[str, float]:
    """Measured / modelled seconds per phase of the unsharded step at the example input's size,
    timed here with one thread (as each rank runs); cached on the profile per hardware profile."""
    cache = profile.__dict__.setdefault("_step_correction", {})
    key = (json.dumps(hw.to_dict(), sort_keys=True), optimizer)
    if key in cache:
        return cache[key]
    model, n, t = profile.model, profile.example_input.shape[1], profile.example_input.shape[0]
    x, y = batch_slice(profile.example_input, profile.labels, n, t)
    x = x.to(profile.dtype)
    cls, kw = OPTIMIZERS[optimizer]
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        saved = [p.detach().clone() for p in params]
    opt = cls(params, lr=1e-6, **kw)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times = {p: [] for p in PHASES}
    try:
        for _ in range(3):
            start = time.perf_counter()
            loss = forward_loss(model, x, y)
            mid = time.perf_counter()
            loss.backward()
            end = time.perf_counter()
            opt.step()
            times["optimizer"].append(time.perf_counter() - end)
            times["forward"].append(mid - start)
            times["backward"].append(end - mid)
            opt.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
    itemsize = torch.empty((), dtype=profile.dtype).element_size()
    cache[key] = {p: statistics.median(times[p][1:]) / max(work.phase(p).seconds(hw, n, t, itemsize), 1e-9)
                  for p in PHASES}
    return cache[key]
