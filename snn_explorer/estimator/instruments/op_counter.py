"""Count the operators of a piece of a training step: FLOPs, bytes moved and operator launches.

:class:`OpCounter` is a dispatch mode that adds up, per ``aten`` operator, its FLOPs by the
formulas of torch's ``FlopCounterMode``, the bytes of its tensor inputs and outputs (split into
operators with and without FLOPs) and one launch. :mod:`..timing.compute_work` counts a
forward and backward with it and fits the counts.
"""
from __future__ import annotations

from typing import Dict

import torch
from torch.utils.flop_counter import FlopCounterMode

from ...compat import DispatchMode, flop_formula_reads_shapes_only

_FLOP_FORMULAS = FlopCounterMode(display=False).flop_registry
# scaled_dot_product_attention runs as the CPU flash kernel here, which torch's table lacks: it takes
# (and its backward returns) the arguments of the CUDA flash kernel in the same order, so the CUDA
# kernel's formulas count it (a full, non-causal attention's FLOPs, as torch counts every variant).
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLOP_FORMULAS.setdefault(_FLASH_CPU, _FLOP_FORMULAS[_FLASH])
_FLOP_FORMULAS.setdefault(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward,
                          _FLOP_FORMULAS[torch.ops.aten._scaled_dot_product_flash_attention_backward])
#: Not counted: a detach moves no bytes, and autograd adds one per saved tensor it unpacks when
#: saved-tensor hooks are set (as in the profile's runs), which a training step does not do; a
#: FakeTensor (shape-only profiling) answers ``tensor.device`` through ``prim.device``, no operator.
_UNCOUNTED = frozenset({torch.ops.aten.detach.default, torch.ops.prim.device.default})


def tensor_bytes(values) -> int:
    """Bytes of the tensors in an operator's arguments or outputs (nested tuples, lists, dicts).

    A plain recursion: aten operators take and return only these containers, and pytree's
    generic flattening cost most of the counting time on deep models."""
    if isinstance(values, torch.Tensor):
        return values.nbytes
    if isinstance(values, dict):
        values = values.values()
    elif not isinstance(values, (tuple, list)):
        return 0
    total = 0
    for v in values:  # most arguments are tensors or numbers: recurse only into containers
        if isinstance(v, torch.Tensor):
            total += v.nbytes
        elif isinstance(v, (tuple, list, dict)):
            total += tensor_bytes(v)
    return total


def shape_key(values):
    """``values`` (an operator's arguments or outputs) with each tensor replaced by its shape, lists and dicts
    by tagged tuples: what a shape-wrapped FLOP formula sees, as a dict key (TypeError where unhashable)."""
    if isinstance(values, torch.Tensor):
        return ("T", tuple(values.shape))
    if isinstance(values, (tuple, list)):
        return (type(values).__name__,) + tuple(shape_key(v) for v in values)
    if isinstance(values, dict):
        return ("D",) + tuple((k, shape_key(v)) for k, v in values.items())
    hash(values)
    return values


#: FLOPs of a shape-wrapped formula per (operator, shapes and other arguments): a deep model runs the same
#: few shapes through thousands of layers, and torch's wrapper flattens every call's arguments with pytree.
_FLOPS_OF_SHAPES: Dict[tuple, int] = {}
_FLOPS_CACHE_MAX = 100_000


def _flops(func, formula, args, kwargs, out) -> int:
    """``formula(*args, **kwargs, out_val=out)``, from :data:`_FLOPS_OF_SHAPES` where it reads shapes only."""
    if not flop_formula_reads_shapes_only(formula):
        return formula(*args, **kwargs, out_val=out)
    try:
        key = (func, shape_key(args), shape_key(kwargs), shape_key(out))
        hash(key)
    except TypeError:  # an argument that is no number, string, tensor or container of them
        return formula(*args, **kwargs, out_val=out)
    flops = _FLOPS_OF_SHAPES.get(key)
    if flops is None:
        if len(_FLOPS_OF_SHAPES) >= _FLOPS_CACHE_MAX:
            _FLOPS_OF_SHAPES.clear()
        flops = _FLOPS_OF_SHAPES[key] = formula(*args, **kwargs, out_val=out)
    return flops


class OpCounter(DispatchMode):
    """Per operator but ``detach``: FLOPs (torch's formulas), bytes of its tensors, and one operator."""

    def __init__(self):
        super().__init__()
        self.counts = [0.0, 0.0, 0.0, 0.0]  # flops, bytes of ops with FLOPs, other bytes, ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _UNCOUNTED:
            return out
        formula = _FLOP_FORMULAS.get(func.overloadpacket)
        moved = tensor_bytes(args) + tensor_bytes(out) + (tensor_bytes(kwargs) if kwargs else 0)
        if formula is not None:
            self.counts[0] += _flops(func, formula, args, kwargs, out)
            self.counts[1] += moved
        else:
            self.counts[2] += moved
        self.counts[3] += 1
        return out


def grad_names(model: torch.nn.Module) -> tuple:
    """The parameters of ``model`` that hold a gradient now."""
    return tuple(n for n, p in model.named_parameters() if p.grad is not None)
