"""Which modules hold neuron state between calls, and how to reset them.

Recognises spikingjelly memory modules (a ``_memories`` dict and a callable ``reset``),
snntorch spiking neurons created with ``init_hidden=True``, and any class registered with
:func:`register_stateful`, without importing either library.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ...compat import non_persistent_buffer_names, spikingjelly_memories, state_slot_table
from .module_copy import copy_sharing_parameters, deep_copy_module
from .walk import memo, modules_by_name

ResetFn = Callable[[nn.Module], None]

_REGISTRY: Dict[type, ResetFn] = {}


def register_stateful(cls: type, reset: Optional[ResetFn] = None) -> None:
    """Mark instances of ``cls`` as stateful neurons; ``reset(module)`` clears their state.

    Without ``reset`` the module's own ``reset()`` method is called.
    """
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise TypeError(f"register_stateful expects an nn.Module subclass, got {cls!r}")
    if reset is None:
        if not callable(getattr(cls, "reset", None)):
            raise TypeError(f"{cls.__name__} has no reset() method; pass reset=fn(module)")
        reset = _call_reset
    elif not callable(reset):
        raise TypeError(f"reset must be callable, got {reset!r}")
    _REGISTRY[cls] = reset
    _registered_reset_of.cache_clear()


def unregister_stateful(cls: type) -> None:
    """Undo :func:`register_stateful` for ``cls`` (no error when it was not registered)."""
    _REGISTRY.pop(cls, None)
    _registered_reset_of.cache_clear()


def registered_stateful() -> Dict[type, ResetFn]:
    """A copy of the :func:`register_stateful` registrations, for shipping to other processes."""
    return dict(_REGISTRY)


def restore_stateful(registrations: Dict[type, ResetFn]) -> None:
    """Register what :func:`registered_stateful` returned in another process (a launched rank)."""
    _REGISTRY.update(registrations)
    _registered_reset_of.cache_clear()


def _call_reset(module: nn.Module) -> None:
    module.reset()


def _is_snntorch_neuron(module: nn.Module) -> bool:
    return _is_snntorch_neuron_type(type(module))


@functools.lru_cache(maxsize=None)
def _is_snntorch_neuron_type(cls: type) -> bool:
    """Per class, as the walks over every module of large models ask it for each (cached)."""
    return any(k.__name__ == "SpikingNeuron" and k.__module__.startswith("snntorch") for k in cls.__mro__)


def _reset_snntorch(module: nn.Module) -> None:
    """Zero an snntorch neuron's hidden state (its non-persistent buffers such as ``mem``)."""
    state = non_persistent_buffer_names(module)
    for name, value in list(module.named_buffers(recurse=False, remove_duplicate=False)):
        if name in state:
            setattr(module, name, torch.zeros_like(value))


def snn_library(module: nn.Module) -> Optional[str]:
    """``"registered"``, ``"spikingjelly"``, ``"snntorch"`` or None for a stateless module."""
    return memo(("library", id(module)), lambda: _library_of(module))


def _library_of(module: nn.Module) -> Optional[str]:
    if _registered_reset(module) is not None:
        return "registered"
    if spikingjelly_memories(module) is not None and callable(getattr(module, "reset", None)):
        return "spikingjelly"
    if _is_snntorch_neuron(module) and getattr(module, "init_hidden", False):
        return "snntorch"
    return None


def _registered_reset(module: nn.Module) -> Optional[ResetFn]:
    return _registered_reset_of(type(module))


@functools.lru_cache(maxsize=None)
def _registered_reset_of(cls: type) -> Optional[ResetFn]:
    """The registration ``cls`` inherits (cached per class; the cache is cleared when one changes)."""
    for klass in cls.__mro__:
        if klass in _REGISTRY:
            return _REGISTRY[klass]
    return None


def reset_function(module: nn.Module) -> Optional[ResetFn]:
    """The function that resets ``module``'s state, or None when it is stateless."""
    library = snn_library(module)
    if library == "registered":
        return _registered_reset(module)
    if library == "spikingjelly":
        return _call_reset
    if library == "snntorch":
        return _reset_snntorch
    return None


#: The kinds of state a stateful module keeps between calls (see :func:`state_kind`).
NEURON, DROPOUT_MASK = "neuron", "dropout mask"


def _is_spikingjelly_dropout(module: nn.Module) -> bool:
    """spikingjelly's stateful dropout (``layer.Dropout`` / ``Dropout2d``): one mask kept over time steps."""
    return any(k.__name__.startswith("Dropout") and k.__module__.startswith("spikingjelly")
               for k in type(module).__mro__)


def state_kind(module: nn.Module) -> Optional[str]:
    """:data:`NEURON`, :data:`DROPOUT_MASK` (state that must be reset but is no neuron), or None
    for a stateless module. Registered classes are neurons."""
    library = snn_library(module)
    if library is None:
        return None
    return DROPOUT_MASK if library == "spikingjelly" and _is_spikingjelly_dropout(module) else NEURON


