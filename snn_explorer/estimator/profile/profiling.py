"""The one-off measurement of the unsharded model that every estimate reuses.

The model (a private copy) runs a forward and backward on the CPU at four small sizes
``(N, T)`` (two batch sizes by two time steps, :data:`SIZES`). Per module it records the bytes saved for
backward (``torch.autograd.graph.saved_tensors_hooks``, each storage counted once and charged to
the innermost module running when it was saved; parameters, buffers, the input batch and
neuron state excluded), the neuron state left in each stateful module after the forward, the
forward calls and input/output sizes, and the order in which gradients become ready. Each
quantity is fitted bilinearly in ``N`` and ``T`` (:class:`Fit`), which is exact for models whose
tensors grow linearly in batch and in time, and evaluated at a plan's per-rank batch.

The peak of a step is a maximum over time, not linear in ``N`` and ``T``: it is measured
(:class:`~.meter.StorageMeter`; forward, backward and what is left after it) once per per-rank
batch that is asked for, at that size, and cached with the rest. A tensor-parallel rank runs a
different model, so for TP plans the peak, saved bytes and neuron state are measured the same way
on :func:`~.tp_replica.tp_replica` (the model with each rank's local layer shapes), once per TP
layout and size. Everything runs on CPU tensors: the saved-tensor and state sizes of
snntorch/spikingjelly neurons come from executing them.

A model this machine cannot hold (on the ``meta`` device, or whose copy and gradients would not fit
in its memory) is profiled shape-only (:mod:`.shape_only`): the same runs, on FakeTensors, with
the same numbers; so is any run whose size would not fit (:func:`run_fits`).
"""
from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from ...core.common import FP32, Precision
from ...core.model import (
    TIME_MAJOR,
    DataLayout,
    detached_copy,
    fsdp_units,
)
from ...core.parallelize import autocast_forward, hold_neuron_state, norm_layer_paths
from ..instruments.isolation import as_found, one_thread
from ..instruments.progress_hook import ProgressHook, check_hook
from ..instruments.storage import state_tensor_ids
from .profile_runs import cut_logged_run, cut_saved_run, profile_runs, run_point
from .repeats import Repeats, find_repeats
from .shape_only import has_meta_tensors, meta_copy, step_runner
from .step import RUN_LAYOUT, batch_slice, check_inputs, input_as, run_dtypes
from .tp_replica import tp_replica

#: The per-rank batches and time steps the profile runs the model at, to fit each figure over (N, T).
FIT_BATCHES, FIT_STEPS = (2, 4), (2, 3)
SIZES = tuple((n, t) for t in FIT_STEPS for n in FIT_BATCHES)


@dataclass(frozen=True)
class Fit:
    """``value(N, T) = c0 + c1 * N + c2 * T + c3 * N * T``, exact through the four :data:`SIZES`."""

    c0: float = 0.0
    c1: float = 0.0
    c2: float = 0.0
    c3: float = 0.0

    @classmethod
    def of(cls, v11: float, v21: float, v12: float, v22: float) -> "Fit":
        (n1, n2), (t1, t2) = FIT_BATCHES, FIT_STEPS
        c3 = (v22 - v21 - v12 + v11) / ((n2 - n1) * (t2 - t1))
        c1 = (v21 - v11) / (n2 - n1) - c3 * t1
        c2 = (v12 - v11) / (t2 - t1) - c3 * n1
        return cls(v11 - c1 * n1 - c2 * t1 - c3 * n1 * t1, c1, c2, c3)

    def __call__(self, n: int, t: int) -> float:
        return max(0.0, self.c0 + self.c1 * n + self.c2 * t + self.c3 * n * t)


@dataclass(frozen=True)
class ModuleProfile:
    """What one module did in the forward: saved bytes, neuron state, calls and sizes."""

    saved: Fit
    state: Fit
    calls: Fit
    in_elems: Fit
    out_elems: Fit
    input_requires_grad: bool
    in_itemsize: int = 0  # bytes per element of its first input (a TP input gradient is reduced in its dtype)


