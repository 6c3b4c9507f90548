"""The collective kinds: one vocabulary for the TP styles, the recorder, the estimator's tables and
the hardware profiles (a ``str`` enum: its members are their names wherever a table or a JSON
profile holds them)."""
from __future__ import annotations

from .vocabulary import Vocabulary


class Collective(Vocabulary):
    """A kind of collective operation, with the ring algorithm's step count and traffic share."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    BROADCAST = "broadcast"
    SEND = "send"
    RECV = "recv"

    def ring_steps(self, p: int, tree: int) -> int:
        """Latency terms of one operation over ``p`` ranks (all-reduce: at most a tree's ``tree``)."""
        if self in (Collective.SEND, Collective.RECV):
            return 1
        return min(2 * (p - 1), tree) if self is Collective.ALL_REDUCE else p - 1

    def ring_fraction(self, p: int) -> float:
        """The share of the buffer each rank sends over its link in one operation over ``p`` ranks."""
        if self is Collective.ALL_REDUCE:
            return 2 * (p - 1) / p
        if self in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
            return (p - 1) / p
        return 1.0


#: The kinds a hardware profile times (a receive is timed as its send).
TIMED = (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.BROADCAST,
         Collective.SEND)
