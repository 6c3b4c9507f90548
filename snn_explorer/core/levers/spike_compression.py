"""Spike compression: the 0/1 tensors autograd saves for backward, kept packed 1 bit per element.

Spikes are 0 or 1, yet autograd saves them in the compute dtype (32 bits each in fp32). With a plan's
``spike_compression=True`` every forward of the model runs under ``torch.autograd.graph.saved_tensors_hooks``
whose pack hook checks each saved floating tensor: if every element is exactly ``+0`` or ``1`` it keeps
the bits (``uint8``, 8 elements a byte) and unpack rebuilds the same values in the same dtype, shape and
strides (a checkpoint's recompute compares what it saves again, and ops choose kernels by strides),
so gradients are bit-identical (a DTensor's local values are tested and packed on its rank, and it is
rebuilt with its mesh and placements). Any other tensor is saved unchanged and counted (:class:`SpikePacker`
``refused``): a value that is not 0/1 (a membrane, ``-0.0``) is never packed. Parameters and other
leaves that need a gradient are left as they are (they stay alive anyway; packing would add a copy).

The saved spikes of every neuron library are caught (snntorch, spikingjelly, a registered neuron): the
hooks look at what is saved, not at who saves it. With activation checkpointing, the tensors saved outside
checkpointed regions are packed (inside one, torch's checkpoint keeps nothing but the region's inputs,
which it holds itself, unpacked). Not combined with pipeline stages yet (refused at plan time).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["SpikePacker", "PackedSpikes", "is_binary", "packable", "pack_bits", "unpack_bits",
           "apply_spike_compression", "check_spike_compression", "spike_packer"]

_SHIFTS = torch.arange(8, dtype=torch.uint8)
_PACKER = "_snn_spike_packer"


def packable(t: Any) -> bool:
    """Whether ``t`` is a saved tensor compression looks at: floating, not a leaf that needs a gradient."""
    return (isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type != "meta"
            and not (t.requires_grad and t.grad_fn is None))


def is_binary(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is exactly ``1`` or ``+0`` (so 1 bit each restores it exactly)."""
    return bool(((t == 1) | ((t == 0) & ~torch.signbit(t))).all())


def pack_bits(t: torch.Tensor) -> torch.Tensor:
    """The elements of a 0/1 tensor as bits, 8 a byte (``uint8`` of ``ceil(numel / 8)``), in ``t``'s order."""
    flat = (t.detach().reshape(-1) == 1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.view(-1, 8) << _SHIFTS.to(flat.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(bits: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The tensor :func:`pack_bits` packed: ``shape``, ``dtype``, on ``bits``'s device (contiguous)."""
    numel = 1
    for size in shape:
        numel *= size
    flat = (bits.unsqueeze(1) >> _SHIFTS.to(bits.device)) & 1
    return flat.reshape(-1)[:numel].to(dtype).reshape(shape)


@dataclass(frozen=True)
class PackedSpikes:
    """One saved tensor as bits, with what rebuilds it."""

    bits: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    requires_grad: bool
    #: a DTensor's (mesh, placements, global shape, stride); its local tensor is what ``bits`` holds
    dtensor: Optional[tuple] = None
    #: the saved tensor's strides: ops pick their kernels by them (a recompute under checkpointing compares)
    stride: Optional[Tuple[int, ...]] = None


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (this rank's values: tests and packing stay on the rank), else ``t``."""
    if not isinstance(t, DTensor):
        return t
    with torch.no_grad():
        return t.to_local()


def _layout(t: torch.Tensor) -> Optional[Tuple[int, ...]]:
    """``t``'s strides when they are not the contiguous ones and no two elements share memory (else None:
    unpacked contiguous)."""
    if t.is_contiguous() or 0 in t.stride():
        return None
    return tuple(t.stride())


class SpikePacker:
    """The pack / unpack hooks, and what they did: ``packed`` tensors (``packed_bytes`` of them kept as
    ``stored_bytes``), ``refused`` floating tensors that were not 0/1 (saved unchanged)."""

    def __init__(self):
        self.packed = self.packed_bytes = self.stored_bytes = self.refused = self.refused_bytes = 0

    def pack(self, t: Any) -> Any:
        if not packable(t):
            return t
        local = _local(t)
        if not is_binary(local):
            self.refused += 1
            self.refused_bytes += local.numel() * local.element_size()
            return t
        bits = pack_bits(local)
        self.packed += 1
        self.packed_bytes += local.numel() * local.element_size()
        self.stored_bytes += bits.numel()
        spec = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
        return PackedSpikes(bits, local.shape, local.dtype, t.requires_grad, spec, _layout(local))

    @staticmethod
    def unpack(saved: Any) -> Any:
        if not isinstance(saved, PackedSpikes):
            return saved
        local = unpack_bits(saved.bits, saved.shape, saved.dtype)
        if saved.stride is not None:  # the saved tensor's memory layout (a transposed view stays transposed)
            local = torch.empty_strided(saved.shape, saved.stride, dtype=saved.dtype, device=local.device).copy_(local)
        if saved.dtensor is not None:
            mesh, placements, shape, stride = saved.dtensor
            local = DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
        return local.requires_grad_(saved.requires_grad)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def counts(self) -> dict:
        return dict(packed=self.packed, packed_bytes=self.packed_bytes, stored_bytes=self.stored_bytes,
                    refused=self.refused, refused_bytes=self.refused_bytes)


def _around_forward(module: nn.Module, packer: SpikePacker) -> None:
    """Run every call of ``module`` under ``packer``'s hooks (left also when the forward raises)."""
    open_hooks: List = []

    def enter(_module, _args):
        context = packer.hooks()
        context.__enter__()
        open_hooks.append(context)

    def leave(_module, _args, _out):
        if open_hooks:
            open_hooks.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def check_spike_compression(plan: Any) -> None:
    """Raise for a ``spike_compression`` field that is not a bool, not allowed by its gate, or with pp."""
    if type(plan.spike_compression) is not bool:
        raise TypeError(f"spike_compression must be a bool, got {plan.spike_compression!r}")
    if not plan.spike_compression:
        return
    if not plan.experimental_features.allow_spike_compression:
        raise ValueError("spike_compression=True needs DistributedFeatureSet(allow_spike_compression=True)")
    if plan.uses_pp:
        raise ValueError("spike_compression=True is not combined with pipeline stages (mode 'pp') yet: a "
                         "pipeline runs its stages outside the model's forward; use a dp / tp / fsdp2 plan")


def apply_spike_compression(model: nn.Module, plan: Any) -> Optional[SpikePacker]:
    """With ``plan.spike_compression``, pack the 0/1 tensors every forward of ``model`` saves; returns the
    :class:`SpikePacker` (its counts; also ``spike_packer(model)``), else None and ``model`` unchanged."""
    if not plan.spike_compression:
        return None
    packer = SpikePacker()
    _around_forward(model, packer)
    model.__dict__[_PACKER] = packer
    return packer


def spike_packer(model: nn.Module) -> Optional[SpikePacker]:
    """The :class:`SpikePacker` :func:`apply_spike_compression` put on ``model`` (None without one)."""
    return model.__dict__.get(_PACKER)

