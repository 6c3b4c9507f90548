"""Copies of a module tree without ``copy.deepcopy``'s generic machinery per module.

``copy.deepcopy`` of an ``nn.Module`` reduces every module (``__reduce_ex__``) and rebuilds each of its dozen
hook and registry dictionaries through the same generic protocol (benchmarks/results/calibration.md times both). The walk
here does the same for the modules whose class copies the default way (``nn.Module``'s ``__getstate__``, the
class's ``__setstate__``, no ``__deepcopy__``, ``copyreg`` entry or slots): a new instance, its state copied entry by entry (empty hook dictionaries made anew, plain dicts, lists,
tuples and sets rebuilt). What happens to tensors is the caller's choice:

- :func:`deep_copy_module`: every tensor goes to ``copy.deepcopy`` with the same memo, so the result equals
  ``copy.deepcopy(module, memo)`` (shared tensors and storages stay shared as it keeps them);
- :func:`copy_sharing_parameters`: each parameter becomes a new ``nn.Parameter`` over the same storage (its
  gradients its own), tensors with autograd history are detached and cloned, other whole-storage tensors cloned;
  a tensor viewing part of another's storage (a buffer sliced from a buffer) goes to ``copy.deepcopy``, and so gets
  a storage of its own in the copy.

Any other module class or value goes to ``copy.deepcopy`` with the same memo, so objects reached twice are
copied once. Neuron state is not reset here (:func:`~.neurons.detached_copy`, :func:`~.neurons.shared_storage_copy`).
:func:`modules_copied` counts the modules the walk copied in this process (a dozen long-lived objects each).
"""
from __future__ import annotations

import copy
import copyreg
import weakref
from collections import OrderedDict
from typing import Callable, Optional

import torch
from torch import nn

from ...compat import is_view

_PLAIN_DICTS = (dict, OrderedDict)
#: immutable values every copy shares (``copy.deepcopy`` returns them as they are)
_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device})
#: the dictionaries every ``nn.Module`` makes for itself (hooks, registries), by attribute name
_MODULE_DICTS = frozenset(k for k, v in vars(nn.Module()).items() if type(v) in _PLAIN_DICTS)
#: how a tensor is copied: a copy, or None to leave it to ``copy.deepcopy``
TensorCopy = Callable[[torch.Tensor], Optional[torch.Tensor]]
_copied = [0]  # modules copied by the walk so far (:func:`modules_copied`)


def modules_copied() -> int:
    """How many modules :func:`deep_copy_module` and :func:`copy_sharing_parameters` copied in this process."""
    return _copied[0]


def deep_copy_module(module: nn.Module, memo: Optional[dict] = None) -> nn.Module:
    """``copy.deepcopy(module, memo)``, built by the walk of the module doc."""
    return _copy(module, {} if memo is None else memo, lambda t: None)


def copy_sharing_parameters(module: nn.Module, memo: Optional[dict] = None) -> nn.Module:
    """A copy of ``module`` whose parameters are new ``nn.Parameter`` objects over ``module``'s storage (see the
    module doc); ``module`` itself is not touched."""
    return _copy(module, {} if memo is None else memo, _shared_tensor)


def root_over_children(module: nn.Module) -> nn.Module:
    """A new root module over ``module``'s own submodules, parameters and buffers (the same objects and
    registries, shared), with hook dictionaries of its own: hooks registered on it (around its whole forward)
    run for its calls only, and ``module`` is not touched. What a copy of the whole tree gives a caller that only
    wraps the root's calls, without copying thousands of modules; its runs use (and leave neuron state and
    gradients in) ``module``'s submodules."""
    root = module.__class__.__new__(module.__class__)
    root.__dict__.update({k: (type(v)(v) if k in _HOOK_DICTS else v) for k, v in vars(module).items()})
    return root


#: the hook dictionaries of :data:`_MODULE_DICTS`
_HOOK_DICTS = frozenset(k for k in _MODULE_DICTS if "hooks" in k)


def copy_along(module: nn.Module, paths) -> nn.Module:
    """A new root over ``module`` in which every module on the way to each of ``paths`` (dotted, as
    ``named_modules`` names them; "" the root), the modules at ``paths`` included, is a new instance
    (:func:`root_over_children`: its own instance dict, hook dictionaries and child registry) and every other
    module is ``module``'s own object, shared. What a caller that replaces the forwards of those modules, or
    registers hooks on them (activation checkpointing), needs instead of a copy of the whole tree: ``module`` is
    not touched, and its runs use (and leave neuron state and gradients in) ``module``'s other modules.
    ValueError for a path that names no module."""
    tree: dict = {}
    for path in paths:
        node = tree
        for name in path.split(".") if path else ():
            node = node.setdefault(name, {})
    return _copied_along(module, tree, "")


