"""Shape-only execution: the profile's runs with tensors that have shapes but no data.

A model that this machine cannot hold (built on the ``meta`` device, or too large for its memory)
is profiled by the same code as any other (:mod:`.profiling`), each run on a copy whose
parameters, buffers and inputs are torch's FakeTensors (``FakeTensorMode``; through
:mod:`snn_explorer.compat`): every operator runs its meta kernel, so shapes, dtypes, storages,
FLOPs, bytes, saved tensors and neuron state come out as a real run gives them, and nothing of
their size is allocated.

A model whose forward reads tensor values (``.item()``, ``if x.sum() > 0``, ``nonzero``, masks
whose size depends on the data) cannot be followed without the data: such a run raises
:class:`ShapeOnlyError`, naming the operator and the module that ran it.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Callable, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ...compat_fake import data_dependent_op, fake_tensor_mode
from ...core.model import reset_all


class ShapeOnlyError(ValueError):
    """The model does something shape-only execution cannot follow (data-dependent control flow)."""


def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor the modules of ``model`` hold: parameters, buffers, neuron state, other attributes."""
    for module in model.modules():
        stack = list(vars(module).values())
        while stack:
            value = stack.pop()
            if isinstance(value, torch.Tensor):
                yield value
            elif isinstance(value, dict):
                stack.extend(value.values())
            elif isinstance(value, (list, tuple)):
                stack.extend(value)


def _copy_with(model: nn.Module, make: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """A deep copy of ``model`` in which each tensor ``t`` it holds is ``make(t)`` (a parameter stays a
    parameter with its ``requires_grad``); nothing of the tensors' size is copied. Fresh neuron state."""
    memo = {}
    for t in _tensors(model):
        if id(t) not in memo:
            new = make(t.detach())
            memo[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
    copied = copy.deepcopy(model, memo)
    reset_all(copied)
    return copied


def _empty_like(t: torch.Tensor, device: str) -> torch.Tensor:
    return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` (real, meta or fake) on the ``meta`` device, with fresh neuron state."""
    return _copy_with(model, lambda t: _empty_like(t, "meta"))


def _module_names(model: nn.Module) -> dict:
    return {id(m): name or "the model" for name, m in model.named_modules()}


@contextlib.contextmanager
def _running_module(model: nn.Module) -> Iterator[List[str]]:
    """The paths of the modules of ``model`` running now, innermost last (global module hooks)."""
    names, stack = _module_names(model), []

    def pre(module, args):
        if id(module) in names:
            stack.append(names[id(module)])

    def post(module, args, out):
        if id(module) in names and stack:
            stack.pop()

    hooks = (nn.modules.module.register_module_forward_pre_hook(pre),
             nn.modules.module.register_module_forward_hook(post))
    try:
        yield stack
    finally:
        for hook in hooks:
            hook.remove()


def _refusal(op: str, exc: Exception, where: List[str]) -> ShapeOnlyError:
    place = f"in module {where[-1]!r} (forward)" if where else "outside any module's forward (the loss or the backward)"
    return ShapeOnlyError(
        f"shape-only profiling cannot follow this model: operator {op} {place} needs tensor values "
        f"({type(exc).__name__}: data-dependent control flow such as .item(), bool(tensor) or nonzero); profile it "
        "on real tensors (a smaller size that fits this machine), or make that step depend on shapes only")


def fake_copy(model: nn.Module):
    """``(copy, mode)``: a copy of ``model`` (real, meta or fake) whose tensors are FakeTensors of a new fake
    mode, and that mode; run the copy inside :func:`following`."""
    mode = fake_tensor_mode()
    with mode:
        return _copy_with(model, lambda t: _empty_like(t, "cpu")), mode


@contextlib.contextmanager
def following(fake: nn.Module, mode) -> Iterator[None]:
    """The body under the fake ``mode``; a data-dependent operator in it raises :class:`ShapeOnlyError`
    naming the operator and the module of ``fake`` that ran it (module doc)."""
    with mode, _running_module(fake) as where:
        try:
            yield
        except RuntimeError as exc:
            op = data_dependent_op(exc)
            if op is None:
                raise
            raise _refusal(op, exc, where) from exc


@contextlib.contextmanager
def step_runner(model: nn.Module, shape_only: bool) -> Iterator[Tuple[nn.Module, Callable]]:
    """``(model to run, convert)``: ``model`` itself and the identity, or with ``shape_only`` a fake copy
    of it (real or meta) and the conversion of its inputs to fake tensors, the body run under the
    fake mode (:func:`following`)."""
    if not shape_only:
        yield model, _same
        return
    fake, mode = fake_copy(model)
    with following(fake, mode):
        yield fake, to_fake


def _same(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return x


def to_fake(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A fake tensor of ``x``'s shape, strides and dtype (call under the fake mode); None stays None."""
    return None if x is None else _empty_like(x, "cpu")


def has_meta_tensors(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the ``meta`` device (it holds no data to run on)."""
    return any(t.device.type == "meta" for t in list(model.parameters()) + list(model.buffers()))
