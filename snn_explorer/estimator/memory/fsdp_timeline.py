"""FSDP2's memory over a step, replayed on the unsharded model as one rank runs it.

FSDP2 allocates outside the model's own ops: each unit's all-gather output (``dp`` padded dim-0
chunks, flat), the unsharded parameters copied out of it, the reduce-scatter input (the unit's
gradients, flat and padded) and the sharded gradient it produces; it frees them at fixed points
(torch's ``_fsdp_param_group``): in the forward a unit's all-gather output is kept until the next
unit's copy-out has ended, a unit is resharded after its forward when ``reshard_after_forward`` (never the
root), re-gathered before its backward, resharded after it (before its reduce-scatter input is
allocated), and the last reduce-scatter input is kept until the next one; in the backward, the unit whose forward ended before is all-gathered
ahead (implicit prefetch). A checkpointed unit's recompute in the backward runs its forward hooks again:
torch's pre-forward all-gathers it if it is sharded, its post-forward neither reshards nor records the unit
in the order the backward prefetches by (``is_bw()``).

The model runs once per batch size and TP layout: :func:`~..instruments.fsdp_events.record` hooks the same points (forward
pre/post, gradients of a call's outputs and of its inputs, each gradient accumulated, the end of
the backward) for the model's FSDP2 units and logs the :class:`~..instruments.meter.StorageMeter`'s bytes at
each and its peak since the one before (:mod:`..instruments.fsdp_events`). :func:`replay_fsdp` walks the log for any plan's units, ``dp``
and resharding, adding and removing FSDP2's bytes at those points and standing each unsharded
gradient down once it is reduce-scattered, so every FSDP2 plan reuses that one run.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..instruments.fsdp_events import EventLog
from .sharding import HashedOnce, Param, fsdp_group_sizes, fsdp_groups


@dataclass(frozen=True)
class Unit:
    """One FSDP2 group: its module path ('' = the root) and its bytes on a rank."""

    path: str
    unsharded: int  # the parameters as the forward uses them (at the unit's gather dtype)
    flat: int  # all-gather output: dp padded chunks, at the gather dtype
    shard: int  # the rank's padded sharded gradient (the master parameters' dtype)
    scatter: int = -1  # reduce-scatter input: dp padded chunks at the reduce dtype (-1: ``flat``)
    reduced: int = 0  # reduce-scatter output at the reduce dtype, when it differs from the gradient's (cast after)

    @property
    def scatter_bytes(self) -> int:
        return self.flat if self.scatter < 0 else self.scatter


@dataclass(frozen=True)
class FsdpTimeline(HashedOnce):
    """What :func:`replay_fsdp` needs of a plan: its units, which unit holds each parameter, resharding."""

    units: Tuple[Unit, ...]
    param_units: Tuple[Tuple[str, str], ...]  # (parameter name, unit path)
    reshard_after_forward: bool
    #: CPU offload (``CPUOffloadPolicy``): shards live on the host; each is copied in before its all-gather and
    #: each sharded gradient leaves the device after its reduce-scatter (:mod:`.fsdp_offload`)
    offload: bool = False

    @classmethod
    def of(cls, params: Sequence[Param], dp: int, reshard_after_forward: bool,
           reduce_itemsize: Optional[int] = None, offload: bool = False) -> "FsdpTimeline":
        """The timeline of ``params`` (``sharding.local_params``: each in its unit, with its gather dtype)
        sharded over ``dp``, gradients reduce-scattered at ``reduce_itemsize`` bytes (None: their own); with
        ``offload`` the shards kept in host memory. The same object for the same parameter objects and settings,
        a few kept."""
        params = tuple(params)
        ids = tuple(map(id, params))  # the cache's key: identities hash in C, a new Param's hash is Python code
        return _timeline(cls, _Same(ids, params), dp, reshard_after_forward, reduce_itemsize, offload)

    def __hash__(self) -> int:  # the fields' hash, computed once (estimates cache peaks by timeline)
        found = self.__dict__.get("_hash")
        if found is None:
            found = hash((self.units, self.param_units, self.reshard_after_forward, self.offload))
            object.__setattr__(self, "_hash", found)
        return found


class _Same:
    """Parameters keyed by their identities (a cache key that keeps them alive, so the identities stay theirs)."""

    __slots__ = ("ids", "params")

    def __init__(self, ids: Tuple[int, ...], params: Tuple[Param, ...]):
        self.ids, self.params = ids, params

    def __hash__(self) -> int:
        return hash(self.ids)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Same) and self.ids == other.ids


@functools.lru_cache(maxsize=8)
def _timeline(cls, same: _Same, dp: int, reshard_after_forward: bool, reduce_itemsize: Optional[int],
              offload: bool) -> FsdpTimeline:
    """:meth:`FsdpTimeline.of`, a few kept."""
    return cls(_units(same, dp, reduce_itemsize), _param_units(same), reshard_after_forward, offload)


@functools.lru_cache(maxsize=8)
def _units(same: _Same, dp: int, reduce_itemsize: Optional[int]) -> Tuple[Unit, ...]:
    """The timeline's units: what they read of the plan is ``dp`` and the reduce dtype alone (plans that differ
    in resharding or offload share them), a few kept."""
    units = []
    for path, group in fsdp_groups(same.params).items():
        unsharded, gather, master, scatter = fsdp_group_sizes(group, dp, reduce_itemsize)
        shard, reduced = master // dp, (scatter // dp if scatter != master else 0)
        units.append(Unit(path, unsharded, gather, shard, scatter, reduced))
    return tuple(units)


@functools.lru_cache(maxsize=8)
def _param_units(same: _Same) -> Tuple[Tuple[str, str], ...]:
    """(parameter name, unit path) of each parameter, a few kept."""
    return tuple((p.name, p.group) for p in same.params)


class _Replay:
    """FSDP2's state per unit and the bytes it holds above the model's own (``offset``)."""

    def __init__(self, timeline: FsdpTimeline, grad_bytes: Dict[str, int]):
        self.reshard = timeline.reshard_after_forward
        self.offload = timeline.offload
        self.base = self.offset = self.peak = 0  # the model's bytes at the current point
        self.held = self.most_held = 0
        self.units = {"": Unit("", 0, 0, 0)}  # the root's hooks run even when it holds no parameter
        self.units.update((u.path, u) for u in timeline.units)
        self.params_of: Dict[str, List[str]] = {}
        for name, unit in timeline.param_units:
            self.params_of.setdefault(unit, []).append(name)
        self.grad_bytes = {n: grad_bytes[n] for n, _ in timeline.param_units}
        self.unsharded = set()
        self.state = {path: "idle" for path in self.units}
        self.kept_gather = None  # the forward's last all-gather output
        self.kept_scatter = None  # the last reduce-scatter input
        self.pending = set()  # parameters with an unsharded gradient not yet reduce-scattered
        self.stood_down = set()  # reduce-scattered: their real gradient is no longer counted
        self.scattered = set()  # units that already hold a sharded gradient
        self.order: List[str] = []  # units by the end of each forward call
        self.forward_ends: Dict[str, List[int]] = {}  # unit -> its indices in ``order``
        self.prefetched = set()  # all-gathered ahead of their backward, not yet copied out
        self.in_backward = False  # after the forward's end: forward hooks are a checkpoint's recompute

    def _add(self, nbytes: int, buffer: bool = True) -> None:
        """``buffer``: FSDP2's own buffers and unsharded parameters (else a gradient adjustment). Adding 0
        changes nothing (the peaks already count the current bytes), so callers skip it."""
        self.offset += nbytes
        now = self.base + self.offset
        if now > self.peak:
            self.peak = now
        if buffer:
            self.held += nbytes
            if self.held > self.most_held:
                self.most_held = self.held

    def _gather(self, unit: Unit) -> None:
        """The all-gather output; with offload, the shard copied to the device first (freed after the copy-in)."""
        if self.offload:
            self._add(unit.shard)
            self._add(unit.flat)
            self._add(-unit.shard)
        else:
            self._add(unit.flat)

    def unshard(self, path: str, forward: bool) -> None:
        if path in self.unsharded:
            return
        unit = self.units[path]
        prefetched = path in self.prefetched
        if prefetched:  # its all-gather output is already there
            self.prefetched.discard(path)
        else:
            self._gather(unit)
        self._add(unit.unsharded)  # copied out of the all-gather output
        if forward and self.kept_gather is not None:
            # torch drops its reference to the previous all-gather output before the copy-out, but
            # the local variable that checked it (``prev_all_gather_state``) holds it to the end
            self._add(-self.kept_gather)
            self.kept_gather = None
        self.unsharded.add(path)
        if forward and not prefetched:
            self.kept_gather = unit.flat
        else:  # in backward, or a prefetched (asynchronous) all-gather: freed after its copy-out
            self._add(-unit.flat)

    def prefetch(self, path: str) -> None:
        """FSDP2's implicit backward prefetch: all-gather the unit whose forward ended before."""
        if self.forward_ends.get(path):
            index = self.forward_ends[path].pop()
            target = self.order[index - 1] if index > 0 else None
            if target is not None and target not in self.unsharded and target not in self.prefetched:
                self._gather(self.units[target])
                self.prefetched.add(target)

    def reshard_unit(self, path: str) -> None:
        if path in self.unsharded:
            self.unsharded.discard(path)
            self._add(-self.units[path].unsharded)

    def pre_forward(self, path: str) -> None:
        if path not in self.units:
            return
        self.state[path] = "forward"
        self.unshard(path, forward=True)

    def post_forward(self, path: str) -> None:
        if path not in self.units:
            return
        if self.in_backward:  # a checkpointed unit's recompute: torch's post_forward skips all under is_bw()
            self.state[path] = "idle"
            return
        if self.reshard and path:
            self.reshard_unit(path)
        if self.units[path].flat:  # a unit with parameters: in the post-forward order
            self.forward_ends.setdefault(path, []).append(len(self.order))
            self.order.append(path)
        self.state[path] = "idle"
        if not path and self.kept_gather is not None:  # the root's forward ends: free the last one
            self._add(-self.kept_gather)
            self.kept_gather = None

    def pre_backward(self, path: str) -> None:
        if path in self.units and self.state[path] != "pre_backward":
            self.state[path] = "pre_backward"
            self.unshard(path, forward=False)
            self.prefetch(path)

    def accumulated(self, name: str) -> None:
        if name not in self.grad_bytes:
            return
        self.pending.add(name)
        if name in self.stood_down:  # a new unsharded gradient after an earlier reduce-scatter
            self.stood_down.discard(name)
            self._add(self.grad_bytes[name], buffer=False)

    def post_backward(self, path: str) -> None:
        if path not in self.units:
            return
        self.state[path] = "post_backward"
        # torch's order: reshard (the unsharded parameters go) before the reduce-scatter input is
        # allocated; that input is filled from the unsharded gradients, which are freed before
        # the reduce-scatter output (the new sharded gradient) is allocated.
        self.reshard_unit(path)
        ready = [n for n in self.params_of.get(path, ()) if n in self.pending]
        if ready:
            unit = self.units[path]
            if self.kept_scatter is not None:
                self._add(-self.kept_scatter)
            self._add(unit.scatter_bytes)
            self._add(-sum(self.grad_bytes[n] for n in ready), buffer=False)
            self.pending.difference_update(ready)
            self.stood_down.update(ready)
            if path not in self.scattered or self.offload:  # offload: every output goes to the host's gradient
                if unit.reduced:  # the reduce-scatter output, cast to the gradient's dtype, then freed
                    self._add(unit.reduced)
                self._add(unit.shard, buffer=False)
                if unit.reduced:
                    self._add(-unit.reduced)
                if self.offload:  # copied to the host: the device copy goes
                    self._add(-unit.shard, buffer=False)
                self.scattered.add(path)
            self.kept_scatter = unit.scatter_bytes

    def end_backward(self) -> None:
        for path in reversed(list(self.units)):
            if self.state[path] != "post_backward":
                self.post_backward(path)
            self.state[path] = "idle"
        if self.kept_scatter is not None:
            self._add(-self.kept_scatter)
            self.kept_scatter = None
        for path in self.prefetched:  # gathered but never used
            self._add(-self.units[path].flat)
        self.prefetched.clear()


