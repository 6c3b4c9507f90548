"""Checkpointing chosen block by block: recompute the blocks whose saved activations cost most, keep the cheap ones.

A plan names its recomputed blocks in ``checkpoint_blocks`` (with ``activation_checkpointing='blocks'``), each by
the path of the block's first unit (a block: an FSDP2 unit with the parameter-free modules after it,
:func:`~.parallelize.checkpointing.block_segments`); ``()`` keeps the uniform choice (every ``checkpoint_every``-th
block). ``apply`` checkpoints exactly the named blocks, the estimator profiles exactly them.

:func:`choose_blocks` picks the set by estimate (the core does not estimate: the caller injects ``peak_estimate``,
as for :func:`~.memory_levers.choose_levers`). Greedy: each block is estimated checkpointed alone; the blocks that
free saved-activation bytes are ordered by bytes freed per second of recompute added, and added in that order
until the budget fits or the estimated peak stops falling (searched only where checkpointing every block lowers the
peak at all; a set of every block is the uniform plan, ``checkpoint_blocks=()``). The set of lowest estimated peak (with a budget: the
first that fits) is the choice, and only if its peak is below the plan's own.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple

from ..common.vocabulary import Checkpointing

#: Models with more blocks than this are not searched block by block (each block costs one estimate more).
MAX_CHOICE_BLOCKS = 32

__all__ = ["MAX_CHOICE_BLOCKS", "BlockChoice", "check_block_choice", "check_checkpoint_blocks", "block_label",
           "with_blocks", "block_choice_applies", "choose_blocks"]


def check_block_choice(plan: Any) -> None:
    """Plan-time check of ``checkpoint_blocks``: only with ``activation_checkpointing='blocks'`` and k = 1, no repeats."""
    chosen = plan.checkpoint_blocks
    if not chosen:
        return
    if plan.activation_checkpointing != Checkpointing.BLOCKS:
        raise ValueError(f"checkpoint_blocks={list(chosen)} names blocks to recompute, which needs "
                         f"activation_checkpointing='blocks', not {plan.activation_checkpointing!r}")
    if plan.checkpoint_every != 1:
        raise ValueError(f"checkpoint_blocks={list(chosen)} and checkpoint_every={plan.checkpoint_every} both say "
                         "which blocks to recompute; give one: checkpoint_every=1 with the named blocks")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"checkpoint_blocks={list(chosen)} names a block twice")


def check_checkpoint_blocks(blocks: Sequence[str], units: Sequence[str]) -> None:
    """Raise ValueError when ``blocks`` (a plan's ``checkpoint_blocks``) names a block the model does not have
    (``units``: the model's blocks, by their first unit's path)."""
    known = set(units)
    unknown = [b for b in blocks if b not in known]
    if unknown:
        raise ValueError(f"checkpoint_blocks names {unknown}, which are not blocks of this model; its blocks are "
                         f"{list(units)}")


def block_label(plan: Any) -> str:
    """``[a,b]`` for a plan that names its recomputed blocks, else ''."""
    return f"[{','.join(plan.checkpoint_blocks)}]" if plan.checkpoint_blocks else ""


def with_blocks(plan: Any, blocks: Sequence[str]) -> Any:
    """``plan`` recomputing exactly ``blocks``."""
    return dataclasses.replace(plan, activation_checkpointing=Checkpointing.BLOCKS, checkpoint_every=1,
                               checkpoint_blocks=tuple(blocks))


@dataclass(frozen=True)
class BlockChoice:
    """The outcome of :func:`choose_blocks`: the chosen plan and its estimate (``plan`` None: no set lowers the
    peak), the sets tried in order (``tried``: (plan, estimate)), and the greedy order of the blocks."""

    plan: Optional[Any]
    estimate: Optional[Any]
    tried: Tuple[Tuple[Any, Any], ...]
    order: Tuple[str, ...]
    probes: int  # estimates of one block alone

    def note(self, base_peak: int) -> str:
        if self.plan is None and not self.probes:
            return (f"checkpointing block by block: not searched, checkpointing every block does not lower the "
                    f"estimated peak of {base_peak} B")
        if self.plan is None:
            return (f"checkpointing block by block: no set of blocks lowers the estimated peak of {base_peak} B "
                    f"({self.probes} blocks probed)")
        named = list(self.plan.checkpoint_blocks) or "every block"
        return (f"checkpointing block by block: {named} recomputed (greedy by saved bytes "
                f"freed per recompute second over {self.probes} blocks), peak {self.estimate.peak_bytes} B against "
                f"{base_peak} B")


def _saved(est: Any) -> int:
    """The estimate's saved-activation bytes (its peak where it states none: an injected stand-in)."""
    return getattr(est, "activations_bytes", est.peak_bytes)


def _greedy_order(plan: Any, units: Sequence[str], base: Any, peak_estimate: Callable[[Any], Any]):
    """The blocks that free saved bytes alone, by bytes freed per second added (most first), and their estimates."""
    alone = {u: peak_estimate(with_blocks(plan, (u,))) for u in units}
    gains = {}
    for u, est in alone.items():
        freed = _saved(base) - _saved(est)
        added = est.step_time_s - base.step_time_s
        if freed > 0:
            gains[u] = (freed / added if added > 0 else float("inf"), freed)
    position = {u: i for i, u in enumerate(units)}
    order = sorted(gains, key=lambda u: (-gains[u][0], -gains[u][1], position[u]))
    return tuple(order), alone


def block_choice_applies(plan: Any, units: Sequence[str]) -> bool:
    """Whether :func:`choose_blocks` searches ``plan``: its checkpointing gate open, not a pipeline, not checkpointed
    yet (nor offloading its activations), 2 .. :data:`MAX_CHOICE_BLOCKS` blocks."""
    return (plan.experimental_features.allow_activation_checkpointing and not plan.uses_pp
            and plan.activation_checkpointing == Checkpointing.NONE and not plan.activation_offload
            and 2 <= len(units) <= MAX_CHOICE_BLOCKS)


def choose_blocks(plan: Any, units: Sequence[str], peak_estimate: Callable[[Any], Any],
                  budget: Optional[int] = None) -> Optional[BlockChoice]:
    """The blocks of ``plan`` (no checkpointing yet; ``units``: the model's blocks) to recompute, by estimate.

    ``peak_estimate(plan)`` returns an object with ``peak_bytes``, ``step_time_s`` and ``activations_bytes`` (the
    estimator's ``PlanEstimate``; without ``activations_bytes`` the blocks are ordered by the peak they lower).
    None where the choice does not apply: its gate closed, a pipeline plan, a plan already checkpointed, fewer
    than 2 or more than :data:`MAX_CHOICE_BLOCKS` blocks. Not searched (a choice of no plan, nothing probed) where
    checkpointing every block does not lower the plan's estimated peak (a model whose memory is mostly
    parameters): a rule of thumb that saves the probes, not a bound (a subset could still lower it).
    """
    if not block_choice_applies(plan, units):
        return None
    base = peak_estimate(plan)
    if peak_estimate(with_blocks(plan, ())).peak_bytes >= base.peak_bytes:
        return BlockChoice(plan=None, estimate=None, tried=(), order=(), probes=0)  # see the doc: not searched
    order, alone = _greedy_order(plan, units, base, peak_estimate)
    tried, best, last = [], None, base.peak_bytes
    for i in range(1, len(order) + 1):
        chosen = tuple(u for u in units if u in order[:i])  # in model order
        if len(chosen) == len(units):
            chosen = ()  # every block: the uniform plan (checkpoint_every=1), one plan under one name
        est = alone[chosen[0]] if i == 1 and chosen else peak_estimate(with_blocks(plan, chosen))
        tried.append((with_blocks(plan, chosen), est))
        if est.peak_bytes < base.peak_bytes and (best is None or est.peak_bytes < best[1].peak_bytes):
            best = tried[-1]
        if (budget is not None and est.peak_bytes <= budget) or est.peak_bytes >= last:
            break  # fits, or the peak stopped falling
        last = est.peak_bytes  # (a set that fits is the lowest so far: every earlier one was above the budget)
    return BlockChoice(plan=best[0] if best else None, estimate=best[1] if best else None, tried=tuple(tried),
                       order=order, probes=len(alone))
