"""The profile of a plan with activation checkpointing: the one-off profile's model, checkpointed as the plan says.

A checkpointed block keeps only its inputs and a copy of its neurons' entry state, and its backward
runs the forward again first, which adds that block's activations to the backward for a while. Both
are measured like everything else the profile measures: on the model as one rank runs it (the private
copy, or its TP replica), here with :mod:`~snn_explorer.core.parallelize.checkpointing` applied to a
copy made new only along the modules checkpointing changes (the rest shared with the plain rank model,
``core.module_copy.copy_along``), once per size and layout. The FLOPs torch's ``FlopCounterMode`` counts for
a forward and backward with and without checkpointing give the recompute cost as a fraction of one forward.
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ...core.common import Checkpointing, new_objects_collected
from ...core.model import copy_along, detached_copy
from ...core.parallelize import apply_activation_checkpointing, checkpointed_paths, region_starts
from ..instruments.meter import StorageMeter
from ..instruments.storage import model_state_tensors, state_tensor_ids, total_bytes
from .profiling import ModelProfile, precision_profile
from .repeats import Repeats, find_repeats
from .repeats_totals import affine_total, stride_cuts, strided_repeats
from .shape_only import step_runner
from .step import batch_slice, forward_loss, input_as


@dataclass
class CheckpointedProfile(ModelProfile):
    """A :class:`ModelProfile` whose rank models are checkpointed as ``plan`` says (``plan``: any plan with
    activation checkpointing; only its granularity, k and time-step module are read)."""

    plan: object = None
    checkpointed: Dict[tuple, nn.Module] = field(default_factory=dict, repr=False)
    flops: Dict[tuple, float] = field(default_factory=dict, repr=False)
    #: (forward, step) FLOPs of the plain rank model per size and layout: the same for every granularity, so
    #: :func:`levered_profile` gives all checkpointed profiles of one profile one dict
    plain_flops: Dict[tuple, Tuple[float, float]] = field(default_factory=dict, repr=False)
    #: the per-chunk work of time chunks (``..timing.chunk_work``), per layout: the same for every chunk size, so
    #: shared as ``plain_flops`` is
    chunk_figures: Dict[tuple, list] = field(default_factory=dict, repr=False)
    #: the profile this one checkpoints (its model's step is the one the local timing correction is read from)
    unlevered: Optional[ModelProfile] = field(default=None, repr=False, compare=False)

    def rank_model(self, tp_plan: Optional[Mapping[str, str]], tp: int) -> Tuple[tuple, nn.Module]:
        key, model = super().rank_model(tp_plan, tp)
        if key not in self.checkpointed:
            # new only where checkpointing changes forwards or adds hooks, the rest shared with the plain rank model
            # (a whole copy takes seconds on a model of thousands of modules)
            copy_ = copy_along(model, checkpointed_paths(model, self.plan, self.fsdp_units))
            apply_activation_checkpointing(copy_, self.plan, self.fsdp_units)
            self.checkpointed[key] = copy_
        return key, self.checkpointed[key]

    def repeat_cuts(self, tp_plan: Optional[Mapping[str, str]], tp: int) -> Optional[Tuple[Repeats, tuple]]:
        """The plain rank model's repeats, cut at the stride of the checkpointed regions (:func:`lever_cuts`)."""
        return lever_cuts(self, self.plan, tp_plan, tp)

    def log_repeats(self, tp_plan: Optional[Mapping[str, str]], tp: int) -> Optional[Repeats]:
        """The plain rank model's repeats at the stride of the checkpointed regions (:func:`lever_log_repeats`)."""
        return lever_log_repeats(self, self.plan, tp_plan, tp)

    def meta_model(self, tp_plan: Optional[Mapping[str, str]], tp: int) -> nn.Module:
        """As :meth:`ModelProfile.meta_model`, the checkpointing applied to the meta copy of the plain rank
        model (a copy of a checkpointed model would run the original's modules, as :meth:`runner` says)."""
        model = detached_copy(super().rank_model(tp_plan, tp)[1]).to("meta")
        apply_activation_checkpointing(model, self.plan, self.fsdp_units)
        return model

    @contextlib.contextmanager
    def runner(self, tp_plan: Optional[Mapping[str, str]], tp: int, shape_only: bool):
        """As :meth:`ModelProfile.runner`; shape-only, the checkpointing is applied to the fake copy of the
        plain rank model (a checkpointed model's forwards close over its own modules: a copy of it would
        run the originals)."""
        if not shape_only:
            yield self.rank_model(tp_plan, tp)[1], lambda x: x
            return
        with step_runner(super().rank_model(tp_plan, tp)[1], True) as (model, convert):
            apply_activation_checkpointing(model, self.plan, self.fsdp_units)
            yield model, convert

    def saved_and_state(self, n: int, t: int, tp_plan: Optional[Mapping[str, str]] = None,
                        tp: int = 1) -> Tuple[float, float]:
        """Bytes a forward leaves for the backward (the checkpointed blocks' inputs and entry-state copies,
        what runs outside them) and of neuron state: measured on the checkpointed model, once per size."""
        key = (n, t) + self.rank_model(tp_plan, tp)[0]
        if key not in self.saved_state:
            x, y = batch_slice(self.example_input, self.labels, n, t, layout=self.layout)
            with self.runner(tp_plan, tp, self.shape_only) as (model, convert):
                x, y = convert(input_as(x, self.dtype)), convert(y)
                self.saved_state[key] = run_total(self, self.plan, tp_plan, tp, model,
                                                  lambda m: held_after_forward(m, x, y))
        return self.saved_state[key]

    def recompute_fraction(self, n: int, t: int, tp_plan: Optional[Mapping[str, str]] = None, tp: int = 1) -> float:
        """The FLOPs the recompute adds to a step, as a fraction of one forward's (``FlopCounterMode``'s count:
        matrix products and convolutions; 0.0 for a model without them)."""
        key = (n, t) + self.rank_model(tp_plan, tp)[0]
        if key not in self.flops:
            x, y = batch_slice(self.example_input, self.labels, n, t, layout=self.layout)
            x = input_as(x, self.dtype)
            if key not in self.plain_flops:
                with step_runner(super().rank_model(tp_plan, tp)[1], self.shape_only) as (plain, convert):
                    xc, yc = convert(x), convert(y)
                    self.plain_flops[key] = run_total(self, None, tp_plan, tp, plain, lambda m: _flops(m, xc, yc))
            forward, plain_step = self.plain_flops[key]
            with self.runner(tp_plan, tp, self.shape_only) as (checkpointed, convert):
                xc, yc = convert(x), convert(y)
                _, checkpointed_step = run_total(self, self.plan, tp_plan, tp, checkpointed,
                                                 lambda m: _flops(m, xc, yc))
            self.flops[key] = (checkpointed_step - plain_step) / forward if forward else 0.0
        return self.flops[key]


