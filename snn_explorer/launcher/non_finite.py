"""NaN / Inf in a run's loss or gradients, found on any rank and agreed by all of them.

Before each optimizer step (a step pre-hook on the optimizer the run built) every rank checks
its own gradients, and after each step the loss its step function returned; the ranks agree
with one small all-reduce, so every rank names the same step and ranks. ``on_non_finite``:

* ``"stop"`` (default): raise :class:`NonFiniteError` before the optimizer applies the update
  (or, for a loss without non-finite gradients, right after the step) and before any checkpoint
  of that step is written, so the last good checkpoint stays the latest;
* ``"skip"``: drop that step's gradients so the optimizer leaves every parameter as it was (as
  fp16 loss scaling skips a step with overflowed gradients), report it and go on.

A plan with an fp16 loss scaler skips overflowed steps itself: its gradients are left to it.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional

import torch
import torch.distributed as dist

ACTIONS = ("stop", "skip")


class NonFiniteError(RuntimeError):
    """A NaN or Inf loss or gradient; the message names the step and the ranks."""


def check_action(on_non_finite: Any) -> str:
    if on_non_finite not in ACTIONS:
        raise ValueError(f"on_non_finite={on_non_finite!r}; expected one of {ACTIONS}")
    return on_non_finite


def _bad_ranks(bad: bool, device: torch.device) -> List[int]:
    """The ranks whose ``bad`` is True (every rank calls this: a collective)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [0] if bad else []
    flags = torch.zeros(dist.get_world_size(), device=device)
    flags[dist.get_rank()] = float(bad)
    dist.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f]


def _local_grads_finite(optimizer) -> bool:
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is not None:
                local = g.to_local() if hasattr(g, "to_local") else g
                if not bool(torch.isfinite(local).all()):
                    return False
    return True


class NonFiniteGuard:
    """Watches one rank's run; ``step`` is the step being made (set by the loop)."""

    def __init__(self, runtime, optimizer, action: str):
        self.action, self.device, self.step = check_action(action), runtime.device, 0
        self.skipped: List[int] = []
        self._optimizer = getattr(optimizer, "optim", optimizer)  # ZeRO's local partition optimizer
        if optimizer is not None and runtime.scaler is None:
            self._optimizer.register_step_pre_hook(self._before_update)

    def _message(self, what: str, ranks: List[int]) -> str:
        return (f"step {self.step}: non-finite {what} (NaN or Inf) on rank(s) {ranks}; stopped before the update "
                "of this step and before any checkpoint of it, so the last good checkpoint stays the latest "
                "(on_non_finite='skip' skips such steps instead)")

    def _before_update(self, optimizer, args, kwargs) -> None:
        ranks = _bad_ranks(not _local_grads_finite(optimizer), self.device)
        if not ranks:
            return
        if self.action == "stop":
            raise NonFiniteError(self._message("gradients", ranks))
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None  # torch's optimizers leave a parameter without a gradient as it is
        self.skipped.append(self.step)

    def after_step(self, loss: Optional[float]) -> bool:
        """Check this step's loss on every rank; False when the step was skipped (report it)."""
        bad = isinstance(loss, float) and not math.isfinite(loss)
        ranks = _bad_ranks(bad, self.device)
        if ranks and self.action == "stop":
            raise NonFiniteError(self._message("loss", ranks))
        if ranks and self.step not in self.skipped:
            self.skipped.append(self.step)
        return self.step not in self.skipped
