"""The explorer-latency fast paths equal their slow ones: collections of new objects, the per-parameter
sharding sums, FSDP2's replay, run_fits' sums; and the explorer's collection after an estimate that copied a model."""
import copy
import dataclasses
import enum
import gc
import pickle
import sys
import weakref
from collections.abc import Mapping
from types import MappingProxyType

import pytest
import torch
from torch import nn

import snn_explorer as se
from snn_explorer.core.common import new_objects_collected, serialize
from snn_explorer.core.model import deep_copy_module, modules_copied
from snn_explorer.estimator.memory import fsdp_timeline, sharding
from snn_explorer.estimator.memory.fsdp_timeline import FsdpTimeline, Unit, replay_fsdp
from snn_explorer.estimator.memory.sharding import (
    Param,
    dp_roles,
    fsdp_group_sizes,
    fsdp_groups,
    local_params,
)
from snn_explorer.estimator.profile.profile_runs import run_point as _run_point
from snn_explorer.estimator.profile.profiling import _fitted_need, model_profile, trainable_shapes
from snn_explorer.estimator.timing.collectives import step_collectives
from snn_explorer.explorer import explorer as explorer_module
from snn_explorer.zoo import build


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the collector frees it


def _full_collections(body) -> int:
    """How many generation-2 collections happen while ``body()`` runs."""
    seen = []

    def hear(phase, info):
        if phase == "start" and info["generation"] == 2:
            seen.append(1)
    gc.callbacks.append(hear)
    try:
        body()
    finally:
        gc.callbacks.remove(hear)
    return len(seen)


def _allocate_survivors():
    """About 100,000 container objects that survive young collections (enough for 11+ generation-1 ones)."""
    return [[{}] for _ in range(50_000)]


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="CPython 3.14's incremental collector has no long-lived count")
def test_new_objects_collection_frees_their_cycles_and_leaves_the_long_lived_count():
    """Inside ``new_objects_collected`` the young collection frees a cycle made inside; the collector's state is
    restored. A full collection under freeze (the old way) made the next automatic collection
    a full one within a few thousand allocations; after the young one, the same allocations trigger none."""
    gc.unfreeze()  # tests/conftest.py froze what was alive before the test
    alive = [[] for _ in range(400_000)]  # the long-lived objects of a big model
    gc.collect()
    enabled = gc.isenabled()
    with new_objects_collected() as collect:
        node = _Node()
        made = weakref.ref(node)
        del node
        assert made() is not None and not gc.isenabled()
        collect()
        assert made() is None  # the cycle made inside is freed
    assert gc.isenabled() == enabled and gc.get_freeze_count() == 0
    assert _full_collections(_allocate_survivors) == 0
    gc.collect()

    gc.freeze()  # the old way: a full collection of the new objects alone
    gc.collect()
    gc.unfreeze()
    assert _full_collections(_allocate_survivors) >= 1  # non-trivial: that one is followed by a full collection
    del alive
    gc.collect()
    gc.freeze()  # as tests/conftest.py leaves the process for the test


def test_collection_after_an_estimate_that_copied_many_modules(monkeypatch):
    """The explorer's housekeeping collection runs when the body copied COLLECT_AFTER_COPYING modules or more."""
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(9)])
    monkeypatch.setattr(explorer_module, "COLLECT_AFTER_COPYING", 10)
    start = modules_copied()
    deep_copy_module(model)
    assert modules_copied() - start == 10  # the Sequential and its nine layers

    def estimate(copies):
        with explorer_module._collected_after_copies():
            for _ in range(copies):
                deep_copy_module(model)
    assert _full_collections(lambda: estimate(1)) == 1
    monkeypatch.setattr(explorer_module, "COLLECT_AFTER_COPYING", 11)
    assert _full_collections(lambda: estimate(1)) == 0
    assert _full_collections(lambda: estimate(2)) == 1


@pytest.mark.parametrize("enabled", [True, False])
def test_analyze_leaves_no_cyclic_garbage_and_the_collector_as_found(enabled):
    """``analyze`` frees the cycles it makes (torch.fx's graph of the root's forward: 500+ objects on this 30-layer
    MLP, left before for a later, possibly full, collection to find) and leaves the collector as it found it."""
    model = build("mlp_all_steps").model
    deep = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(30)])
    gc.collect()
    try:
        gc.enable() if enabled else gc.disable()
        for m in (model, deep):
            analysis = se.analyze(m)
            assert gc.isenabled() == enabled
            assert gc.collect() == 0
        assert analysis.pipeline_units  # non-trivial: the trace that made those cycles ran
    finally:
        gc.enable()