def run_total(profile: ModelProfile, plan, tp_plan: Optional[Mapping[str, str]], tp: int, model: nn.Module,
              measure: Callable[[nn.Module], Tuple[float, ...]], largest: int = 0) -> Tuple[float, ...]:
    """``measure(model)``, for ``model`` the rank model of ``profile`` checkpointed as ``plan`` says (None: not
    checkpointed), and maybe wrapped further (spike compression): composed from runs cut to a few of its repeated
    blocks (:func:`~.repeats_totals.affine_total`) where ``profile`` composes its own runs and the checkpointed
    regions repeat with a stride, else measured on the whole model (``largest``: as for ``affine_total``)."""
    found = lever_cuts(profile, plan, tp_plan, tp)
    total = affine_total(model, *found, measure, largest) if found is not None else None
    return tuple(measure(model)) if total is None else total


def lever_cuts(profile: ModelProfile, plan, tp_plan: Optional[Mapping[str, str]],
               tp: int) -> Optional[Tuple[Repeats, Tuple[int, int, int]]]:
    """``(repeats, cut sizes)`` of :func:`~.repeats_totals.stride_cuts` for ``profile``'s rank model checkpointed as
    ``plan`` says (None: not checkpointed), found on the plain rank model (a checkpointed module's forward is its
    own, which :func:`~.repeats.signature` tells apart); None where ``profile`` does not compose its runs, the
    model has no repeats, or the regions have no stride."""
    found = _plain_repeats(profile, plan, tp_plan, tp)
    cuts = None if found is None else stride_cuts(*found)
    return None if cuts is None else (found[0], cuts)


def lever_log_repeats(profile: ModelProfile, plan, tp_plan: Optional[Mapping[str, str]], tp: int) -> Optional[Repeats]:
    """The repeats a logged run of ``profile``'s rank model checkpointed as ``plan`` says is composed over
    (:func:`~.repeats_totals.strided_repeats`: each block as many repeats as the regions' stride), or None."""
    found = _plain_repeats(profile, plan, tp_plan, tp)
    return None if found is None else strided_repeats(*found)


