"""Garbage collection of what a piece of work made, without a full collection of the process.

A deep model lives in hundreds of thousands of tracked objects (a dozen or more per module). Work that makes
many objects of its own (an analysis, a measured run) runs under :func:`new_objects_collected`: its
temporaries die young instead of being promoted into the old generation, whose growth triggers CPython's
automatic full collections (over every object of the process, landing in whatever runs next:
``benchmarks/explorer_latency.py`` counts and times them). Written for CPython's generational collector
(3.10-3.13); 3.14's incremental one collects an increment of the old generation with the young ones.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Callable, Iterator

__all__ = ["collector_paused", "new_objects_collected"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Run the body with the garbage collector paused (restored after, also on an exception), as ``timeit`` times."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def new_objects_collected() -> Iterator[Callable[[], int]]:
    """Yields ``collect()``, a garbage collection of the objects made inside the body only (a full collection
    scans every object of the process, thousands per module of a deep model). On entry a young collection moves
    what is alive in the young generations to the old one, and the collector is paused inside, so every object
    made inside stays in the young generations and ``collect()`` (``gc.collect(1)``) scans and frees the cycles
    among them. Survivors of ``collect()`` (and, nested, the outer body's live young objects) move to the old
    generation, where cycles they later form wait for a full collection. A full collection here would reset the
    collector's count of long-lived objects to the few it found: the process's next automatic collection, a few
    thousand allocations later in whatever runs then, would be a full one over every object (inside a cheap
    explorer change, with a 10,000-module model and its copies). Frozen objects (``gc.freeze``: a test
    harness's, a forked rank's) stay frozen; their count is never asked for (``gc.get_freeze_count`` walks them
    all: tens of ms per call in a process that froze torch)."""
    gc.collect(1)
    with collector_paused():
        yield _collect_young


def _collect_young() -> int:
    """``gc.collect(1)``: the young generations, where :func:`new_objects_collected` keeps what is made inside."""
    return gc.collect(1)