@dataclass
class ModelProfile:
    """The fitted one-off measurement; ``modules`` by path ('' is the root and the loss).

    The peak of a step (:func:`~..memory.step_peak.dynamic_peak`) is the one quantity that is not
    linear in batch and time (a maximum over the step): it is measured once per ``(N, T)`` asked
    for, on the private model copy (:meth:`logged_run`).
    """

    modules: Dict[str, ModuleProfile]
    input_bytes: Fit
    grad_ready_order: Tuple[str, ...]
    dtype: torch.dtype
    params: tuple = ()  # (name, shape) of the trainable parameters (:func:`trainable_shapes`)
    param_itemsizes: Mapping[str, int] = field(default_factory=dict)  # bytes per element, by parameter name
    buffers: tuple = ()  # the buffers other than neuron state (:func:`plain_buffers`)
    model: nn.Module = field(repr=False, default=None)
    example_input: torch.Tensor = field(repr=False, default=None)
    labels: Optional[torch.Tensor] = field(repr=False, default=None)
    fsdp_units: Tuple[str, ...] = ()  # the units FSDP2 plans shard (``core.plans.families.fsdp_units``)
    #: norm layers FSDP2 makes units of their own under half precision (``core.parallelize.fsdp.norm_layer_paths``)
    norm_layers: Tuple[str, ...] = ()
    peaks: Dict[tuple, Tuple[int, int, int, int]] = field(default_factory=dict, repr=False)
    logs: Dict[tuple, dict] = field(default_factory=dict, repr=False)  # per size and layout: one logged run
    replicas: Dict[tuple, nn.Module] = field(default_factory=dict, repr=False)
    saved_state: Dict[tuple, Tuple[float, float]] = field(default_factory=dict, repr=False)
    stage_memory: Dict[tuple, list] = field(default_factory=dict, repr=False)  # :func:`.stage_memory.measure_stages`
    #: per size of :data:`SIZES`, the operator counts of a forward and backward of ``model``
    #: (by :class:`~.op_counter.OpCounter`s around the profile runs themselves); () where not counted
    step_counts: tuple = field(default=(), repr=False)
    grad_params: Tuple[str, ...] = ()  # the parameters a backward gives a gradient
    #: where N and T sit in the model's input and output; ``example_input`` is kept time-major
    #: ``[T, N, ...]`` whatever it is, and :func:`~.step.batch_slice` cuts batches in this layout
    layout: DataLayout = TIME_MAJOR
    #: the precision the model ran in (autocast, neuron state), as ``apply`` runs a plan of it
    precision: Precision = FP32
    #: measured on FakeTensors (:mod:`.shape_only`); ``model`` is then a copy on the meta device
    shape_only: bool = False
    #: measured with the parameters in the compute dtype, as FSDP2 gathers them (:func:`precision_profile`)
    gathered: bool = False
    #: the repeated blocks whose records were composed from runs cut to a few of them (:mod:`.repeats`), or None
    composed: Optional[Repeats] = None
    #: :func:`run_fits`' sums over ``modules`` per ``(n, t)``, each beside the ``modules`` it was summed over
    fitted_sums: Dict[tuple, tuple] = field(default_factory=dict, repr=False, compare=False)

    @property
    def compute_itemsize(self) -> int:
        """Bytes per element the layers compute and communicate activations in (2 under bf16 / fp16)."""
        return self.precision.itemsize("compute", self.dtype)

    def rank_model(self, tp_plan: Optional[Mapping[str, str]], tp: int) -> Tuple[tuple, nn.Module]:
        """The model one rank runs: the private copy, or its TP replica for ``tp_plan``."""
        layout = tuple(sorted(tp_plan.items())) if tp > 1 else ()
        if tp > 1 and (layout, tp) not in self.replicas:
            self.replicas[(layout, tp)] = tp_replica(self.model, dict(layout), tp)
        return (layout, tp), self.replicas[(layout, tp)] if tp > 1 else self.model

    def meta_model(self, tp_plan: Optional[Mapping[str, str]], tp: int) -> nn.Module:
        """A copy of the model one rank runs on the meta device, for the GPU trace to run and change."""
        return detached_copy(self.rank_model(tp_plan, tp)[1]).to("meta")

    def runner(self, tp_plan: Optional[Mapping[str, str]], tp: int, shape_only: bool):
        """The context in which the model one rank runs is run: ``(model, convert inputs)``, on
        FakeTensors with ``shape_only`` (:func:`~.shape_only.step_runner`)."""
        return step_runner(self.rank_model(tp_plan, tp)[1], shape_only)

    def _run(self, n: int, t: int, tp_plan, tp: int, saved_only: bool, units: Sequence[str] = ()) -> dict:
        x, y = batch_slice(self.example_input, self.labels, n, t, layout=self.layout)
        with self.runner(tp_plan, tp, self.shape_only or not run_fits(self, n, t)) as (run_model, convert):
            x, y = convert(input_as(x, self.dtype)), convert(y)
            composed = None
            if self.composed is not None:
                composed = cut_saved_run(run_model, x, y) if saved_only else \
                    cut_logged_run(run_model, x, y, units, self.log_repeats(tp_plan, tp))
            return composed or run_point(run_model, x, y, saved_only=saved_only, units=units)

    def logged_run(self, n: int, t: int, tp_plan: Optional[Mapping[str, str]], tp: int, units=()) -> dict:
        """The run of ``n`` samples and ``t`` steps of the model one rank runs, with its storage meter
        logged at the points FSDP2 acts for ``units`` (and the units logged before): run once per
        size and layout, again only when it lacks a unit (:func:`~..instruments.fsdp_events.record`)."""
        key = (n, t) + self.rank_model(tp_plan, tp)[0]
        if key not in self.logs or not set(units) <= set(self.logs[key]["log"].units):
            logged = set(self.logs[key]["log"].units) if key in self.logs else set(self.fsdp_units)
            self.logs[key] = self._run(n, t, tp_plan, tp, saved_only=False, units=sorted(logged | set(units)))
        return self.logs[key]

    def repeat_cuts(self, tp_plan: Optional[Mapping[str, str]], tp: int) -> Optional[Tuple[Repeats, tuple]]:
        """``(repeats, cut sizes)`` a lever variant's rank model is counted on (its regions' stride,
        ``.checkpointed.lever_cuts``); None here: the rank model's own repeats at the default cuts."""
        return None

    def log_repeats(self, tp_plan: Optional[Mapping[str, str]], tp: int) -> Optional[Repeats]:
        """The repeats a lever variant's logged run is composed over (``.checkpointed.lever_log_repeats``); None
        here: the rank model's own."""
        return None

    def saved_and_state(self, n: int, t: int, tp_plan: Optional[Mapping[str, str]] = None,
                        tp: int = 1) -> Tuple[float, float]:
        """Bytes saved for backward and of neuron state after a forward of ``n`` samples, ``t``
        steps: from the fits, or for ``tp > 1`` measured on the TP replica (once per size)."""
        key = (n, t) + self.rank_model(tp_plan, tp)[0]
        if key not in self.saved_state:
            if tp == 1:
                self.saved_state[key] = (sum(m.saved(n, t) for m in self.modules.values()),
                                         sum(m.state(n, t) for m in self.modules.values()))
            else:
                run = self._run(n, t, tp_plan, tp, saved_only=True)
                self.saved_state[key] = (float(sum(run["saved"].values())), float(sum(run["state"].values())))
        return self.saved_state[key]


