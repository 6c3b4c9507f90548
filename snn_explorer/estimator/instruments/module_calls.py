"""ModuleCalls: forward hooks on every module of a model, recording per module its calls, the
elements it took and gave, whether its input needed a gradient, and which module runs now."""
from __future__ import annotations

from typing import Dict, List

import torch
from torch import nn

from ...compat import tree_leaves


def _numel(obj) -> int:
    """Elements of a tensor, or of the first tensor of a tuple or list (0 for anything else)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel()
    if isinstance(obj, (tuple, list)):
        return _numel(obj[0]) if obj else 0
    return 0


def _requires_grad(args) -> bool:
    if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):  # most calls: no flattening
        return True
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in tree_leaves(args))


class ModuleCalls:
    """Pre- and post-forward hooks on every module of ``model`` (removed by :meth:`remove`): ``calls``,
    ``ins`` and ``outs`` (elements), ``needs_grad`` and ``in_itemsize`` per module name; :attr:`current` the innermost
    module running now ('' outside any)."""

    def __init__(self, model: nn.Module):
        self.names = {m: n for n, m in model.named_modules()}
        self.stack: List[str] = []
        self.calls: Dict[str, int] = {}
        self.ins: Dict[str, int] = {}
        self.outs: Dict[str, int] = {}
        self.needs_grad: Dict[str, bool] = {}
        self.in_itemsize: Dict[str, int] = {}  # bytes per element of each module's first input
        self.hooks = ([m.register_forward_pre_hook(self._pre) for m in self.names]
                      + [m.register_forward_hook(self._post) for m in self.names])

    def _pre(self, module, args):
        name = self.names[module]
        self.stack.append(name)
        self.calls[name] = self.calls.get(name, 0) + 1
        self.ins[name] = self.ins.get(name, 0) + _numel(args)
        self.needs_grad[name] = self.needs_grad.get(name, False) or _requires_grad(args)
        if name not in self.in_itemsize and args and isinstance(args[0], torch.Tensor):
            self.in_itemsize[name] = args[0].element_size()

    def _post(self, module, args, out):
        name = self.stack.pop()
        self.outs[name] = self.outs.get(name, 0) + _numel(out)

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    def clear_counts(self) -> None:
        """Forget the calls and sizes seen so far (not whether inputs needed a gradient)."""
        self.calls.clear(), self.ins.clear(), self.outs.clear()

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
