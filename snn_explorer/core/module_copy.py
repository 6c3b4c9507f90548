"""A copy of a model that shares its parameters' storage: the structure copied, no weight copied.

:func:`shared_storage_copy` builds what :func:`~.neurons.detached_copy` builds (every module a new
object, fresh neuron state, buffers and other tensors copied, hooks and attributes copied as
``copy.deepcopy`` copies them) except that each parameter becomes a new ``nn.Parameter`` over the
same storage: a copy whose layers the caller replaces or cuts (the estimator's TP replica) and that
runs forward and backward without writing the weights (its gradients are its own parameters').

Module trees are walked here rather than by ``copy.deepcopy``, which visits every one of the dozen
hook dictionaries of every module through its generic reduce protocol; everything that is neither
a module, a parameter nor a plain container goes to ``copy.deepcopy`` with the same memo, so that
objects reached twice are copied once, as ``copy.deepcopy`` does.
"""
from __future__ import annotations

import copy
import functools
from collections import OrderedDict

import torch
from torch import nn

from .neurons import reset_all

_PLAIN_DICTS = (dict, OrderedDict)
#: immutable values every copy shares (``copy.deepcopy`` returns them as they are)
_ATOMS = frozenset({type(None), bool, int, float, str, torch.dtype, torch.device})


def shared_storage_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with fresh neuron state whose parameters share ``model``'s storage (see
    the module doc); ``model`` itself is not touched."""
    copy_ = _copy(model, {})
    reset_all(copy_)
    return copy_


def _copy(value, memo: dict):
    kind = type(value)
    if kind in _ATOMS:
        return value
    found = memo.get(id(value))
    if found is not None:
        return found
    if kind is nn.Parameter:
        out = nn.Parameter(value.detach(), requires_grad=value.requires_grad)
    elif isinstance(value, torch.Tensor) and value.grad_fn is not None:  # left by a forward: detached
        out = value.detach().clone()
    elif kind is torch.Tensor and _whole_storage(value):
        out = value.detach().clone().requires_grad_(value.requires_grad)
    elif isinstance(value, nn.Module) and _plain_module(kind):
        out = kind.__new__(kind)
        memo[id(value)] = out  # before its children: a child may point back at it
        out.__setstate__(_module_state(value, memo))
        return out
    elif kind in _PLAIN_DICTS:
        out = kind({k: _copy(v, memo) for k, v in value.items()}) if value else kind()
    elif kind is list or kind is tuple or kind is set:
        out = kind([_copy(v, memo) for v in value])
    else:
        return copy.deepcopy(value, memo)
    memo[id(value)] = out
    return out


def _module_state(module: nn.Module, memo: dict) -> dict:
    """``module``'s state copied by :func:`_copy`, its many empty hook dictionaries made anew directly."""
    state = module.__getstate__()
    for key, value in state.items():
        kind = type(value)
        if kind in _PLAIN_DICTS and not value:
            state[key] = kind()
        elif kind not in _ATOMS:
            state[key] = _copy(value, memo)
    return state


def _whole_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a dense, contiguous leaf that is all of its storage (no view, nothing
    autograd recorded): then ``clone`` copies it as ``copy.deepcopy`` does."""
    return (tensor._base is None and tensor.layout == torch.strided
            and tensor.is_contiguous() and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
            and tensor.grad is None and not tensor.__dict__ and not tensor.is_quantized and tensor.device.type in ("cpu", "cuda"))


@functools.lru_cache(maxsize=None)
def _plain_module(kind: type) -> bool:
    """Whether ``copy.deepcopy`` copies instances of ``kind`` as :func:`_copy` does: through
    ``nn.Module``'s own ``__getstate__`` and the class's ``__setstate__``, with no copy hooks or slots."""
    return (getattr(kind, "__deepcopy__", None) is None and kind.__reduce_ex__ is object.__reduce_ex__
            and kind.__reduce__ is object.__reduce__ and kind.__getstate__ is nn.Module.__getstate__
            and not any("__slots__" in vars(k) for k in kind.__mro__))
