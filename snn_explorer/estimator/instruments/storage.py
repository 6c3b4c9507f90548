"""What tensors hold, counted once: storage bytes, neuron-state tensors, tensors saved for backward.

Every estimate and measurement counts memory by untyped storage (a view shares its base's bytes;
a DTensor is counted by its local shard), and treats the tensors a stateful neuron keeps between
calls as neuron state, not as activations or buffers. These are the one definition of both, and of
the saved-tensor hooks that see what autograd keeps for backward.
"""
from __future__ import annotations

import sys
import weakref
from typing import Dict, Iterable, List

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ...compat_fake import is_fake
from ...core.model import state_tensors, stateful_modules


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local shard when it is a DTensor (TP, FSDP2), else ``t``."""
    if not isinstance(t, DTensor):
        return t
    with torch.no_grad():
        return t.to_local()


def storage_key(t: torch.Tensor, storage) -> int:
    """The key that tells ``t``'s storage from the others alive: its ``data_ptr``, or for a FakeTensor
    (whose storages all have ``data_ptr`` 0) the storage object's id, which lasts as long as it does."""
    return id(storage) if is_fake(t) else storage.data_ptr()


def storage_bytes(tensors: Iterable) -> Dict[int, int]:
    """``{storage key: bytes}`` of the distinct storages of ``tensors`` (:func:`storage_key`; non-tensors
    skipped, meta tensors hold none, a DTensor counted by its local shard)."""
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = local_tensor(t).untyped_storage()
            out[storage_key(t, st)] = st.nbytes()
    return out


def total_bytes(tensors: Iterable) -> int:
    """Bytes of the distinct storages of ``tensors`` (:func:`storage_bytes` summed)."""
    return sum(storage_bytes(tensors).values())


def model_state_tensors(model: nn.Module) -> List[torch.Tensor]:
    """The state tensors of every stateful neuron of ``model`` (:func:`~...core.neurons.state_tensors`)."""
    return [t for _, module in stateful_modules(model) for t in state_tensors(module)]


def state_tensor_ids(model: nn.Module) -> set:
    """ids of the neuron-state tensors (non-persistent buffers, spikingjelly memories)."""
    return {id(t) for t in model_state_tensors(model)}


def storage_keys(tensors: Iterable) -> set:
    """The :func:`storage_key` of each tensor's (local) storage, for :class:`LiveSaved` to skip."""
    return {storage_key(local_tensor(t), local_tensor(t).untyped_storage()) for t in tensors}


class LiveSaved:
    """saved_tensors_hooks counting the bytes of the saved storages alive at once (peak in ``peak``;
    ``skip``: :func:`storage_keys` of tensors not counted)."""

    def __init__(self, skip: set):
        self.skip, self.live, self.current, self.peak = skip, {}, 0, 0

    def pack(self, t):
        st, key = self.storage_of(t)
        if key not in self.skip and id(st) not in self.live:  # by the storage, not its address (SavedAlive)
            self.live[id(st)] = self.bytes_of(st)
            self.current += self.live[id(st)]
            self.peak = max(self.peak, self.current)
            weakref.finalize(st, self._free, id(st))
        return t

    def storage_of(self, t):
        """The storage counted for saved tensor ``t`` and the key telling it apart."""
        local = local_tensor(t)  # a DTensor's shard is counted; the saved tensor itself is kept as it is
        st = local.untyped_storage()
        return st, storage_key(local, st)

    def bytes_of(self, st) -> int:
        """The bytes storage ``st`` holds."""
        return st.nbytes()

    def _free(self, key):
        self.current -= self.live.pop(key, 0)


class SavedAlive:
    """saved_tensors_hooks that remember each saved storage still alive at the end of the forward.

    Every saved storage is remembered by a weak reference, whatever else was saved at its address: a storage's
    Python object can outlive the place it held (a resized storage moves; one released by another thread goes a
    moment later), and a storage saved later at that address is counted all the same."""

    def __init__(self):
        self.refs: Dict[int, List[weakref.ref]] = {}  # data_ptr when saved -> the storages saved there

    def pack(self, t):
        st = local_tensor(t).untyped_storage()
        saved_here = [ref for ref in self.refs.get(st.data_ptr(), ()) if ref() is not None]
        if not any(ref() is st for ref in saved_here):
            saved_here.append(weakref.ref(st))
        self.refs[st.data_ptr()] = saved_here
        return t

    def alive(self) -> Dict[int, int]:
        """Bytes now held by each saved storage still alive, by its address now (FSDP2 frees unsharded weights
        by resizing)."""
        live = [ref() for refs in self.refs.values() for ref in refs]
        return {st.data_ptr(): st.nbytes() for st in live if st is not None}


def saving(hooks):
    """The ``saved_tensors_hooks`` context that calls ``hooks.pack`` on every tensor saved for backward."""
    return torch.autograd.graph.saved_tensors_hooks(hooks.pack, lambda t: t)


class SavedByModule:
    """saved_tensors_hooks charging each saved storage (once) to the module running when it was saved
    (``where()``). The tensors are held until :meth:`held` (so no saved storage's address is reused
    meanwhile), which keeps those autograd still holds and lets the others go."""

    def __init__(self, where):
        self.where, self.saved = where, {}  # data_ptr -> (module, nbytes, the saved tensors)

    def pack(self, t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            self.saved.setdefault(storage_key(t, st), (self.where(), st.nbytes(), []))[2].append(t)
        return t

    def held(self) -> Dict[int, tuple]:
        """``data_ptr -> (module, nbytes)`` of the saved storages autograd still holds; forgets the rest."""
        alive = {ptr: (name, nbytes) for ptr, (name, nbytes, tensors) in self.saved.items()
                 if any(sys.getrefcount(t) > 3 for t in tensors)}  # ours: the list, the loop, the call
        self.saved.clear()
        return alive
