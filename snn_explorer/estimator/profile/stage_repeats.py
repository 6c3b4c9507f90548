"""Pipeline stages measured on a few of their repeated blocks: a deep stage's figures composed from cut runs.

A pipeline stage of a deep model is mostly a run of the model's repeated blocks (:mod:`.repeats`, the ones the
profile composed its own runs over: ``profile.composed``). Per micro-batch a stage's figures (bytes it keeps,
saves, holds; operators it runs) are measured by the caller's ``run(stages)``; here every stage runs with its run
of whole blocks cut to 2, 3 and 4 blocks (:data:`STAGE_CUTS`; the units before and after the run as they are), and
the whole stage's figures are the last cut's plus its growth per block times the blocks left out.

Checks, else every stage runs in full (None from :func:`composed_stages`):

- every figure grows by the same amount from 2 to 3 and from 3 to 4 blocks, exactly; a stage without such a run
  (at most 4 whole blocks) runs in full in all three and must not change at all;
- a figure that is a peak over the stage's run (``peaks``) is a maximum over events, each affine in the number
  of blocks: an event before the blocks does not grow, one inside or after them holds per block what some summed
  figures count (what a block keeps and its neuron state; in a first backward also its new gradients), so no
  event grows faster per block than the fastest of those (the peak's bounds). Where the observed peak grows at
  least that fast, the maximum follows a steepest line already and no other overtakes it at more blocks: the peak
  is extended. A peak growing more slowly (an event before the blocks dominating the cut runs) is not;
- a cut run raising what a cut model may raise (:data:`~.repeats.CUT_FAILURES`).

Only the stages of a model as one rank of ``tp = 1`` runs it are composed (a TP replica's repeats are not looked
for).
"""
from __future__ import annotations

from typing import Callable, List, Mapping, Optional, Sequence, Tuple

from .repeats import CUT_FAILURES, Repeats

#: The blocks of a stage's run that the three cut runs keep.
STAGE_CUTS = (2, 3, 4)


def block_run(repeats: Repeats, paths: Sequence[str]) -> Optional[Tuple[int, int, int]]:
    """``(index of its first unit in paths, units per block, blocks)`` of the longest run of whole repeated blocks
    in a stage (``paths``: its unit paths, in order), consecutive blocks with the same units, contiguous in
    ``paths``; None where it has no more than ``STAGE_CUTS[-1]`` such blocks."""
    segments: list = []  # (block, first index, units as (child, rest))
    for i, path in enumerate(paths):
        where = repeats.locate(path)
        if where is None:
            segments.append((None, i, ()))
        elif segments and segments[-1][0] == where[0]:
            segments[-1][2].append(where[1:])
        else:
            segments.append((where[0], i, [where[1:]]))
    best, run = None, []
    for segment in segments + [(None, len(paths), ())]:
        extends = (run and segment[0] is not None and run[-1][0] is not None and segment[0] == run[-1][0] + 1
                   and segment[2] == run[-1][2])
        if not extends:
            if run and run[0][0] is not None and (best is None or len(run) > best[2]):
                best = (run[0][1], len(run[0][2]), len(run))
            run = []
        run.append(segment)
    return best if best is not None and best[2] > STAGE_CUTS[-1] else None


def _cut(paths: Sequence[str], run: Optional[Tuple[int, int, int]], k: int) -> Tuple[str, ...]:
    if run is None:
        return tuple(paths)
    first, per_block, blocks = run
    return tuple(paths[:first + k * per_block]) + tuple(paths[first + blocks * per_block:])


def composed_stages(repeats: Optional[Repeats], stages: Sequence[Sequence[str]],
                    run: Callable[[List[Tuple[str, ...]]], list], flatten: Callable[[object], Tuple[float, ...]],
                    peaks: Optional[Mapping[int, Tuple[int, ...]]] = None) -> Optional[List[Tuple[float, ...]]]:
    """Per stage, ``flatten`` of what ``run(stages)`` gives for it, composed from runs cut to :data:`STAGE_CUTS`
    blocks of each stage's run (:func:`block_run` over ``repeats``); None where ``repeats`` is None, no stage has
    such a run, or a check of the module docstring fails (``peaks``: the index of each figure that is a peak -> the
    indices of the summed figures that bound its growth)."""
    if repeats is None:
        return None
    runs = [block_run(repeats, paths) for paths in stages]
    if not any(runs):
        return None
    try:
        measured = [[tuple(flatten(r)) for r in run([_cut(paths, b, k) for paths, b in zip(stages, runs)])]
                    for k in STAGE_CUTS]
    except CUT_FAILURES:  # the stage needs all its blocks
        return None
    out = []
    for blocks, (first, middle, last) in zip(runs, zip(*measured)):
        growth = [b - a for a, b in zip(first, middle)]
        if any(c - b != g for b, c, g in zip(middle, last, growth)) or (blocks is None and any(growth)):
            return None
        if any(growth[i] < max([0] + [growth[j] for j in bounds]) for i, bounds in (peaks or {}).items()):
            return None
        more = 0 if blocks is None else blocks[2] - STAGE_CUTS[-1]
        out.append(tuple(c + more * g for c, g in zip(last, growth)))
    return out


__all__ = ["STAGE_CUTS", "block_run", "composed_stages"]
