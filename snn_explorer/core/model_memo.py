"""Answers about a model that run it (its data layout, the module it steps per time step), kept per model object
while its structure stays the same.

Finding where N and T sit (``layouts.detect_layout``) or which module is called once per time step
(``memory_levers.find_time_step_module``) copies the model and runs it: seconds on a model of thousands of modules,
asked again by every ``fit_budget`` of the same model (one per memory budget). Both answers depend on the model's
structure and the input's shape, not on weights or neuron state, so :func:`remembered_for` keeps each per model object
(weakly) under :func:`structure_key`: per module its path, class, configuration attributes (public, not tensors; an
object other than a number, string or tuple by identity, so a replaced forward counts), its hooks, and the shapes,
dtypes, devices and ``requires_grad`` of its parameters and persistent buffers (neuron state left out: it changes
with every run). A change to any of them, a module added or replaced included, asks again; a change to a class's
code after the first answer is not seen.
"""
from __future__ import annotations

import weakref
from typing import Callable, Hashable, TypeVar

import torch
from torch import nn

from ..compat import non_persistent_buffer_names

T = TypeVar("T")
_SIMPLE = (int, float, str, bool, type(None), torch.dtype, torch.device)
#: per model object: per question, (the structure key it was answered for, the answer)
_ANSWERS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def _value(value):
    if isinstance(value, _SIMPLE):
        return value
    if isinstance(value, (tuple, list)):
        return (type(value).__name__,) + tuple(_value(v) for v in value)
    return type(value).__qualname__, id(value)


def _tensors(module: nn.Module) -> tuple:
    state = non_persistent_buffer_names(module)
    return tuple((where, n, tuple(t.shape), t.dtype, t.device.type, t.requires_grad)
                 for where, table in (("p", module._parameters), ("b", module._buffers))
                 for n, t in table.items() if t is not None and not (where == "b" and n in state))


def structure_key(model: nn.Module) -> str:
    """What the answers :func:`remembered_for` keeps depend on (see the module doc), one entry per module, as one
    string (kept alive, it is one object the garbage collector does not walk, not a tuple per module)."""
    return repr(tuple((name, type(m).__module__, type(m).__qualname__, id(type(m)),
                       tuple(sorted((k, _value(v)) for k, v in vars(m).items()
                                    if not k.startswith("_") and not isinstance(v, torch.Tensor))),
                       tuple(m._forward_pre_hooks), tuple(m._forward_hooks), _tensors(m))
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