def _copied_along(module: nn.Module, tree: dict, where: str) -> nn.Module:
    out = root_over_children(module)
    if tree:
        children = type(module._modules)(module._modules)
        for name, below in tree.items():
            child = children.get(name)
            if child is None:
                raise ValueError(f"{(where + '.' if where else '') + name!r} is not a module of this model")
            children[name] = _copied_along(child, below, where + "." + name if where else name)
        out.__dict__["_modules"] = children
    return out


def _copy(value, memo: dict, tensor_copy: TensorCopy):
    kind = type(value)
    if kind in _ATOMS:
        return value
    found = memo.get(id(value))
    if found is not None:
        return found
    if isinstance(value, torch.Tensor):
        out = tensor_copy(value)
        if out is None:
            return copy.deepcopy(value, memo)
    elif isinstance(value, nn.Module) and _plain_module(value):
        out = kind.__new__(kind)
        memo[id(value)] = out  # before its children: a child may point back at it
        _copied[0] += 1
        out.__setstate__(_module_state(value, memo, tensor_copy))
        return out
    elif kind in _PLAIN_DICTS:
        out = kind()
        memo[id(value)] = out
        for key, item in value.items():
            out[_copy(key, memo, tensor_copy)] = _copy(item, memo, tensor_copy)
        return out
    elif kind is list:
        out = memo[id(value)] = []  # before its items, as copy.deepcopy does: an item may reach the list again
        out.extend(_copy(v, memo, tensor_copy) for v in value)
        return out
    elif kind is tuple or kind is set:
        out = kind([_copy(v, memo, tensor_copy) for v in value])
    else:
        return copy.deepcopy(value, memo)
    memo[id(value)] = out
    return out


def _module_state(module: nn.Module, memo: dict, tensor_copy: TensorCopy) -> dict:
    """``module``'s state copied by :func:`_copy`, ``nn.Module``'s own empty hook and registry dictionaries made
    anew directly (no other object can hold them; a user's empty dict goes through the memo)."""
    state = module.__getstate__()  # nn.Module's own (:func:`_plain_module`): a copy of the instance dict
    for key, value in state.items():
        kind = type(value)
        if key in _MODULE_DICTS and kind in _PLAIN_DICTS and not value:
            state[key] = kind()
        elif kind not in _ATOMS:
            state[key] = _copy(value, memo, tensor_copy)
    return state


def _shared_tensor(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """:func:`copy_sharing_parameters`'s copy of a tensor (None: ``copy.deepcopy``'s)."""
    if type(tensor) is nn.Parameter:
        return nn.Parameter(tensor.detach(), requires_grad=tensor.requires_grad)
    if tensor.grad_fn is not None:  # left by a forward: detached
        return tensor.detach().clone()
    if type(tensor) is torch.Tensor and _whole_storage(tensor):
        return tensor.detach().clone().requires_grad_(tensor.requires_grad)
    return None


def _whole_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a dense, contiguous leaf that is all of its storage (no view, nothing
    autograd recorded): then ``clone`` copies it as ``copy.deepcopy`` does."""
    return (not is_view(tensor) and tensor.layout == torch.strided
            and tensor.is_contiguous() and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
            and tensor.grad is None and not tensor.__dict__ and not tensor.is_quantized
            and tensor.device.type in ("cpu", "cuda"))


#: the attributes ``copy.deepcopy`` looks up on the instance itself (an entry in its ``__dict__`` overrides the class)
_COPY_HOOKS = frozenset({"__deepcopy__", "__reduce_ex__", "__reduce__", "__getstate__", "__setstate__"})
#: per class, whether any class of its MRO declares ``__slots__`` (fixed when the class is made); weak keys, so a
#: class made at run time (a test's, a generated model's) is not kept alive by it
_SLOTTED: "weakref.WeakKeyDictionary[type, bool]" = weakref.WeakKeyDictionary()


def _plain_module(module: nn.Module) -> bool:
    """Whether ``copy.deepcopy`` copies ``module`` as :func:`_copy` does: through ``nn.Module``'s own
    ``__getstate__`` and the class's ``__setstate__``, with no copy hooks (on its class now, or on the instance)
    nor slots. The hooks are looked up at every call, as ``copy.deepcopy`` does (a class or instance changed after
    an earlier copy is seen); only the slots, fixed at class creation, are remembered per class."""
    kind = type(module)
    if not (getattr(kind, "__deepcopy__", None) is None and kind not in copyreg.dispatch_table
            and kind.__reduce_ex__ is object.__reduce_ex__ and kind.__reduce__ is object.__reduce__
            and kind.__getstate__ is nn.Module.__getstate__ and _COPY_HOOKS.isdisjoint(module.__dict__)):
        return False
    slotted = _SLOTTED.get(kind)
    if slotted is None:
        slotted = _SLOTTED[kind] = any("__slots__" in vars(k) for k in kind.__mro__)
    return not slotted
