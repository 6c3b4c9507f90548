"""Totals of a levered model's run composed from runs cut to a few of its repeated blocks.

A lever variant's profile (checkpointing, :mod:`.checkpointed`; spike compression,
:mod:`..memory.spike_compression`) measures totals of one run of the model as one rank runs it: the
bytes a forward leaves for the backward, the neuron state, the FLOPs of a step. Each is a sum over
modules, so on a model of repeated blocks (:mod:`.repeats`) it grows by the same amount per block,
provided every block runs the same: checkpointing may not. Its regions start at some blocks (every
k-th, or those named): the pattern of regions over the repeats is periodic with some stride ``s``
from some block on (:func:`stride_cuts`). The totals are then measured on the model cut to ``k1``,
``k1 + s`` and ``k1 + 2 s`` repeats (``k1`` at least 2, congruent to the whole count modulo ``s``),
checked to grow by the same amount both times (every figure, exactly), and extended to the whole
count (:func:`affine_total`). Where the pattern has no such stride, the cut runs raise, or they do
not grow alike, the caller measures the whole model.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

from torch import nn

from .repeats import CUT_FAILURES, Repeats, cut

#: The longest stride (in repeats) of a checkpointing pattern looked for.
MAX_STRIDE = 8


def region_pattern(repeats: Repeats, starts: Sequence[Tuple[str, int]]) -> Optional[list]:
    """Per repeat of ``repeats``, the regions (``(path, children)``) that start inside it (child in the block, rest
    of the path, children); None where a region runs past the end of its repeat (a cut would split it)."""
    pattern: list = [set() for _ in range(repeats.count)]
    for path, children in starts:
        where = repeats.locate(path)
        if where is None:
            continue
        block, child, rest = where
        if child + children > repeats.period:
            return None
        pattern[block].add((child, rest, children))
    return [frozenset(p) for p in pattern]


def pattern_stride(repeats: Repeats, starts: Optional[Sequence[Tuple[str, int]]]) -> Optional[Tuple[int, int]]:
    """``(s, first)``: the shortest stride ``s`` (at most :data:`MAX_STRIDE`) with which the regions ``starts``
    (``core.parallelize.checkpointing.region_starts``; () for the plain model) repeat over ``repeats`` from block
    ``first`` on, leaving room for three cuts a stride apart and a repeat beyond; None where there is none, a
    region crosses a repeat's end, or ``starts`` is None."""
    pattern = None if starts is None else region_pattern(repeats, starts)
    if pattern is None:
        return None
    count = repeats.count
    for s in range(1, MAX_STRIDE + 1):
        # the first block from which the pattern repeats every s blocks to the end
        first = count - s
        while first > 0 and pattern[first - 1] == pattern[first - 1 + s]:
            first -= 1
        if _first_cut(first, s, count) + 2 * s < count:
            return s, first
    return None


def _first_cut(first: int, s: int, count: int) -> int:
    """The smallest cut of at least 2 repeats and ``first`` congruent to ``count`` modulo ``s``."""
    k1 = max(2, first)
    return k1 + (count - k1) % s


def stride_cuts(repeats: Repeats, starts: Optional[Sequence[Tuple[str, int]]] = ()) -> Optional[Tuple[int, int, int]]:
    """The three cut sizes ``(k1, k1 + s, k1 + 2 s)`` for a model whose checkpointed regions are ``starts``
    (:func:`pattern_stride`), or None where it has none."""
    found = pattern_stride(repeats, starts)
    if found is None:
        return None
    s, first = found
    k1 = _first_cut(first, s, repeats.count)
    return k1, k1 + s, k1 + 2 * s


def strided_repeats(repeats: Repeats, starts: Optional[Sequence[Tuple[str, int]]]) -> Optional[Repeats]:
    """``repeats`` seen at the stride of the regions ``starts`` (:func:`pattern_stride`): each block ``s`` of its
    blocks, from the first block from which the pattern repeats (congruent to the count modulo ``s``), so that
    every block is alike, regions included; None where the pattern has no stride."""
    found = pattern_stride(repeats, starts)
    if found is None:
        return None
    s, first = found
    begin = first + (repeats.count - first) % s
    return Repeats(repeats.path, repeats.keys, repeats.start + begin * repeats.period, s * repeats.period,
                   (repeats.count - begin) // s)


def affine_total(model: nn.Module, repeats: Repeats, cuts: Tuple[int, int, int],
                 measure: Callable[[nn.Module], Tuple[float, ...]], largest: int = 0) -> Optional[Tuple[float, ...]]:
    """``measure(model)`` of the whole model from ``measure`` of the model cut to each of ``cuts`` repeats
    (:func:`stride_cuts`): the last plus ``(count - k3) / s`` times its growth over one stride, where both strides
    grew every figure alike; None where they did not or a cut run failed (measure the whole model then). The last
    ``largest`` figures are maxima over the model's tensors, not sums: they must be the same in the three runs
    (the later blocks, alike to the measured ones, hold no larger one) and are kept as they are."""
    runs: Dict[int, Tuple[float, ...]] = {}
    try:
        for k in cuts:
            with cut(model, repeats, k):
                runs[k] = tuple(measure(model))
    except CUT_FAILURES:  # the forward needs all its blocks
        return None
    first, middle, last = (runs[k] for k in cuts)
    summed = len(last) - largest
    if any(c - b != b - a if i < summed else not a == b == c for i, (a, b, c) in enumerate(zip(first, middle, last))):
        return None
    strides = (repeats.count - cuts[2]) // (cuts[1] - cuts[0])
    return tuple(c + strides * (c - b) for b, c in zip(middle[:summed], last[:summed])) + last[summed:]
