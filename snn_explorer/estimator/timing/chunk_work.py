"""The replay work of time chunks at any chunk size and time steps, composed per chunk.

Time chunks of k steps (``activation_checkpointing='time_chunks'``) recompute each step in backward, and the first
step of a chunk's backward replays the chunk's earlier steps without gradients (``core.parallelize.checkpointing``).
A step of T time steps so does, beyond the plain step, per-step work (each step's recompute and its state
handling: linear in T) and per-chunk work: a chunk of L >= 2 steps replays L - 1 of them from a copy of its entry
state, so its work is ``a + b * L`` (b, per step, joins the linear part; a, per chunk, does not), and a chunk of
one step replays nothing (its own figure). The step's work of chunks of k is therefore::

    W(N, T) = bilinear(N, T) + per_chunk(N) * long(T, k) + per_single(N) * single(T, k)

with ``long`` the chunks of two or more steps (``T // k``, and the rest if it is 2 or more) and ``single`` 1 where
the last chunk has one step. The profile counts a variant's work at T = 2 and 3 (:data:`~..profile.profiling.SIZES`)
and fits it linearly in T; :func:`chunked_work` adds what that fit leaves out: each per-chunk figure times the
chunk count's departure from its own line through T = 2 and 3. ``per_chunk`` and ``per_single`` are differences of
counted steps at one T, so the plain step's own work cancels: ``per_chunk = W_2(4) - W_4(4)`` (two chunks of 2
against one of 4) and ``per_single = W_2(3) - W_4(3)`` (a chunk of 2 and one of 1 against one of 3), each at the
profile's two batch sizes (affine in N, as every figure of the profile). Eight counted steps, shared by every chunk
size of a profile.

Exact where every step after the first does the same work (the assumption of the profile's own fit in T):
``tests/unit/test_chunk_work.py`` compares it with steps counted at the plan's own size. What the profile's fit in T
itself misses stays: on the zoo mlp the backward's other bytes grow slightly faster than linearly in T (its
``torch.stack`` of the steps): 1,920 B at T = 8 and batch 2 (0.05 %), the same with chunks. Under spike compression the
per-chunk figures are the uncompressed ones (a replay runs without gradients, so it packs nothing): on the zoo mlp
at T = 8, k = 2, 4, 8, the composed figures equal the compressed chunked step counted at T = 8 but for that same
stack term (3,840 B, 0.09 % of the backward's other bytes).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Tuple

from ...core.common import Checkpointing
from ..profile.checkpointed import CheckpointedProfile
from ..profile.profiling import FIT_BATCHES, FIT_STEPS, Fit, ModelProfile
from ..profile.step import batch_slice, input_as

#: (chunk size, time steps) of the counted steps the per-chunk figures are read from: per_chunk = [0] - [1],
#: per_single = [2] - [3]
CHUNK_RUNS = ((2, 4), (4, 4), (2, 3), (4, 3))

__all__ = ["CHUNK_RUNS", "ChunkedFit", "chunk_counts", "chunked_work", "time_chunks_of"]


def chunk_counts(t: int, every: int) -> Tuple[int, int]:
    """(chunks of two or more steps, chunks of one step) of ``t`` time steps in chunks of ``every``."""
    full, rest = divmod(t, every)
    if every == 1:
        return 0, full
    return full + (rest >= 2), int(rest == 1)


def _off_line(t: int, every: int) -> Tuple[float, float]:
    """Each chunk count of ``t`` steps minus its line through the profile's time steps (what a fit in T misses)."""
    (t1, t2), now = FIT_STEPS, chunk_counts(t, every)
    first, second = chunk_counts(t1, every), chunk_counts(t2, every)
    return tuple(c - (a + (b - a) * (t - t1) / (t2 - t1)) for c, a, b in zip(now, first, second))


@dataclass(frozen=True)
class ChunkedFit:
    """A figure of a time-chunked step: ``fit`` (linear in T) plus the per-chunk figures (each a :class:`Fit` in N)
    times the chunk counts' departure from their line through the profile's time steps; callable as a Fit."""

    fit: Fit
    per_chunk: Fit
    per_single: Fit
    every: int

    def __call__(self, n: int, t: int) -> float:
        long, single = _off_line(t, self.every)
        return max(0.0, self.fit(n, t) + _in_n(self.per_chunk, n) * long + _in_n(self.per_single, n) * single)


