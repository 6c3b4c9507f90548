"""The points where FSDP2 acts, logged on one forward and backward of a model that is not sharded.

FSDP2 allocates and frees at fixed points of each unit's forward and backward (see
:mod:`..memory.fsdp_timeline`). :func:`record` hooks those points (forward pre/post, gradients of a
call's outputs and of its inputs, each gradient accumulated, the end of the backward) for the
model's FSDP2 units and logs a :class:`~.meter.StorageMeter`'s bytes at each and its peak since the
one before, so that any plan's FSDP2 buffers can be replayed on the one run.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

from ...compat import queue_callback, tree_leaves, tree_map
from .meter import StorageMeter


class _Once(torch.autograd.Function):
    """Identity on a call's inputs whose backward marks the call's post-backward (as FSDP2's)."""

    @staticmethod
    def forward(ctx, callback, *inputs):
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None,) + grads



@dataclass
class EventLog:
    """What :func:`record` saw: ``(kind, module path or parameter, bytes, peak since the last)``."""

    units: Tuple[str, ...]
    grad_bytes: Dict[str, int]
    events: List[tuple] = field(default_factory=list)

    #: Per event, the number of kernels the meter had recorded by then (a GPU trace's meter records them:
    #: :mod:`..memory.gpu_trace`; 0 otherwise), which places each unit's kernels in the step
    kernel_at: List[int] = field(default_factory=list)

    def mark(self, meter: StorageMeter, kind: str, what: str = "") -> None:
        self.events.append((kind, what, meter.current, meter.restart_peak()))
        self.kernel_at.append(len(getattr(meter, "kernels", ())))


@contextlib.contextmanager
def record(model: nn.Module, units: Sequence[str], meter: StorageMeter):
    """Log, within the block, the points where FSDP2 acts for ``units`` (and the root) as the
    model runs one forward and backward; ``meter`` counts the model's bytes meanwhile."""
    params = dict(model.named_parameters())
    log = EventLog(tuple(units), {n: p.numel() * p.element_size() for n, p in params.items() if p.requires_grad})
    queued = []

    def pre(path):
        def hook(module, args, kwargs):
            log.mark(meter, "pre_forward", path)
            tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.requires_grad]
            if not tensors or not torch.is_grad_enabled():
                return None
            marked = iter(_Once.apply(lambda: log.mark(meter, "post_backward", path), *tensors))
            return tree_map(lambda a: next(marked) if isinstance(a, torch.Tensor) and a.requires_grad else a,
                            (args, kwargs))
        return hook

    def pre_backward(path):
        def hook(grad):
            if not path and not queued:  # as FSDP2's root: the end of the backward is a callback
                queued.append(True)
                queue_callback(lambda: log.mark(meter, "end_backward"))
            log.mark(meter, "pre_backward", path)
        return hook

    def post(path):
        def hook(module, args, output):
            log.mark(meter, "post_forward", path)
            for out in tree_leaves(output):
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.register_hook(pre_backward(path))
        return hook

    hooks = []
    for path in ("",) + tuple(u for u in units if u):
        module = model.get_submodule(path)
        hooks.append(module.register_forward_pre_hook(pre(path), with_kwargs=True))
        hooks.append(module.register_forward_hook(post(path)))
    for name in log.grad_bytes:
        hooks.append(params[name].register_post_accumulate_grad_hook(
            lambda p, n=name: log.mark(meter, "accumulated", n)))
    try:
        yield log
    finally:
        for h in hooks:
            h.remove()