def trainable_shapes(model: nn.Module) -> Tuple[Tuple[str, Tuple[int, ...]], ...]:
    """``(name, shape)`` of every trainable parameter of the unsharded model."""
    return tuple((n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad)


def plain_buffers(model: nn.Module) -> tuple:
    """``(name, shape, is_floating, element_size)`` of the buffers other than neuron state."""
    state = state_tensor_ids(model)
    return tuple((n, tuple(b.shape), b.is_floating_point(), b.element_size())
                 for n, b in model.named_buffers() if id(b) not in state)


def _physical_memory() -> Optional[int]:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


#: The most operators (forward and backward) a shape-only run of one step may take, so that such a run stays within
#: minutes at FakeTensorMode's cost per operator on a CPU (benchmarks/results/llm_first_estimate.md; multi-step
#: neurons loop over a plan's time steps in Python).
MAX_SHAPE_ONLY_OPS = 500_000


def run_fits(profile: ModelProfile, n: int, t: int) -> bool:
    """Whether a real run of ``n`` samples and ``t`` steps fits in this machine's memory (from the
    fitted input, saved-activation and neuron-state bytes, twice for the backward, and the model);
    where it does not, it runs shape-only. ValueError, before anything runs, where that shape-only
    run would take longer than :data:`MAX_SHAPE_ONLY_OPS` operators."""
    need, have = _fitted_need(profile, n, t), _physical_memory()
    fits = have is None or need <= have
    if fits and not profile.shape_only:
        return True
    ops = fitted_ops(profile, n, t)
    if ops > MAX_SHAPE_ONLY_OPS:
        raise ValueError(f"time_steps={t} with {n} samples per rank would need about {need / 2 ** 30:.1f} GiB to "
                         f"measure on this machine's CPU, which has {(have or 0) / 2 ** 30:.1f} GiB, and a shape-only run "
                         f"would take about {ops:.3g} operators (more than {MAX_SHAPE_ONLY_OPS}); use fewer "
                         "time_steps (the step's memory grows linearly in them)")
    return fits and not profile.shape_only


def _fitted_need(profile: ModelProfile, n: int, t: int) -> float:
    """:func:`run_fits`' bytes of a real run: the fitted input, saved and state bytes twice, the parameters twice
    (summed once per size and the ``modules``, ``params``, itemsizes and input it read, by identity: a lever
    variant's profile has its own ``modules``)."""
    summed = profile.fitted_sums.get((n, t))
    read = (profile.modules, profile.params, profile.param_itemsizes, profile.example_input)  # by identity
    if summed is None or any(a is not b for a, b in zip(summed[0], read)):
        fitted = profile.input_bytes(n, t) + sum(m.saved(n, t) + m.state(n, t) for m in profile.modules.values())
        summed = profile.fitted_sums[(n, t)] = (read, 2 * fitted + 2 * _param_bytes(profile))
    return summed[1]


def _param_bytes(profile: ModelProfile) -> int:
    return sum(math.prod(shape) * profile.param_itemsizes.get(name, 4) for name, shape in profile.params)


def fitted_ops(profile: ModelProfile, n: int, t: int) -> float:
    """The operators of one step (forward and backward) as run here, fitted over the profile's sizes."""
    return _fit_ops(profile, 0)(n, t) + _fit_ops(profile, 1)(n, t)


def _fit_ops(profile: ModelProfile, phase: int) -> Fit:
    """The operator count of one phase (0 forward, 1 backward) fitted over the profile's sizes."""
    if not profile.step_counts:
        return Fit()
    return Fit.of(*(float(point[phase][3]) for point in profile.step_counts))


def _holds_copy(model: nn.Module) -> bool:
    """Whether a real copy of ``model`` and its gradients fit in this machine's memory (twice its tensors)."""
    have = _physical_memory()
    size = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    return have is None or 2 * size <= have


def _fit(points, get) -> Fit:
    return Fit.of(*(float(get(p)) for p in points))


#: The per-module records :func:`_module_profiles` fits, in :class:`ModuleProfile`'s order.
_FITTED = ("saved", "state", "calls", "ins", "outs")


def _module_profiles(points: list) -> Dict[str, ModuleProfile]:
    """Each module's :class:`ModuleProfile` from the runs at :data:`SIZES`; modules with the same records (the
    blocks of a repeated chain) share one (frozen) object, fitted once."""
    names = set().union(*(p["calls"] for p in points), *(p["saved"] for p in points))
    alike: Dict[tuple, ModuleProfile] = {}
    modules = {}
    for name in names:
        fitted = tuple(tuple(float(p[record].get(name, 0)) for p in points) for record in _FITTED)
        key = fitted + (any(p["rg"].get(name, False) for p in points), points[-1]["isz"].get(name, 0))
        if key not in alike:
            alike[key] = ModuleProfile(*(Fit.of(*values) for values in key[:len(_FITTED)]),
                                       input_requires_grad=key[-2], in_itemsize=key[-1])
        modules[name] = alike[key]
    return modules


def measure_profile(model: nn.Module, example_input: torch.Tensor, labels: Optional[torch.Tensor] = None,
                    dtype: Optional[torch.dtype] = None, layout: DataLayout = TIME_MAJOR,
                    precision: Precision = FP32, gathered: bool = False,
                    on_progress: Optional[ProgressHook] = None, shape_only: Optional[bool] = None,
                    repeats: bool = True) -> ModelProfile:
    """Run a copy of ``model`` unsharded at :data:`SIZES` and fit the profile (see the module doc);
    ``example_input`` in ``layout``, which every run of the copy takes its batches in. The copy runs in
    ``precision`` as ``apply`` runs it (autocast around the forward, neurons in the state dtype), with
    ``gathered`` its parameters in the compute dtype (see :func:`precision_profile`). ``on_progress(done,
    total, label)`` hears each size run. ``shape_only`` (default: where ``model`` has meta tensors or a
    copy of it would not fit here) runs on FakeTensors (:mod:`.shape_only`), the copy kept on the meta device.
    With ``repeats``, a model made mostly of repeated blocks runs cut to a few of them and the whole
    model's records are composed from those runs (:mod:`.repeats`: exact; in full where they disagree)."""
    check_inputs(model, example_input, labels, dtype, layout=layout)
    cast, dtype = run_dtypes(model, dtype, example_input)
    example_input = layout.to_time_major(example_input)
    if shape_only is None:
        shape_only = has_meta_tensors(model) or not _holds_copy(model)
    model = (meta_copy(model) if shape_only else detached_copy(model)).train()
    setattr(model, RUN_LAYOUT, layout)
    if cast is not None:
        model.to(cast)
    if gathered and precision.mixed:
        _cast_gathered(model, precision)
    hold_neuron_state(model, precision, "cpu")
    autocast_forward(model, precision, "cpu")
    with step_runner(model, shape_only) as (run_model, convert):
        by_size, grad_names_, composed = profile_runs(run_model, convert, example_input, labels, dtype, layout,
                                                      SIZES, on_progress,
                                                      find_repeats(run_model) if repeats else None)
    points = [by_size[size] for size in SIZES]
    return ModelProfile(modules=_module_profiles(points), input_bytes=_fit(points, lambda p: p["input"]),
                        grad_ready_order=points[-1]["order"], dtype=dtype,
                        params=trainable_shapes(model), buffers=plain_buffers(model), fsdp_units=fsdp_units(model),
                        norm_layers=norm_layer_paths(model),
                        param_itemsizes={n: p.element_size() for n, p in model.named_parameters()},
                        model=model, example_input=example_input, labels=labels,
                        step_counts=tuple(p["counts"] for p in points), grad_params=grad_names_,
                        layout=layout, precision=precision, shape_only=shape_only,
                        gathered=gathered and precision.mixed, composed=composed)


def _cast_gathered(model: nn.Module, precision: Precision) -> None:
    """``model``'s parameters as FSDP2 gathers them under ``precision``: in its param dtype, but the norm
    layers' (their own units, gathered in their own dtype: ``core.parallelize.fsdp``)."""
    norms = {id(p) for path in norm_layer_paths(model) for p in model.get_submodule(path).parameters(recurse=False)}
    with torch.no_grad():
        for param in model.parameters():
            if id(param) not in norms:
                param.data = param.data.to(precision.param_dtype)


#: Profiles per live model object (a weak key: a freed model's id can be reused by a new one).
_CACHE: "weakref.WeakKeyDictionary[nn.Module, Dict[tuple, ModelProfile]]" = weakref.WeakKeyDictionary()


def _key(model: nn.Module, example_input: torch.Tensor, labels, dtype, layout: DataLayout) -> tuple:
    shapes = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters())
    return (shapes, tuple(example_input.shape[2:]), example_input.dtype, labels is None, dtype, layout)


