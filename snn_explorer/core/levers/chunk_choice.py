"""Time chunks sized by estimate: the ``checkpoint_every`` of ``activation_checkpointing='time_chunks'``.

A chunk of k time steps keeps one copy of the neuron state at its start (fewer copies as k grows) and its backward
replays the chunk's earlier steps to recompute each one (more recompute as k grows), so the size trades peak
against step time, and the trade is the estimate's to judge, not a fixed k. :func:`choose_chunks` estimates every
power of two k = 1, 2, 4, ... below the T the estimates state (``time_steps``, as the estimator's ``PlanEstimate``
does) and k = T, one chunk of every step; where they state none (a stand-in), until two sizes in a row estimate
alike (peak and step time) or :data:`MAX_CHUNK`. Without a budget it keeps the size of lowest estimated peak
(ties: the faster, then the smaller k), with a budget the fastest whose peak fits (ties: the smaller k, which
replays less; none fits: the lowest peak), and either only if its peak is below the plan's own. The estimator
composes each size's replays per chunk (``estimator.timing.chunk_work``), so its step time grows with k as the
replayed steps do (T - ceil(T / k)). The core does not estimate: the caller injects ``peak_estimate`` (as for
:func:`~.memory_levers.choose_levers`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from ..common.vocabulary import Checkpointing

#: The largest chunk size estimated (a model of more time steps is chunked at most this coarsely).
MAX_CHUNK = 1 << 12

__all__ = ["MAX_CHUNK", "ChunkChoice", "chunked", "chunk_choice_applies", "choose_chunks"]


def chunked(plan: Any, time_step_module: str, every: int) -> Any:
    """``plan`` checkpointing chunks of ``every`` steps of ``time_step_module``."""
    return dataclasses.replace(plan, activation_checkpointing=Checkpointing.TIME_CHUNKS, checkpoint_every=every,
                               time_step_module=time_step_module, checkpoint_blocks=())


@dataclass(frozen=True)
class ChunkChoice:
    """The outcome of :func:`choose_chunks`: the chosen plan and its estimate (``plan`` None: no size lowers the
    peak), every size tried in order (``tried``: (plan, estimate)), and the budget it was chosen for."""

    plan: Optional[Any]
    estimate: Optional[Any]
    tried: Tuple[Tuple[Any, Any], ...]
    budget: Optional[int] = None

    def note(self, base_peak: int) -> str:
        sizes = ", ".join(f"{p.checkpoint_every}: {e.peak_bytes} B / {e.step_time_s * 1e3:.3f} ms"
                          for p, e in self.tried)
        if self.plan is None:
            return f"time chunks: no size lowers the estimated peak of {base_peak} B (k: peak / step {sizes})"
        rule = (f"the fastest whose peak fits {self.budget} B" if self.budget is not None
                and self.estimate.peak_bytes <= self.budget else "the lowest estimated peak")
        return (f"time chunks of {self.plan.checkpoint_every} steps chosen by estimate ({rule}): peak "
                f"{self.estimate.peak_bytes} B against {base_peak} B without (k: peak / step {sizes})")


def chunk_choice_applies(plan: Any, time_step_module: Optional[str]) -> bool:
    """Whether :func:`choose_chunks` sizes ``plan``'s time chunks: a module stepped once per time step, the
    checkpointing gate open, no pipeline, no checkpointing yet (nor activation offload)."""
    return (time_step_module is not None and plan.experimental_features.allow_activation_checkpointing
            and not plan.uses_pp and plan.activation_checkpointing == Checkpointing.NONE
            and not plan.activation_offload)


def _sized(plan: Any, time_step_module: str, peak_estimate: Callable[[Any], Any], time_steps: Optional[int]):
    """(plan, estimate) of every power-of-two chunk size below ``time_steps`` and of ``time_steps`` itself; with
    ``time_steps`` None, until two in a row estimate alike or :data:`MAX_CHUNK`."""
    last = min(time_steps or MAX_CHUNK, MAX_CHUNK)
    sizes = [1 << i for i in range(last.bit_length()) if 1 << i < last] + [last]
    tried = []
    for k in sizes:
        p = chunked(plan, time_step_module, k)
        est = peak_estimate(p)
        if time_steps is None and tried and \
                (est.peak_bytes, est.step_time_s) == (tried[-1][1].peak_bytes, tried[-1][1].step_time_s):
            break  # taken as one chunk of every step from here on
        tried.append((p, est))
    return tried


def choose_chunks(plan: Any, time_step_module: Optional[str], peak_estimate: Callable[[Any], Any],
                  budget: Optional[int] = None) -> Optional[ChunkChoice]:
    """The chunk size of ``plan``'s time chunks (``plan``: no checkpointing yet), by estimate (see the module doc);
    None where the choice does not apply (:func:`chunk_choice_applies`)."""
    if not chunk_choice_applies(plan, time_step_module):
        return None
    base_est = peak_estimate(plan)
    base = base_est.peak_bytes
    tried = _sized(plan, time_step_module, peak_estimate, getattr(base_est, "time_steps", None))
    lower = [(p, e) for p, e in tried if e.peak_bytes < base]
    fitting = [(p, e) for p, e in lower if budget is not None and e.peak_bytes <= budget]
    if fitting:
        best = min(fitting, key=lambda pe: (pe[1].step_time_s, pe[0].checkpoint_every))
    elif lower:
        best = min(lower, key=lambda pe: (pe[1].peak_bytes, pe[1].step_time_s, pe[0].checkpoint_every))
    else:
        best = (None, None)
    return ChunkChoice(plan=best[0], estimate=best[1], tried=tuple(tried), budget=budget)