def replay_fsdp(log: EventLog, entry: int, timeline: Optional[FsdpTimeline] = None) -> Tuple[int, int, int, int]:
    """(peak of the forward, peak of the backward, bytes after it) above ``entry``, with FSDP2's
    bytes for ``timeline`` added (none without one), and the most bytes FSDP2's buffers and
    unsharded parameters held at once. The log must hold the timeline's units."""
    missing = sorted({u.path for u in timeline.units} - set(log.units) - {""}) if timeline else []
    if missing:
        raise ValueError(f"the profile logged no FSDP2 events for units {missing}; logged: {list(log.units)}")
    sim = _Replay(timeline or FsdpTimeline((), (), False), log.grad_bytes)
    handlers = dict(pre_forward=sim.pre_forward, post_forward=sim.post_forward, pre_backward=sim.pre_backward,
                    post_backward=sim.post_backward, accumulated=sim.accumulated,
                    end_backward=lambda _: sim.end_backward())
    peak_fwd, peak, current = None, entry, entry
    for kind, what, current, stretch in log.events:
        if stretch + sim.offset > peak:
            peak = stretch + sim.offset
        sim.base, sim.peak = current, current + sim.offset
        handler = handlers.get(kind)
        if handler is not None:
            handler(what)
        if sim.peak > peak:
            peak = sim.peak
        if kind == "forward_end":
            peak_fwd, peak = peak, current + sim.offset
            sim.in_backward = True
    return peak_fwd - entry, peak - entry, current + sim.offset - entry, sim.most_held
