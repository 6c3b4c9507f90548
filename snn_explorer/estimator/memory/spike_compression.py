"""What spike compression (``plan.spike_compression``, :mod:`snn_explorer.core.levers.spike_compression`) saves and costs.

The model one rank runs (the profile's private copy, its TP replica, or its checkpointed copy) runs
one forward under a detector: the profile's own saved-tensor hooks (:class:`SavedByModule`), which
charge each saved storage once, plus the packer's test of each saved tensor (:func:`is_binary`, the
same test the packer runs). After the forward, the storages autograd still holds that are 0/1 are the
ones compression keeps as bits: each saves its bytes less ``numel / 8``. The check runs on every
floating saved tensor, packing and unpacking on the 0/1 ones: their time is operator calls plus the
bytes they read and write at the hardware's bandwidth.

The peak of a plan with compression is measured as the checkpointed plans' is: the profile's runs
repeated on a copy of the rank's model with the packer applied (:func:`compressed_profile`), so the
check's and the packing's temporaries and backward's unpacked tensors are in it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Tuple

import torch
from torch import nn

from ...core.common import new_objects_collected
from ...core.levers import apply_spike_compression, is_binary, packable
from ...core.model import root_over_children
from ..instruments.storage import SavedByModule, model_state_tensors, saving
from ..profile.checkpointed import (
    CheckpointedProfile,
    held_after_forward,
    lever_cuts,
    lever_log_repeats,
    run_total,
)
from ..profile.profiling import ModelProfile
from ..profile.step import batch_slice, forward_loss

#: Operators per tensor of the check (==1, ==0, signbit, ~, &, |, all), of packing (==1, to, cat, <<, sum)
#: and unpacking (>>, &, to): torch's calls in core.spike_compression, counted.
CHECK_OPS, PACK_OPS, UNPACK_OPS = 7, 5, 3


@dataclass(frozen=True)
class SpikeSaving:
    """Per rank and step: bytes the packed 0/1 saved storages no longer take (``saved_bytes``), the largest one
    unpacked in backward (``largest_bytes``), what was checked and packed (tensors, bytes)."""

    saved_bytes: float
    largest_bytes: float
    checked: int
    checked_bytes: float
    checked_numel: float
    packed: int
    packed_bytes: float
    packed_numel: float

    def seconds(self, hardware) -> float:
        """The check, pack and unpack time of one step on ``hardware`` (operator calls, then bytes at its bandwidth)."""
        calls = self.checked * CHECK_OPS + self.packed * (PACK_OPS + UNPACK_OPS)
        traffic = (3 * self.checked_bytes + 4 * self.checked_numel  # three reads, four bool temporaries
                   + 2 * self.packed_bytes + 6 * self.packed_numel)  # one read, one write, uint8 temporaries
        return calls * hardware.op_overhead_s + traffic / hardware.bandwidth()


class _Detector(SavedByModule):
    """The profile's saved-storage hooks, also noting which saved tensors the packer would pack."""

    def __init__(self):
        super().__init__(lambda: "")
        self.binary: Dict[int, int] = {}  # data_ptr -> element size of a 0/1 storage
        self.checked = [0, 0.0, 0.0]  # tensors, bytes, elements

    def pack(self, t):
        if packable(t):
            self.checked[0] += 1
            self.checked[1] += t.numel() * t.element_size()
            self.checked[2] += t.numel()
            if is_binary(t):
                self.binary.setdefault(t.untyped_storage().data_ptr(), t.element_size())
        return super().pack(t)


def spike_saving(profile, n: int, t: int, tp_plan: Optional[Mapping[str, str]] = None, tp: int = 1) -> SpikeSaving:
    """:class:`SpikeSaving` of ``n`` samples and ``t`` steps on the model one rank runs (measured once per size)."""
    key_, model = profile.rank_model(tp_plan, tp)
    cache = profile.__dict__.setdefault("_spike_savings", {})
    key = (n, t) + key_
    if key not in cache:
        x, y = batch_slice(profile.example_input, profile.labels, n, t, layout=profile.layout)
        x = x.to(profile.dtype)
        figures = run_total(profile, _plan_of(profile), tp_plan, tp, model, lambda m: _saving_figures(m, x, y),
                            largest=1)
        cache[key] = SpikeSaving(**dict(zip(_SUMMED + ("largest_bytes",), figures)))
    return cache[key]


#: The :class:`SpikeSaving` figures that add up over the model's tensors (``largest_bytes`` is a maximum).
_SUMMED = ("saved_bytes", "checked", "checked_bytes", "checked_numel", "packed", "packed_bytes", "packed_numel")