def _in_n(fit: Fit, n: int) -> float:
    """A per-chunk figure at ``n`` samples, unclamped (a replay can do less than a fit's line, as its chunks
    replay one step fewer than they hold)."""
    return fit.c0 + fit.c1 * n


def time_chunks_of(profile: ModelProfile) -> Optional[CheckpointedProfile]:
    """``profile`` if it is the :class:`CheckpointedProfile` of time chunks of two or more steps, else None (a
    spike-compressed or offloaded profile's work is its base's: :func:`~.compute_work.rank_work`)."""
    plan = getattr(profile, "plan", None)
    if not isinstance(profile, CheckpointedProfile) or plan.activation_checkpointing != Checkpointing.TIME_CHUNKS:
        return None
    return profile if plan.checkpoint_every >= 2 else None


def _counted(profile: CheckpointedProfile, tp_plan: Optional[Mapping[str, str]], tp: int, count: Callable,
             sizes) -> dict:
    """``count(model, x, labels)`` of the rank model in chunks of each ``every``, at each ``(every, n, t)`` of
    ``sizes`` (one :class:`CheckpointedProfile` per chunk size: a copy of ``profile`` with its own models)."""
    sized = {}
    for every in sorted({every for every, _, _ in sizes}):
        plan = dataclasses.replace(profile.plan, checkpoint_every=every)
        sized[every] = dataclasses.replace(profile, plan=plan, checkpointed={}, flops={}, peaks={}, logs={},
                                           saved_state={})
    counts = {}
    for every, n, t in sizes:
        x, y = batch_slice(profile.example_input, profile.labels, n, t, layout=profile.layout)
        with sized[every].runner(tp_plan, tp, profile.shape_only) as (model, convert):
            counts[every, n, t] = count(model, convert(input_as(x, profile.dtype)), convert(y))
    return counts


def _per_chunk_figures(profile: CheckpointedProfile, tp_plan, tp: int, count: Callable) -> list:
    """Per phase (forward, backward) and figure (FLOPs, FLOP bytes, other bytes, operators): (per_chunk,
    per_single) as Fits in N, from :data:`CHUNK_RUNS` at the profile's batch sizes; cached per layout (on the
    dict every chunk size of one profile shares)."""
    key = (profile.rank_model(tp_plan, tp)[0], profile.plan.time_step_module, profile.shape_only)
    if key not in profile.chunk_figures:
        counts = _counted(profile, tp_plan, tp, count, [(every, n, t) for n in FIT_BATCHES for every, t in CHUNK_RUNS])
        by_n = {n: [counts[every, n, t] for every, t in CHUNK_RUNS] for n in FIT_BATCHES}
        figures = []
        for phase in range(2):
            row = []
            for k in range(4):
                diffs = {n: [float(r[phase][k]) for r in runs] for n, runs in by_n.items()}
                chunk, single = ([d[i] - d[i + 1] for d in diffs.values()] for i in (0, 2))
                row.append((Fit.of(chunk[0], chunk[1], chunk[0], chunk[1]),
                            Fit.of(single[0], single[1], single[0], single[1])))
            figures.append(row)
        profile.chunk_figures[key] = figures
    return profile.chunk_figures[key]


def chunked_work(work: Any, profile: CheckpointedProfile, tp_plan: Optional[Mapping[str, str]], tp: int,
                 count: Callable) -> Any:
    """``work`` (a ``compute_work.Work`` counted at the profile's sizes on the model in ``profile``'s time chunks)
    with its forward and backward figures composed per chunk (see the module doc; ``count(model, x, labels)``:
    ``compute_work.counted_pass``); the optimizer's does not depend on T."""
    figures = _per_chunk_figures(profile, tp_plan, tp, count)
    every = profile.plan.checkpoint_every
    phases = []
    for phase, row in zip((work.forward, work.backward), figures):
        names = [f.name for f in dataclasses.fields(phase)]  # FLOPs, FLOP bytes, other bytes, operators
        phases.append(dataclasses.replace(phase, **{name: ChunkedFit(getattr(phase, name), chunk, single, every)
                                                    for name, (chunk, single) in zip(names, row)}))
    return dataclasses.replace(work, forward=phases[0], backward=phases[1])
