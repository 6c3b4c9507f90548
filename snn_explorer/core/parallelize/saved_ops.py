"""Op-level selective activation checkpointing: which operators' outputs a checkpointed block keeps.

torchtitan's ``selective`` AC with option ``op`` wraps every transformer block in
``torch.utils.checkpoint`` with a policy (``create_selective_checkpoint_contexts``): the outputs of
the expensive operators -- matrix products (``aten.mm``), the flash / efficient attention kernels,
``reduce_scatter_tensor`` -- are saved in the forward, every other operator is recomputed in the
backward; of the matrix products only the 1st, 3rd, 5th, ... of each block's forward are saved, the
2nd, 4th, ... recomputed (torchtitan ``parallelize_llama.py``: "saves output of all compute ops, except
every second mm"; the count restarts in each block and again in its recompute). :data:`TORCHTITAN_OPS`
is that policy; the operator objects come from :mod:`snn_explorer.compat`.

A policy is one object the plan's ``activation_checkpointing="ops"`` stands for; :meth:`SavedOps.context_fn`
gives ``checkpoint(..., context_fn=...)`` a fresh pair of contexts (and a fresh mm count) per region call.
``tally`` (a ``Counter``) hears each forward decision as ``(operator, "save" | "recompute")``.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ...compat import SAC_MM, SAC_SAVED_OPS

__all__ = ["SavedOps", "TORCHTITAN_OPS"]

SAVE, RECOMPUTE = "save", "recompute"


@dataclass(frozen=True)
class SavedOps:
    """The operators whose outputs a checkpointed region keeps; every ``alternate_every``-th call of
    ``alternate`` in one region's forward is recomputed all the same (``alternate_every=0``: never)."""

    name: str
    ops: Tuple[object, ...]
    alternate: Optional[object] = None
    alternate_every: int = 0

    def saves(self, func, calls: int) -> bool:
        """Whether the ``calls``-th call (from 1, in this region's pass) of ``func`` keeps its output."""
        if func not in self.ops:
            return False
        return not (func == self.alternate and self.alternate_every and calls % self.alternate_every == 0)

    def context_fn(self, tally: Optional[Counter] = None) -> Callable:
        """``checkpoint``'s ``context_fn``: each region call counts its forward and its recompute apart."""
        def contexts():
            calls: Counter = Counter()

            def policy(ctx, func, *args, **kwargs):
                mode = RECOMPUTE if ctx.is_recompute else "forward"
                if func == self.alternate:
                    calls[mode] += 1
                keep = self.saves(func, calls[mode])
                if tally is not None and not ctx.is_recompute:
                    tally[(str(func), SAVE if keep else RECOMPUTE)] += 1
                return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

            return create_selective_checkpoint_contexts(policy)

        return contexts


#: torchtitan's "selective op" policy (module doc; the CPU flash kernel as compat notes).
TORCHTITAN_OPS = SavedOps(name="torchtitan-op", ops=SAC_SAVED_OPS, alternate=SAC_MM, alternate_every=2)