def _plain_repeats(profile: ModelProfile, plan, tp_plan, tp: int) -> Optional[tuple]:
    """``(repeats of the plain rank model, the regions of plan)``, or None where ``profile`` does not compose its
    runs or the model has no repeats."""
    if profile.composed is None:
        return None
    plain = ModelProfile.rank_model(profile, tp_plan, tp)[1]
    # found once per plain rank model and checkpointing: every lever variant's profile asks again, and both walks
    # take seconds on a model of thousands of modules
    known = _PLAIN_REPEATS.setdefault(plain, {})
    if "repeats" not in known:
        known["repeats"] = find_repeats(plain)
    if known["repeats"] is None:
        return None
    key = None if plan is None else (plan.activation_checkpointing, plan.checkpoint_every, plan.time_step_module,
                                     plan.checkpoint_blocks, tuple(profile.fsdp_units))
    if key not in known:
        known[key] = (known["repeats"], () if plan is None else region_starts(plain, plan, profile.fsdp_units))
    return known[key]


#: Per plain rank model (weakly held), its repeats ("repeats") and per checkpointing (None: none) its (repeats,
#: regions).
_PLAIN_REPEATS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def held_after_forward(model: nn.Module, x: torch.Tensor, labels,
                       on_forward: Optional[Callable[[], None]] = None) -> Tuple[float, float]:
    """(bytes the forward leaves alive besides neuron state, neuron-state bytes), then the backward runs;
    ``on_forward()`` is called just before the measured forward (after the warm-up)."""
    with torch.no_grad():  # warm-up: state tensors take this size (as every profile run warms up)
        forward_loss(model, x, labels)
    model.zero_grad(set_to_none=True)
    if on_forward is not None:
        on_forward()
    state_ids = state_tensor_ids(model)
    meter = StorageMeter()
    meter.track([t for t in list(model.parameters()) + list(model.buffers()) if id(t) not in state_ids] + [x])
    with meter, new_objects_collected() as collect:
        entry = meter.current
        loss = forward_loss(model, x, labels)
        collect()
        held = meter.current - entry
    state = total_bytes(model_state_tensors(model))
    loss.backward()
    model.zero_grad(set_to_none=True)
    return float(max(0, held - state)), float(state)


def _flops(model: nn.Module, x: torch.Tensor, labels) -> Tuple[float, float]:
    """(FLOPs of the forward, of forward and backward) of one step, as ``FlopCounterMode`` counts them."""
    counter = FlopCounterMode(display=False)
    with counter:
        loss = forward_loss(model, x, labels)
        forward = counter.get_total_flops()
        loss.backward()
    model.zero_grad(set_to_none=True)
    return float(forward), float(counter.get_total_flops())


def levered_profile(profile: ModelProfile, plan) -> ModelProfile:
    """The profile to estimate ``plan`` from: ``profile`` in the plan's precision
    (:func:`~.profiling.precision_profile`), and with checkpointing its :class:`CheckpointedProfile` for the
    plan's checkpointing (cached on ``profile``)."""
    profile = precision_profile(profile, plan.precision, gathered=plan.uses_fsdp)
    if not Checkpointing(plan.activation_checkpointing).recomputes:
        return profile
    key = (plan.activation_checkpointing, plan.checkpoint_every, plan.time_step_module, plan.checkpoint_blocks)
    cache = profile.__dict__.setdefault("_checkpointed_profiles", {})
    if key not in cache:
        base = {f.name: getattr(profile, f.name) for f in dataclasses.fields(ModelProfile)}
        # counted on its own models; the TP replicas (plain models it copies before checkpointing) shared
        base.update(peaks={}, logs={}, saved_state={}, step_counts=())
        cache[key] = CheckpointedProfile(**base, plan=plan, plain_flops=profile.__dict__.setdefault("_plain_flops", {}),
                                         chunk_figures=profile.__dict__.setdefault("_chunk_figures", {}),
                                         unlevered=profile)
    return cache[key]


def unlevered(profile: ModelProfile) -> ModelProfile:
    """The profile without levers that ``profile`` derives from (through the ``base`` of a spike-compressed or
    activation-offloaded profile and the ``unlevered`` of a checkpointed one); ``profile`` itself if it has none."""
    while getattr(profile, "base", None) is not None or getattr(profile, "unlevered", None) is not None:
        profile = getattr(profile, "base", None) or profile.unlevered
    return profile


def recompute_fraction(profile: ModelProfile, plan, t: int) -> float:
    """Extra forward work of ``plan``'s checkpointing per step of ``t`` time steps, as a fraction of one
    forward (0.0 without checkpointing)."""
    profile = getattr(profile, "base", profile)  # a compressed profile: the checkpointed one it packs
    if not isinstance(profile, CheckpointedProfile):
        return 0.0
    return profile.recompute_fraction(plan.per_rank_batch, t, plan.tensor_parallel_plan, plan.tp_size)


__all__ = ["CheckpointedProfile", "levered_profile", "lever_cuts", "lever_log_repeats", "recompute_fraction", "run_total",
           "unlevered"]
