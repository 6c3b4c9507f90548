"""What activation offload (``plan.activation_offload``, :mod:`snn_explorer.core.levers.activation_offload`) saves and costs.

Device memory: the profile's runs are repeated on the rank's model under a root of its own whose forwards run
under saved-tensor hooks that stand for the host copy (:class:`OffloadedProfile`; on a model of repeated blocks
the bytes and copies a forward leaves are composed from runs cut to a few of them, :func:`~..profile.checkpointed.run_total`). The pack hook copies each
saved tensor into memory the storage meter does not count (a NumPy array: host memory; on FakeTensors a
meta tensor), so the device copy is counted until nothing else holds it, as on the GPU; the unpack hook
makes a counted copy (the copy back to the device) that lives while backward uses it. Parameters stay
where they are, as the core's hooks leave them. So the phases the estimator replays include the forward's
working set, the backward's unpacked tensors and everything else unchanged.

Time: every offloaded tensor is copied twice per step (to the host in forward, back in backward), each
copy an operator call (``op_overhead_s``) and its bytes at the hardware's ``host_link_bytes_per_s``
(datasheet PCIe rates, after ``efficiency``), counted as not overlapped with compute: an upper bound
(the copies are asynchronous from pinned memory). The copies are counted by the pack hook in the
measured forward (a tensor saved by two operators is copied twice, as the core's hook copies it).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from ...compat_fake import is_fake
from ...core.levers import offload_hooks
from ...core.model import root_over_children
from ..profile.checkpointed import held_after_forward, run_total
from ..profile.profiling import ModelProfile
from ..profile.step import batch_slice

__all__ = ["OffloadedProfile", "offloaded_profile", "offload_seconds"]


#: The integer dtype of each element size: saved values are copied bit for bit through it (NumPy has no bf16).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _to_simulated_host(t: torch.Tensor, traffic: List[float]) -> Any:
    """The pack hook of the estimate: ``t`` kept outside the counted storages (host memory), parameters kept;
    ``traffic`` counts the copies and their bytes."""
    if t.requires_grad and t.grad_fn is None:
        return t
    traffic[0] += 1
    traffic[1] += t.numel() * t.element_size()
    if is_fake(t) or t.device.type == "meta":
        return t.size(), t.stride(), t.dtype, t.device, None
    return t.size(), t.stride(), t.dtype, t.device, t.detach().view(_BITS[t.element_size()]).numpy().copy()


def _to_simulated_device(packed: Any) -> torch.Tensor:
    """The unpack hook of the estimate: a counted copy on the device, the saved values in it (none when fake)."""
    if isinstance(packed, torch.Tensor):
        return packed
    size, stride, dtype, device, host = packed
    out = torch.empty_strided(size, stride, dtype=dtype, device=device)
    if host is not None:  # into the counted copy through a view of it: the host array itself is not counted
        out.view(_BITS[out.element_size()]).copy_(torch.from_numpy(host))
    return out


@dataclass
class OffloadedProfile(ModelProfile):
    """A :class:`ModelProfile` whose rank models keep their saved tensors outside the counted memory
    (``base``'s rank models under a root of their own, :func:`~snn_explorer.core.model.module_copy.root_over_children`)."""

    base: ModelProfile = None
    offloaded: Dict[tuple, nn.Module] = field(default_factory=dict, repr=False)
    counters: Dict[tuple, List[float]] = field(default_factory=dict, repr=False)
    traffic: Dict[tuple, Tuple[int, float]] = field(default_factory=dict, repr=False)

    def rank_model(self, tp_plan: Optional[Mapping[str, str]], tp: int) -> Tuple[tuple, nn.Module]:
        key, model = self.base.rank_model(tp_plan, tp)
        if key not in self.offloaded:  # the hooks wrap the root's forward: a new root over its modules, no copy
            copy_ = root_over_children(model)
            counter = self.counters.setdefault(key, [0, 0.0])
            offload_hooks(copy_, lambda t: _to_simulated_host(t, counter), _to_simulated_device)
            self.offloaded[key] = copy_
        return key, self.offloaded[key]

    def saved_and_state(self, n: int, t: int, tp_plan: Optional[Mapping[str, str]] = None,
                        tp: int = 1) -> Tuple[float, float]:
        """Device bytes a forward leaves for the backward (the saved tensors are on the host) and of neuron
        state, measured once per size."""
        model_key, model = self.rank_model(tp_plan, tp)
        key = (n, t) + model_key
        if key not in self.saved_state:
            x, y = batch_slice(self.example_input, self.labels, n, t, layout=self.layout)
            counter = self.counters[model_key]

            def measured(m: nn.Module) -> Tuple[float, float, float, float]:  # (held, state, copies, bytes copied)
                held = held_after_forward(m, x.to(self.dtype), y, on_forward=lambda: counter.__setitem__(
                    slice(None), [0, 0.0]))
                return held + (float(counter[0]), float(counter[1]))

            # on a model of repeated blocks, composed from runs cut to a few of them (exact, else the whole model)
            held, state, copies, nbytes = run_total(self.base, None, tp_plan, tp, model, measured)
            self.saved_state[key] = (held, state)
            self.traffic[key] = (int(copies), float(nbytes))
        return self.saved_state[key]

    def copies(self, n: int, t: int, tp_plan: Optional[Mapping[str, str]] = None, tp: int = 1) -> Tuple[int, float]:
        """(tensors, bytes) one forward of ``n`` samples and ``t`` steps copies to the host (each comes back in
        backward), counted by the pack hook, once per size."""
        self.saved_and_state(n, t, tp_plan, tp)
        return self.traffic[(n, t) + self.rank_model(tp_plan, tp)[0]]


def offloaded_profile(profile: ModelProfile) -> OffloadedProfile:
    """``profile``'s :class:`OffloadedProfile` (cached on it): its step counts, its own measured runs."""
    cache = profile.__dict__
    if "_offloaded_profile" not in cache:
        base = {f.name: getattr(profile, f.name) for f in dataclasses.fields(ModelProfile)}
        base.update(peaks={}, logs={}, replicas={}, saved_state={}, stage_memory={})
        cache["_offloaded_profile"] = OffloadedProfile(**base, base=profile)
    return cache["_offloaded_profile"]


def offload_seconds(copies: Tuple[int, float], hardware: Any) -> float:
    """Seconds per step of copying ``copies`` (tensors, bytes) to the host and back: an operator call each
    way per tensor and the bytes at the host link's rate, not overlapped with compute (an upper bound)."""
    tensors, nbytes = copies
    return 2 * tensors * hardware.op_overhead_s + 2 * nbytes / (hardware.host_link_bytes_per_s * hardware.efficiency)
