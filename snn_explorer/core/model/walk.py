"""One walk over a model: answers that several finders ask of the same modules, computed once.

An analysis asks the same questions of a model from several finders (TP chains, conv runs, residual
blocks, attention blocks, pipeline units, stateful neurons); on a 10 000-module model the repeats
cost seconds. Inside :func:`one_walk` each answer is kept by the module's id; outside it nothing is
kept. The model must not change inside the block.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Optional, TypeVar

from torch import nn

T = TypeVar("T")
#: The answers of the active walk, keyed by (question, module id, ...); None outside a walk.
_WALK: ContextVar[Optional[dict]] = ContextVar("snn_explorer_walk", default=None)


@contextmanager
def one_walk():
    """Within the block, :func:`memo` computes each answer once (nested walks share the outer one)."""
    token = _WALK.set({}) if _WALK.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _WALK.reset(token)


def memo(key: tuple, compute: Callable[[], T]) -> T:
    """``compute()``, kept under ``key`` for the rest of the active walk (recomputed outside one)."""
    answers = _WALK.get()
    if answers is None:
        return compute()
    if key not in answers:
        answers[key] = compute()
    return answers[key]


def modules_by_name(model: nn.Module) -> dict:
    """``dict(model.named_modules())``, walked once per walk."""
    return memo(("modules", id(model)), lambda: dict(model.named_modules()))


def named_parameters_all(model: nn.Module) -> list:
    """``list(model.named_parameters(remove_duplicate=False))`` (a shared parameter under each of its
    paths), walked once per walk."""
    return memo(("parameters", id(model)), lambda: list(model.named_parameters(remove_duplicate=False)))


def holds_parameters(module: nn.Module) -> bool:
    """Whether ``module`` or a module under it holds a parameter (``any(module.parameters())``),
    each module's answer computed once per walk."""
    return memo(("holds", id(module)), lambda: any(p is not None for p in module._parameters.values())
                or any(holds_parameters(c) for c in module._modules.values() if c is not None))


def trainable_count(model: nn.Module) -> int:
    """Elements of the parameters that require grad, each shared parameter once."""
    unique = {id(p): p for _, p in named_parameters_all(model)}
    return sum(p.numel() for p in unique.values() if p.requires_grad)