def model_profile(model: nn.Module, example_input: torch.Tensor, labels: Optional[torch.Tensor] = None,
                  dtype: Optional[torch.dtype] = None, layout: DataLayout = TIME_MAJOR,
                  on_progress: Optional[ProgressHook] = None, shape_only: Optional[bool] = None) -> ModelProfile:
    """:func:`measure_profile`, cached per model object, parameter shapes, sample shape, dtype, layout
    and ``shape_only`` (None: chosen as :func:`measure_profile` chooses); ``on_progress(done, total,
    label)`` (:mod:`~..instruments.progress_hook`) hears each run when it measures."""
    check_inputs(model, example_input, labels, dtype, layout=layout)
    check_hook(on_progress)
    per_model = _CACHE.setdefault(model, {})
    key = _key(model, example_input, labels, dtype, layout) + (shape_only,)
    if key not in per_model:
        with as_found(), one_thread():  # the runs draw random numbers (dropout) and may import torch's compiler
            per_model[key] = measure_profile(model, example_input, labels, dtype, layout, on_progress=on_progress,
                                             shape_only=shape_only)
    return per_model[key]


def precision_profile(profile: ModelProfile, precision: Precision, gathered: bool = False) -> ModelProfile:
    """``profile``'s model measured again in ``precision`` (``profile`` itself when it ran in it), cached
    on ``profile``: activations, neuron state, peaks and operator counts at the dtypes a rank of such a
    plan runs them in. ``gathered``: as FSDP2's ``MixedPrecisionPolicy`` runs it, the parameters the
    forward uses (and their unsharded gradients) in the compute dtype, so autocast copies none of them;
    ``param_itemsizes`` stay the fp32 master copies'."""
    gathered = gathered and precision.mixed
    if profile.precision == precision and profile.gathered == gathered:
        return profile
    if profile.precision != FP32 or profile.gathered:
        raise ValueError(f"a profile measured in {profile.precision} (gathered={profile.gathered}) is not measured "
                         f"again in {precision} (gathered={gathered}); start from the fp32 one (model_profile)")
    cache = profile.__dict__.setdefault("_precision_profiles", {})
    if (precision, gathered) not in cache:
        example = profile.layout.from_time_major(profile.example_input)  # the profile keeps it time-major
        measured = measure_profile(profile.model, example, profile.labels, profile.dtype, profile.layout,
                                   precision, gathered)
        measured.param_itemsizes = dict(profile.param_itemsizes)
        cache[precision, gathered] = measured
    return cache[precision, gathered]


