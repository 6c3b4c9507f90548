"""A logged run (:mod:`..instruments.fsdp_events`) of a model of repeated blocks, composed from runs cut to a few.

The storage meter's event log of a forward and backward is not a sum over blocks: each event holds the
bytes alive at that point and the peak since the one before. In a chain of repeated blocks
(:mod:`.repeats`) it is a sequence of stretches, one per block in the forward (from the block's first
event, in the order blocks start) and one per block in the backward (in reverse), between what runs
before, between and after them. :func:`compose_log` takes the logs of the model cut to 4, 5 and 6
repeats (:data:`LOG_CUTS`): the first two blocks and the last have stretches of their own, the
middle ones share one pattern of events (their kinds, and the blocks they name relative to the
stretch's block); every byte figure is affine in the number of blocks and, in a middle stretch, in
the block's index. Both slopes are read off the runs with 4 and 5 repeats; the log of the run with 6
is then composed from those and must equal the measured one, event for event, byte for byte, before
the whole model's log is composed. Anything else raises :class:`~.repeats.NotRepeating`.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from ..instruments.fsdp_events import EventLog
from .repeats import NotRepeating, Repeats

#: The repeats the cut logged runs keep: slopes from the first two, the third checks the composition.
LOG_CUTS = (4, 5, 6)
#: A logged run is composed only from this many repeats (the three cut runs hold 15).
MIN_LOG_REPEATS = 24
_FIXED_FORWARD, _FIXED_BACKWARD = ("P", "F0", "F1", "Flast", "Q"), ("R", "Blast", "B1", "B0", "Z")


def unit_pattern(units: Sequence[str], repeats: Repeats) -> Tuple[tuple, tuple]:
    """``(units outside the repeats, (child, rest) of the units of each block)``; NotRepeating unless every
    block has the same units."""
    outside, inside = [], [set() for _ in range(repeats.count)]
    for unit in units:
        where = repeats.locate(unit)
        if where is None:
            outside.append(unit)
        else:
            inside[where[0]].add(where[1:])
    if any(s != inside[0] for s in inside):
        raise NotRepeating("the FSDP2 units asked for differ between repeats")
    return tuple(outside), tuple(sorted(inside[0]))


def cut_units(pattern: Tuple[tuple, tuple], repeats: Repeats, k: int) -> List[str]:
    """The units of the model cut to ``k`` repeats."""
    outside, inside = pattern
    return list(outside) + [repeats.name_in(j, child, rest) for j in range(k) for child, rest in inside]


def _stretches(events: list, repeats: Repeats, k: int) -> Dict[object, list]:
    """The events of a log of ``k`` repeats by stretch: 'P' before the blocks, ('F', j) block j's forward, 'Q'
    after them to the forward's end, 'R' the backward before the blocks, ('B', j), 'Z' after; each event as
    ``(kind, label, current, peak)``, a block's label ``(offset from the stretch's block, child, rest)``."""
    out: Dict[object, list] = {"P": [], "Q": [], "R": [], "Z": []}
    forward, owner = True, None
    for kind, what, current, peak in events:
        where = repeats.locate(what) if what else None
        if where is not None:
            if forward and (owner is None or where[0] > owner):
                owner = _next(owner, where[0], 1, k)
            elif not forward and (owner is None or where[0] < owner):
                owner = _next(owner, where[0], -1, k)
            if out["Q" if forward else "Z"]:
                raise NotRepeating("a block's event after the events that follow the blocks")
            key, label = ("F" if forward else "B", owner), (where[0] - owner,) + where[1:]
        else:
            key, label = (("P" if owner is None else "Q") if forward else ("R" if owner is None else "Z")), what
        out.setdefault(key, []).append((kind, label, current, peak))
        if kind == "forward_end":
            forward, owner = False, None
    return out


def _next(owner: Optional[int], block: int, step: int, k: int) -> int:
    expected = (0 if step > 0 else k - 1) if owner is None else owner + step
    if block != expected:
        raise NotRepeating(f"the blocks do not run in order (block {block} where {expected} was expected)")
    return block


def _role(key, k: int):
    """The stretch pattern a stretch follows: its own, or 'Fmid' / 'Bmid' for the middle blocks."""
    if not isinstance(key, tuple):
        return key
    phase, j = key
    if j in (0, 1):
        return f"{phase}{j}"
    return f"{phase}last" if j == k - 1 else f"{phase}mid"


def _same_kinds(a: list, b: list) -> bool:
    return [(e[0], e[1]) for e in a] == [(e[0], e[1]) for e in b]


def _affine(a: list, b: list, times: int) -> list:
    """Events of ``b`` with each byte figure moved ``times`` more steps of ``b - a``."""
    return [(kind, label, cb + times * (cb - ca), pb + times * (pb - pa))
            for (kind, label, ca, pa), (_, _, cb, pb) in zip(a, b)]


class LogComposer:
    """The slopes of a chain's log, from the stretches of the runs cut to :data:`LOG_CUTS`\\ ``[:2]``."""

    def __init__(self, first: list, second: list, repeats: Repeats):
        k = LOG_CUTS[0]
        self.repeats, self.a, self.b = repeats, _stretches(first, repeats, k), _stretches(second, repeats, k + 1)
        roles = [_role(key, k) for key in self.a] + [_role(key, k + 1) for key in self.b]
        self.phases = [p for p in "FB" if roles.count(f"{p}mid") == 1 + 2]  # the phases the blocks log events in
        if any(roles.count(f"{p}mid") not in (0, 1 + 2) for p in "FB") or not self.phases:
            raise NotRepeating("the cut runs do not show every repeat in the forward and the backward")
        if set(self.a) - {("F", k - 1), ("B", k - 1)} != set(self.b) - {("F", k), ("B", k), ("F", k - 1), ("B", k - 1)}:
            raise NotRepeating("the cut runs' logs have different stretches")
        for key in self.a:  # the stretches of the shorter run match the longer's (the last block by role)
            other = ("F" if key[0] == "F" else "B", k) if isinstance(key, tuple) and key[1] == k - 1 else key
            if not _same_kinds(self.a[key], self.b[other]):
                raise NotRepeating(f"stretch {key} of the log differs between the cut runs")
        if any(not _same_kinds(self.b[(p, 2)], self.b[(p, 3)]) for p in self.phases):
            raise NotRepeating("the middle repeats' stretches of the log differ")

    def stretch(self, role: str, count: int, j: int = 0) -> list:
        """``role``'s events in the log of ``count`` repeats (block ``j`` for a middle one), labels as stretches'."""
        k = LOG_CUTS[0]
        if role[0] in "FB" and role[0] not in self.phases:
            return []
        if role.endswith("mid"):
            phase = role[0]
            along = _affine(self.b[(phase, 2)], self.b[(phase, 3)], j - 3)  # in the run of k + 1, block j
            grown = [(kd, lb, c2 - c1, p2 - p1) for (kd, lb, c1, p1), (_, _, c2, p2)
                     in zip(self.a[(phase, 2)], self.b[(phase, 2)])]
            return [(kd, lb, c + (count - k - 1) * dc, p + (count - k - 1) * dp)
                    for (kd, lb, c, p), (_, _, dc, dp) in zip(along, grown)]
        key_a, key_b = _keys(role, k), _keys(role, k + 1)
        return _affine(self.a[key_a], self.b[key_b], count - k - 1)

    def events(self, count: int) -> list:
        """The whole log of the model with ``count`` repeats, named as in it."""
        out = []
        for role in _FIXED_FORWARD[:3]:
            out += self._named(role, count, _block_of(role, count))
        for j in range(2, count - 1):
            out += self._named("Fmid", count, j)
        for role in _FIXED_FORWARD[3:] + _FIXED_BACKWARD[:2]:
            out += self._named(role, count, _block_of(role, count))
        for j in range(count - 2, 1, -1):
            out += self._named("Bmid", count, j)
        for role in _FIXED_BACKWARD[2:]:
            out += self._named(role, count, _block_of(role, count))
        return out

    def _named(self, role: str, count: int, j: Optional[int]) -> list:
        return [(kind, label if j is None else self.repeats.name_in(j + label[0], *label[1:]), c, p)
                for kind, label, c, p in self.stretch(role, count, j or 0)]


