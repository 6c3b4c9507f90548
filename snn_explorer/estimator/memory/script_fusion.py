"""``torch.jit.script`` functions a model calls, traced as the one fused kernel a GPU runs.

On CUDA, TorchScript's profiling executor hands a scripted function's chain of elementwise
operators to its fuser (NVFuser / NNC, after the profiling runs), which runs the chain as one
kernel: it reads the function's inputs once and writes its outputs once, the intermediates stay in
registers. spikingjelly's neurons step through time in Python calling such functions (their
``jit_*`` charge and reset static methods; snnTorch-style models call module-level ones), so counted
operator by operator a step would pay a launch and a round trip to memory per operator.

:func:`fused_script_calls` wraps, for the span of a trace, every :class:`torch.jit.ScriptFunction`
that the model's module classes reach by name (a static method of the class or of a base class,
or a global of the module that defines the class) so that the trace's meter records the call as one
``memory`` kernel: the bytes of the call's tensor arguments and of its outputs, one launch. Kernels
with FLOPs inside the call (a matmul) stay as they are. The backward of such a call is traced as
autograd runs it, operator by operator (not fused here).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Callable, List, Tuple

import torch
from torch import nn

from ...compat import tree_leaves


def _tensor_bytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def _fused(fn, meter) -> Callable:
    """``fn`` (a script function) recording its elementwise kernels in ``meter`` as one kernel."""
    def call(*args, **kwargs):
        start = len(meter.kernels)
        out = fn(*args, **kwargs)
        inside = meter.kernels[start:]
        elementwise = [k for k in inside if k.kind == "memory"]
        if elementwise:
            kept = [k for k in inside if k.kind != "memory"]
            first = elementwise[0]
            moved = _tensor_bytes((args, kwargs)) + _tensor_bytes(out)
            del meter.kernels[start:]
            meter.kernels.extend(kept + [type(first)(first.phase, "memory", 0.0, moved, first.itemsize, 1)])
        return out
    call.__wrapped__ = fn
    return call


def _targets(model: nn.Module) -> List[Tuple[object, str, object]]:
    """``(owner, name, value)`` of every script function the model's classes reach (module doc)."""
    found, seen = [], set()
    for cls in {type(m) for m in model.modules()}:
        for owner in [c for c in cls.__mro__ if c is not object] + [sys.modules.get(cls.__module__)]:
            if owner is None or id(owner) in seen:
                continue
            seen.add(id(owner))
            for name, value in list(vars(owner).items()):
                fn = value.__func__ if isinstance(value, staticmethod) else value
                if isinstance(fn, torch.jit.ScriptFunction):
                    found.append((owner, name, value))
    return found


@contextlib.contextmanager
def fused_script_calls(model: nn.Module, meter):
    """Within the block, the model's script functions record into ``meter`` as fused kernels (module doc)."""
    targets = _targets(model)
    try:
        for owner, name, value in targets:
            fn = value.__func__ if isinstance(value, staticmethod) else value
            wrapped = _fused(fn, meter)
            setattr(owner, name, staticmethod(wrapped) if isinstance(value, staticmethod) else wrapped)
        yield [name for _, name, _ in targets]
    finally:
        for owner, name, value in targets:
            setattr(owner, name, value)