def _saving_figures(model: nn.Module, x: torch.Tensor, y) -> tuple:
    """:class:`SpikeSaving`'s figures of one forward of ``model`` on ``x`` (:data:`_SUMMED`, then ``largest_bytes``)."""
    with torch.no_grad():
        forward_loss(model, x, y)  # the neuron state takes this size
    detector = _Detector()
    with new_objects_collected() as collect:
        with saving(detector):
            loss = forward_loss(model, x, y)
        collect()
    held = detector.held()
    state = {s.untyped_storage().data_ptr() for s in model_state_tensors(model)}  # alive anyway
    sizes = [(nbytes, detector.binary[ptr]) for ptr, (_, nbytes) in held.items()
             if ptr in detector.binary and ptr not in state]
    loss.backward()
    model.zero_grad(set_to_none=True)
    saved = sum(nbytes - -(-nbytes // (8 * itemsize)) for nbytes, itemsize in sizes)
    return (float(saved), detector.checked[0], detector.checked[1], detector.checked[2], len(sizes),
            float(sum(b for b, _ in sizes)), float(sum(b / i for b, i in sizes)),
            float(max((b for b, _ in sizes), default=0)))


@dataclass
class CompressedProfile(ModelProfile):
    """A :class:`ModelProfile` whose rank models pack their saved spikes (``base``'s rank models under a root of
    their own, :func:`_compressed_copy`)."""

    base: ModelProfile = None
    compressed: Dict[tuple, nn.Module] = field(default_factory=dict, repr=False)

    def rank_model(self, tp_plan: Optional[Mapping[str, str]], tp: int) -> Tuple[tuple, nn.Module]:
        key, _ = self.base.rank_model(tp_plan, tp)
        if key not in self.compressed:
            self.compressed[key] = _compressed_copy(self.base, tp_plan, tp)
        return key, self.compressed[key]

    def repeat_cuts(self, tp_plan: Optional[Mapping[str, str]], tp: int) -> Optional[tuple]:
        """The cuts of ``base``'s rank model (the packer wraps the whole forward: it runs every block alike)."""
        return lever_cuts(self.base, _plan_of(self.base), tp_plan, tp)

    def log_repeats(self, tp_plan: Optional[Mapping[str, str]], tp: int):
        """The repeats of ``base``'s logged runs (the packer runs every block alike)."""
        return lever_log_repeats(self.base, _plan_of(self.base), tp_plan, tp)

    def saved_and_state(self, n: int, t: int, tp_plan: Optional[Mapping[str, str]] = None,
                        tp: int = 1) -> Tuple[float, float]:
        """Bytes a forward leaves for the backward (spikes as bits) and of neuron state, measured once per size."""
        key = (n, t) + self.rank_model(tp_plan, tp)[0]
        if key not in self.saved_state:
            x, y = batch_slice(self.example_input, self.labels, n, t, layout=self.layout)
            x = x.to(self.dtype)
            self.saved_state[key] = run_total(self.base, _plan_of(self.base), tp_plan, tp,
                                              self.rank_model(tp_plan, tp)[1], lambda m: held_after_forward(m, x, y))
        return self.saved_state[key]


def _plan_of(base: ModelProfile):
    """The checkpointed plan ``base`` measures (None: not checkpointed)."""
    return base.plan if isinstance(base, CheckpointedProfile) else None


def _compressed_copy(base: ModelProfile, tp_plan: Optional[Mapping[str, str]], tp: int) -> nn.Module:
    """The model one rank of ``base`` runs (checkpointed as ``base``'s plan says when ``base`` is a
    :class:`CheckpointedProfile`), packing its saved spikes, in the order ``apply`` takes them: a new root over its
    modules (:func:`~snn_explorer.core.model.module_copy.root_over_children`: the packer wraps the root's forward), not
    a copy of the whole model."""
    root = root_over_children(base.rank_model(tp_plan, tp)[1])
    apply_spike_compression(root, _COMPRESSED)
    return root


@dataclass(frozen=True)
class _Compression:
    spike_compression: bool = True


_COMPRESSED = _Compression()


def compressed_profile(profile: ModelProfile) -> CompressedProfile:
    """``profile``'s :class:`CompressedProfile` (cached on it): its step counts, its own measured runs."""
    cache = profile.__dict__
    if "_compressed_profile" not in cache:
        base = {f.name: getattr(profile, f.name) for f in dataclasses.fields(ModelProfile)}
        base.update(peaks={}, logs={}, replicas={}, saved_state={}, stage_memory={})
        cache["_compressed_profile"] = CompressedProfile(**base, base=profile)
    return cache["_compressed_profile"]