def state_description(module: nn.Module) -> str:
    """Which state ``module`` holds between calls and where, in words ('' for none)."""
    library = snn_library(module)
    if library == "registered":
        return f"registered state ({type(module).__name__}, reset by its reset function)"
    if library == "spikingjelly":
        names = ", ".join(spikingjelly_memories(module)) or "none yet"
        kind = "dropout mask, kept over time steps" if state_kind(module) == DROPOUT_MASK else "neuron state"
        return f"{kind} in the module (spikingjelly memories: {names})"
    if library == "snntorch":
        return "membrane in the module (snntorch init_hidden=True)"
    if _is_snntorch_neuron(module):
        return "membrane passed in and out by the model's forward (snntorch init_hidden=False)"
    return ""


def is_stateful(module: nn.Module) -> bool:
    """Whether ``module`` keeps state between calls that a reset clears (neurons and dropout masks)."""
    return snn_library(module) is not None


def is_spiking_neuron(module: nn.Module) -> bool:
    """True for stateful modules (neurons and dropout masks: both act element-wise) and for snntorch
    neurons with explicit state (``init_hidden=False``)."""
    return is_stateful(module) or _is_snntorch_neuron(module)


def explicit_state_neurons(model: nn.Module) -> Tuple[str, ...]:
    """snntorch neurons created with ``init_hidden=False``: the model's ``forward`` passes their
    membrane in and gets it back (``spk, mem = lif(x, mem)``), so their state lives in ``forward``."""
    return tuple(n for n, m in modules_by_name(model).items() if n and _is_snntorch_neuron(m) and not is_stateful(m))


def detached_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with fresh neuron state; ``model`` itself is not touched.

    Tensors a forward left behind with autograd history (a neuron's membrane, a cached input)
    cannot be deep-copied; the copy gets them detached. Works whatever the user ran before.
    """
    memo = {id(t): t.detach().clone() for t in tensors_with_history(model)}
    copy_ = deep_copy_module(model, memo)
    reset_all(copy_)
    return copy_


def shared_storage_copy(model: nn.Module) -> nn.Module:
    """:func:`detached_copy` whose parameters share ``model``'s storage (new ``nn.Parameter`` objects, their
    gradients their own; :func:`~.module_copy.copy_sharing_parameters`): a copy whose layers the caller replaces or
    cuts (the estimator's TP replica), running forward and backward without writing ``model``'s weights."""
    copy_ = copy_sharing_parameters(model)
    reset_all(copy_)
    return copy_


def tensors_with_history(model: nn.Module):
    """The tensors ``model``'s modules hold (in attributes, dicts, lists) that carry autograd history."""
    for module in model.modules():
        stack = list(vars(module).values())
        while stack:
            value = stack.pop()
            if isinstance(value, torch.Tensor):
                if value.grad_fn is not None:
                    yield value
            elif isinstance(value, dict):
                stack.extend(value.values())
            elif isinstance(value, (list, tuple)):
                stack.extend(value)


#: Where a neuron keeps state between calls (:func:`~..compat.state_slot_table`), and a slot: (where, name).
Slot = Tuple[str, str]


def state_slots(module: nn.Module) -> Iterator[Tuple[Slot, object]]:
    """``((where, name), value)`` for every place ``module`` itself keeps state between calls:
    non-persistent buffers (snntorch), spikingjelly's memories, public tensor attributes (registered
    neurons)."""
    table = state_slot_table(module, "buffers")
    for name in non_persistent_buffer_names(module):
        yield ("buffers", name), table.get(name)
    for name, value in (spikingjelly_memories(module) or {}).items():
        yield ("memories", name), value
    for name, value in vars(module).items():
        if not name.startswith("_") and isinstance(value, torch.Tensor):
            yield ("attributes", name), value


def set_state_slot(module: nn.Module, slot: Slot, value) -> None:
    """Put ``value`` back in ``module``'s state ``slot`` (from :func:`state_slots`)."""
    where, name = slot
    state_slot_table(module, where)[name] = value


def state_tensors(module: nn.Module) -> List[torch.Tensor]:
    """The tensors ``module`` itself keeps between calls in its buffers and spikingjelly memories (the
    neuron state the estimator and measure() count; attributes of registered neurons are their own)."""
    return [v for (where, _), v in state_slots(module) if where != "attributes" and isinstance(v, torch.Tensor)]


def stateful_modules(model: nn.Module) -> Tuple[Tuple[str, nn.Module], ...]:
    """Every stateful module under ``model`` (the root itself excluded), in ``named_modules`` order."""
    return tuple((n, m) for n, m in model.named_modules() if n and is_stateful(m))


def reset_all(model: nn.Module) -> int:
    """Reset every stateful module in ``model`` (the root included); returns how many."""
    count = 0
    for module in model.modules():
        reset = reset_function(module)
        if reset is not None:
            reset(module)
            count += 1
    return count