def plan_profile(model: nn.Module, example_input: torch.Tensor, labels: Optional[torch.Tensor] = None,
                 dtype: Optional[torch.dtype] = None, layout: DataLayout = TIME_MAJOR, precision: Precision = FP32,
                 gathered: bool = False, on_progress: Optional[ProgressHook] = None) -> ModelProfile:
    """The profile an estimate of a plan in ``precision`` (``gathered``: FSDP2's) reads: the cached
    :func:`model_profile` itself for fp32; else :func:`precision_profile` of it where that is cached, and
    otherwise measured in ``precision`` directly from ``model`` (the same runs, without first measuring the
    fp32 profile, which such an estimate would not read), cached per model as :func:`model_profile` caches."""
    gathered = gathered and precision.mixed
    if precision == FP32 and not gathered:
        return model_profile(model, example_input, labels, dtype, layout, on_progress=on_progress)
    check_inputs(model, example_input, labels, dtype, layout=layout)
    check_hook(on_progress)
    per_model = _CACHE.setdefault(model, {})
    key = _key(model, example_input, labels, dtype, layout) + (None,)
    if key in per_model:
        return precision_profile(per_model[key], precision, gathered)
    own_key = key + (precision, gathered)
    if own_key not in per_model:
        cast, run_dtype = run_dtypes(model, dtype, example_input)
        with as_found(), one_thread():
            measured = measure_profile(model, example_input, labels, run_dtype, layout, precision, gathered,
                                       on_progress=on_progress)
        measured.param_itemsizes = {n: _itemsize_as_run(p, cast) for n, p in model.named_parameters()}
        per_model[own_key] = measured
    return per_model[own_key]


def _itemsize_as_run(param: torch.Tensor, cast: Optional[torch.dtype]) -> int:
    """Bytes per element of ``param`` in the fp32 profile's copy: cast to ``cast`` there where floating."""
    if cast is None or not param.is_floating_point():
        return param.element_size()
    return torch.empty((), dtype=cast).element_size()
