"""Answers about a model that run it (its data layout, the module it steps per time step), kept per model object
while its structure stays the same.

Finding where N and T sit (``layouts.detect_layout``) or which module is called once per time step
(``memory_levers.find_time_step_module``) copies the model and runs it: seconds on a model of thousands of modules,
asked again by every ``fit_budget`` of the same model (one per memory budget). Both answers depend on the model's
structure and the input's shape, not on weights or neuron state, so :func:`remembered_for` keeps each per model object
(weakly) under :func:`structure_key`: per module its path, class, configuration attributes (not tensors: public ones,
containers by their items and other objects by identity, so a replaced forward counts; private ones when a number,
string, dtype or device, such as spikingjelly's ``_step_mode``), its hooks, and the shapes,
dtypes, devices and ``requires_grad`` of its parameters and persistent buffers (neuron state left out: it changes
with every run). A change to any of them, a module added or replaced included, asks again; a change to a class's
code after the first answer is not seen.
"""
from __future__ import annotations

import weakref
from typing import Callable, Hashable, TypeVar

import torch
from torch import nn

from ...compat import forward_hook_ids, non_persistent_buffer_names, own_tensors

T = TypeVar("T")
_SIMPLE = (int, float, str, bool, type(None), torch.dtype, torch.device)
#: per model object: per question, (the structure key it was answered for, the answer)
_ANSWERS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def _value(value):
    """A number, string, dtype or device as itself; a tuple, list, dict or set by its items; any other object by
    its type and identity."""
    if isinstance(value, _SIMPLE):
        return value
    if isinstance(value, (tuple, list)):
        return (type(value).__name__,) + tuple(_value(v) for v in value)
    if isinstance(value, dict):
        return ("dict",) + tuple(sorted(((repr(k), _value(v)) for k, v in value.items()), key=repr))
    if isinstance(value, (set, frozenset)):
        return ("set",) + tuple(sorted((_value(v) for v in value), key=repr))
    return type(value).__qualname__, id(value)


def _configuration(module: nn.Module) -> tuple:
    """The module's attributes that are no tensor: public ones by :func:`_value`, private ones when a number, string,
    dtype or device (spikingjelly keeps its step mode in ``_step_mode``)."""
    return tuple(sorted((k, _value(v)) for k, v in vars(module).items()
                        if not isinstance(v, torch.Tensor) and (not k.startswith("_") or isinstance(v, _SIMPLE))))


def _tensors(module: nn.Module) -> tuple:
    state = non_persistent_buffer_names(module)
    return tuple((n, tuple(t.shape), t.dtype, t.device.type, t.requires_grad)
                 for n, t in own_tensors(module) if n not in state)


def structure_key(model: nn.Module) -> str:
    """What the answers :func:`remembered_for` keeps depend on (see the module doc), one entry per module, as one
    string (kept alive, it is one object the garbage collector does not walk, not a tuple per module)."""
    return repr(tuple((name, type(m).__module__, type(m).__qualname__, id(type(m)), _configuration(m),
                       forward_hook_ids(m), _tensors(m))
                      for name, m in model.named_modules()))


def remembered_for(model: nn.Module, question: Hashable, answer: Callable[[], T]) -> T:
    """``answer()``, kept for ``model`` under ``question`` (what else it depends on: the input's shape, ...) until
    :func:`structure_key` of ``model`` changes. An exception is not kept."""
    key = structure_key(model)
    asked = _ANSWERS.setdefault(model, {})
    found = asked.get(question)
    if found is None or found[0] != key:
        asked[question] = found = (key, answer())
    return found[1]