def _block_of(role: str, count: int) -> Optional[int]:
    return {"F0": 0, "B0": 0, "F1": 1, "B1": 1, "Flast": count - 1, "Blast": count - 1}.get(role)


def _keys(role: str, k: int):
    block = _block_of(role, k)
    return role if block is None else (role[0], block)


def compose_log(runs: Dict[int, dict], repeats: Repeats, units: Sequence[str], grad_bytes: Dict[str, int]) -> dict:
    """The logged run (``log``, ``entry``, ``grads``) of the whole model from those cut to :data:`LOG_CUTS`
    repeats; NotRepeating unless the third equals its composition from the first two."""
    k = LOG_CUTS
    composer = LogComposer(runs[k[0]]["log"].events, runs[k[1]]["log"].events, repeats)
    scalars = {}
    for name in ("entry", "grads"):
        a, b = runs[k[0]][name], runs[k[1]][name]
        if b + (k[2] - k[1]) * (b - a) != runs[k[2]][name]:
            raise NotRepeating(f"the run's {name} bytes are not affine in the number of repeats")
        scalars[name] = b + (repeats.count - k[1]) * (b - a)
    if composer.events(k[2]) != runs[k[2]]["log"].events:
        raise NotRepeating("the log of the run cut to 6 repeats differs from its composition")
    log = EventLog(tuple(units), dict(grad_bytes), composer.events(repeats.count))
    return dict(log=log, **scalars)