def _mixed_params():
    """A small model's parameters with two dtypes, dims 0 not divisible by 3, under FSDP2 and TP layouts."""
    model = nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.Linear(8, 6), nn.Linear(6, 1, bias=False))
    shapes = trainable_shapes(model)
    sizes = {n: (2 if n.startswith("2") else 4) for n, _ in shapes}
    analysis = se.analyze(model)
    plans = [se.plan(analysis=analysis, objective="memory", neuron_backend="torch", mode=mode, topology=topology,
                     batch_size=12) for mode, topology in (("fsdp2", {"dp": 3}), ("fsdp2_tp", {"dp": 2, "tp": 2}),
                                                           ("tp", {"tp": 2}), ("dp", {"dp": 3}))]
    return shapes, sizes, plans


def test_local_params_kept_are_those_made_afresh():
    """local_params gives back the same Param objects for the same arguments, equal to those made afresh, and
    new ones when the plan or a per-name itemsize (a new mapping, by identity) differs."""
    shapes, sizes, plans = _mixed_params()
    for _ in range(2):
        for plan in plans + plans[::-1]:
            for itemsize in (sizes, 4):
                made = sharding._local_params(shapes, plan, itemsize)
                assert local_params(shapes, plan, itemsize) == made
    first = local_params(shapes, plans[0], sizes)
    assert all(a is b for a, b in zip(first, local_params(shapes, plans[0], sizes)))
    halves = {n: 2 for n in sizes}
    assert local_params(shapes, plans[0], halves) == sharding._local_params(shapes, plans[0], halves) != first


def fsdp_group_bytes(group, dp, itemsize=None):
    """Reduce-scatter input of one FSDP2 group, summed parameter by parameter (the slow path)."""
    return dp * sum(p.rows(dp, 0)[0] * p.row_numel * (itemsize or p.itemsize) for p in group)


def fsdp_gather_bytes(group, dp):
    """All-gather output of one FSDP2 group, summed parameter by parameter (the slow path)."""
    return dp * sum(p.rows(dp, 0)[0] * p.row_numel * p.gathered_itemsize for p in group)


def test_fsdp_group_sizes_equal_the_per_figure_sums():
    shapes, sizes, plans = _mixed_params()
    checked = 0
    for plan in plans:
        params = local_params(shapes, plan, sizes)
        for dp in (1, 2, 3, 5):
            for reduce in (None, 2, 4):
                for group in fsdp_groups(params).values():
                    unsharded = sum(p.numel * p.gathered_itemsize for p in group)
                    assert fsdp_group_sizes(group, dp, reduce) == (
                        unsharded, fsdp_gather_bytes(group, dp), fsdp_group_bytes(group, dp),
                        fsdp_group_bytes(group, dp, reduce))
                    checked += 1
    assert checked > 0 and any(p.shape[0] % 3 for p in params)
    scalar = [sharding.Param("s", (), 4, "u", 2), sharding.Param("w", (5, 3), 4, "u")]  # a 0-dim one: 1 row of 1
    for dp in (1, 2, 3):
        assert fsdp_group_sizes(scalar, dp, 2) == (2 + 60, fsdp_gather_bytes(scalar, dp), fsdp_group_bytes(scalar, dp),
                                                   fsdp_group_bytes(scalar, dp, 2))
    twin = dataclasses.replace(params[0])
    assert twin == params[0] and hash(twin) == hash(params[0]) == hash(params[0])  # the remembered hash


def _reference_timeline(params, dp, reshard, reduce=None, offload=False) -> FsdpTimeline:
    """FsdpTimeline.of built figure by figure (the slow path)."""
    units = []
    for path, group in fsdp_groups(params).items():
        scatter, master = fsdp_group_bytes(group, dp, reduce), fsdp_group_bytes(group, dp)
        units.append(Unit(path, sum(p.numel * p.gathered_itemsize for p in group), fsdp_gather_bytes(group, dp),
                          master // dp, scatter, scatter // dp if scatter != master else 0))
    return FsdpTimeline(tuple(units), tuple((p.name, p.group) for p in params), reshard, offload)


class _SlowReplay(fsdp_timeline._Replay):
    """The replay with every addition made, zero ones included, and its peaks by ``max``."""

    def _add(self, nbytes, buffer=True):
        self.offset += nbytes
        self.peak = max(self.peak, self.base + self.offset)
        if buffer:
            self.held += nbytes
            self.most_held = max(self.most_held, self.held)

    def _gather(self, unit):
        self._add(unit.shard if self.offload else 0)
        self._add(unit.flat)
        self._add(-unit.shard if self.offload else 0)


def test_fsdp_timeline_and_replay_equal_the_slow_paths(monkeypatch):
    zoo = build("mlp_all_steps")
    model, x, y = zoo.model, zoo.example_input[:, :4], zoo.labels[:4]
    analysis = se.analyze(model)
    plan = se.plan(analysis=analysis, objective="memory", neuron_backend="torch", mode="fsdp2",
                   topology={"dp": 2}, batch_size=8)
    params = local_params(trainable_shapes(model), plan, 4)
    run = _run_point(model, x, y, saved_only=False, units=sorted({p.group for p in params if p.group}))
    fast, slow = {}, {}
    for dp in (2, 3):
        for reshard in (False, True):
            for reduce in (None, 2):
                for offload in (False, True):
                    timeline = FsdpTimeline.of(params, dp, reshard, reduce, offload)
                    assert timeline == _reference_timeline(params, dp, reshard, reduce, offload)
                    assert hash(timeline) == hash(_reference_timeline(params, dp, reshard, reduce, offload))
                    assert FsdpTimeline.of(list(params), dp, reshard, reduce, offload) is timeline  # kept
                    fast[(dp, reshard, reduce, offload)] = replay_fsdp(run["log"], run["entry"], timeline)
    monkeypatch.setattr(fsdp_timeline, "_Replay", _SlowReplay)
    for key in fast:
        slow[key] = replay_fsdp(run["log"], run["entry"], _reference_timeline(params, *key))
    assert fast == slow
    assert len(set(fast.values())) > 4  # the settings change the peaks
    assert any(u.reduced for u in FsdpTimeline.of(params, 2, True, 2).units)


def test_fsdp_collectives_from_the_timeline_equal_those_from_the_parameters():
    zoo = build("mlp_all_steps")
    profile = model_profile(zoo.model, zoo.example_input, zoo.labels)
    analysis = se.analyze(zoo.model)
    for objective, dp in (("memory", 2), ("speed", 4)):
        plan = se.plan(analysis=analysis, objective=objective, neuron_backend="torch", mode="fsdp2",
                       topology={"dp": dp}, batch_size=8)
        params = local_params(profile.params, plan, 4)
        timeline = FsdpTimeline.of(params, plan.dp_size, plan.reshard_after_forward)
        rows = step_collectives(plan, params, profile, 4, 4)
        assert step_collectives(plan, params, profile, 4, 4, timeline) == rows
        assert sum(r["bytes"] for r in rows) > 0 and len(timeline.units) > 1


def test_run_fits_sums_follow_the_profiles_modules():
    """run_fits' bytes are summed once per size; a profile with other modules (a lever variant sharing the cache)
    gets its own sum."""
    zoo = build("mlp")
    profile = model_profile(zoo.model, zoo.example_input, zoo.labels)

    def direct(p, n, t):
        fitted = p.input_bytes(n, t) + sum(m.saved(n, t) + m.state(n, t) for m in p.modules.values())
        params = sum(torch.Size(s).numel() * p.param_itemsizes.get(name, 4) for name, s in p.params)
        return 2 * fitted + 2 * params

    for n, t in ((2, 3), (8, 5), (2, 3)):
        assert _fitted_need(profile, n, t) == direct(profile, n, t) > 0
    halved = {k: dataclasses.replace(m, saved=dataclasses.replace(m.saved, c3=m.saved.c3 / 2))
              for k, m in profile.modules.items()}
    variant = dataclasses.replace(profile, modules=halved, fitted_sums=profile.fitted_sums)
    assert _fitted_need(variant, 8, 5) == direct(variant, 8, 5) < direct(profile, 8, 5)
    assert _fitted_need(profile, 8, 5) == direct(profile, 8, 5)


def _slow_to_plain(value):
    """serialize.to_plain without its scalar fast path (the slow path)."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, (Mapping, MappingProxyType)):
        return {str(k): _slow_to_plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_slow_to_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(type(value).__name__)


class _Flag(enum.IntEnum):
    ON = 1


class _Named(str):
    def to_dict(self):
        return {"named": str(self)}


def test_plan_keys_and_plain_data_equal_the_slow_paths():
    """to_plain's scalar fast path and the plan's remembered layout key give what the slow paths give."""
    analysis = se.analyze(build("mlp_all_steps").model)
    plans = [se.plan(analysis=analysis, objective=o, neuron_backend="torch", mode=m, topology=topology,
                     batch_size=8) for o, m, topology in (("memory", "fsdp2", {"dp": 2}), ("speed", "tp", {"tp": 2}),
                                                         ("speed", "dp", {"dp": 2}))]
    assert any(p.tensor_parallel_plan for p in plans)
    for plan in plans:
        assert serialize.to_plain(plan.to_dict()) == _slow_to_plain(plan.to_dict())
        assert plan.to_dict() == {"kind": "plan", **{f.name: _slow_to_plain(getattr(plan, f.name))
                                                     for f in dataclasses.fields(plan) if not f.name.startswith("_")}}
        fresh = dataclasses.replace(plan)
        first = plan.layout_key()
        assert plan.layout_key() is first and first == fresh.layout_key()
        assert dataclasses.replace(plan, objective="capacity").layout_key() == first
    mixed = (True, 3, 2.5, None, "a", _Flag.ON, _Named("b"), {"k": (1, [2])})
    assert serialize.to_plain(mixed) == _slow_to_plain(mixed) == [True, 3, 2.5, None, "a", _Flag.ON, {"named": "b"},
                                                                 {"k": [1, [2]]}]
    assert len({p.layout_key() for p in plans}) == 3


def _slow_fsdp_rank_figures(params, plan, rank, optimizer):
    """rank_bytes, optimizer_temporaries and dp_roles of an FSDP2 plan, parameter by parameter (the slow paths)."""
    dp, dp_rank = plan.dp_size, rank // plan.tp_size
    padded = opt = 0
    for p in params:
        chunk, real = p.rows(dp, dp_rank)
        padded += chunk * p.row_numel * p.itemsize
        opt += sharding._state(real * p.row_numel, p.itemsize, optimizer)
    scratch = 0
    if optimizer in ("adam", "adamw"):
        scratch = 2 * max(p.rows(dp, dp_rank)[1] * p.row_numel * p.itemsize for p in params)
    starts = {0}
    for p in params:
        dim0 = p.shape[0] if p.shape else 1
        chunk = -(-dim0 // dp)
        starts.update({dim0 // chunk, -(-dim0 // chunk)})
    return (dict(params_bytes=padded, grads_bytes=padded, optimizer_bytes=opt), scratch,
            sorted(r for r in starts if r < dp))


def test_fsdp_rank_figures_from_the_shape_census_equal_the_per_parameter_sums():
    shapes, sizes, plans = _mixed_params()
    shapes = tuple(shapes) + (("extra.weight", (7, 3)), ("extra.bias", (7,)))  # dim 0 not a multiple of dp: partial chunks
    sizes = {**sizes, "extra.weight": 4, "extra.bias": 4}
    checked = set()
    for plan in (p for p in plans if p.uses_fsdp):
        params = local_params(shapes, plan, sizes)
        assert len(sharding.shape_census(params)) < len(params)  # shapes repeat: the census is shorter
        for rank in range(plan.world_size):
            for optimizer in ("adam", "sgd"):
                found = (sharding.rank_bytes(params, plan, rank, optimizer),
                         sharding.optimizer_temporaries(params, plan, rank, optimizer), dp_roles(params, plan))
                assert found == _slow_fsdp_rank_figures(params, plan, rank, optimizer)
                checked.add(found[0]["optimizer_bytes"])
    assert len(checked) > 2 and sharding.shape_census(params) is sharding.shape_census(list(params))


def test_hashes_kept_once_are_not_pickled_or_copied():
    """A string's hash differs between processes: a pickled or copied ``Param`` / ``FsdpTimeline`` hashes anew."""
    param = Param("net.0.weight", (8, 8), 4, group="net.0")
    timeline = FsdpTimeline.of([param], dp=2, reshard_after_forward=True)
    for obj in (param, timeline):
        hash(obj)
        assert "_hash" in obj.__dict__  # non-trivial: the hash was kept
        for twin in (pickle.loads(pickle.dumps(obj)), copy.copy(obj), copy.deepcopy(obj)):
            assert "_hash" not in twin.__dict__ and twin == obj and hash(twin) == hash(obj)
