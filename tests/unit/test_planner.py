"""Planner decision table, fix-ups, plan data and analysis: fast unit tests, no process group."""
from __future__ import annotations

import dataclasses
import json

import pytest
import snntorch as snn
import torch
from models import MLP, leaky
from torch import nn

import snn_explorer as se
from snn_explorer import (
    DistributedFeatureSet,
    SNNDistributedAnalysis,
    SNNDistributedPlan,
    SNNDistributedRuntime,
    SNNDistributedTopology,
    StrategyRecommendation,
    analyze,
    plan,
    recommend_snn_distributed_strategy,
)
from snn_explorer.core.model import neurons
from snn_explorer.core.planning import split_options, topology_problem

OBJECTIVES = ("speed", "memory", "capacity")
VGG_NAMES = ("cifar10dvs_vgg", "vgg16", "cifar10dvs_vgg_small")


# ---- models ------------------------------------------------------------------------------------

def linear_chain(n: int, width: int = 8) -> nn.Sequential:
    """n Linears, each followed by Leaky, Dropout and Identity (children 4*i .. 4*i+3)."""
    layers = []
    for _ in range(n):
        layers += [nn.Linear(width, width), leaky(), nn.Dropout(0.1), nn.Identity()]
    return nn.Sequential(*layers)


def vgg_like() -> nn.Sequential:
    """Conv feature stack (child '0'..'2') then a classifier Sequential ('3')."""
    return nn.Sequential(
        nn.Conv2d(2, 4, 3), leaky(), nn.Flatten(),
        nn.Sequential(nn.Linear(16, 32), leaky(), nn.Linear(32, 10)),
    )


def mk_plan(model=None, objective="speed", topology=1, batch_size=8, **kw) -> SNNDistributedPlan:
    model = MLP() if model is None else model
    return plan(analysis=analyze(model), objective=objective, topology=topology, neuron_backend="torch",
                batch_size=batch_size, **split_options(kw))


# ---- world size 1 ------------------------------------------------------------------------------

@pytest.mark.parametrize("topology", [1, {"dp": 1}, {"tp": 1}, {"dp": 1, "tp": 1},
                                      SNNDistributedTopology({"dp": 1})])
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_world_size_1_is_none(objective, topology):
    p = mk_plan(objective=objective, topology=topology)
    assert p.mode == "none"
    assert p.world_size == 1
    assert p.memopt_level == (0 if objective == "speed" else 1)
    assert p.optimizer_strategy == "none"
    assert dict(p.tensor_parallel_plan) == {}
    assert p.fsdp_units == ()
    assert p.per_rank_batch == 8


# ---- speed -------------------------------------------------------------------------------------

@pytest.mark.parametrize("topology,dp", [({"dp": 2}, 2), (2, 2), (3, 3), ({"dp": 4}, 4), (8, 8)])
def test_speed_is_dp_with_zero(topology, dp):
    p = mk_plan(objective="speed", topology=topology, batch_size=24)
    assert p.mode == "dp"
    assert p.optimizer_strategy == "zero"
    assert p.memopt_level == 0
    assert p.dp_size == dp and p.per_rank_batch == 24 // dp
    assert dict(p.tensor_parallel_plan) == {}
    assert any("speed" in r for r in p.rationale)


def test_speed_zero_gate_off_gives_none_with_note():
    p = mk_plan(objective="speed", topology={"dp": 2}, features=DistributedFeatureSet(allow_zero_optimizer=False))
    assert p.mode == "dp"
    assert p.optimizer_strategy == "none"
    assert any("allow_zero_optimizer=False" in n for n in p.notes)
    assert p.experimental_features == DistributedFeatureSet(allow_zero_optimizer=False)


def test_zero_gate_off_adds_no_note_when_not_dp():
    p = mk_plan(objective="memory", topology={"tp": 2}, features=DistributedFeatureSet(allow_zero_optimizer=False))
    assert p.mode == "tp" and p.optimizer_strategy == "none"
    assert not any("allow_zero_optimizer" in n for n in p.notes)


@pytest.mark.parametrize("ws", [4, 6, 8])
@pytest.mark.parametrize("family", VGG_NAMES)
def test_speed_vgg_family_is_fsdp2_tp(family, ws):
    p = plan(analysis=analyze(vgg_like(), model_family=family), objective="speed",
             topology={"dp": ws // 2, "tp": 2}, neuron_backend="torch", batch_size=4 * ws)
    assert p.model_family == "cifar10dvs_vgg"
    assert p.mode == "fsdp2_tp"
    assert p.mesh_shape == (ws // 2, 2) and p.mesh_dim_names == ("dp", "tp")
    assert p.optimizer_strategy == "none" and p.memopt_level == 0
    assert dict(p.tensor_parallel_plan) == {"3.0": "colwise", "3.1": "local", "3.2": "rowwise"}
    assert p.fsdp_units  # fsdp2 shards something below the root
    assert p.dp_size == ws // 2 and p.tp_size == 2 and p.per_rank_batch == 8
    assert not p.notes or all("recommended" not in n for n in p.notes)


@pytest.mark.parametrize("family", VGG_NAMES)
def test_speed_vgg_family_via_plan_model_family(family):
    p = plan(analysis=analyze(vgg_like()), objective="speed", topology={"dp": 2, "tp": 2}, neuron_backend="torch",
             batch_size=8, model_family=family)
    assert p.model_family == "cifar10dvs_vgg" and p.mode == "fsdp2_tp"


@pytest.mark.parametrize("ws", [2, 3, 5])
def test_speed_vgg_family_small_or_odd_world_is_dp(ws):
    p = plan(analysis=analyze(vgg_like(), model_family="vgg16"), objective="speed", topology=ws,
             neuron_backend="torch", batch_size=ws * 2)
    assert p.mode == "dp" and p.optimizer_strategy == "zero"


def test_speed_vgg_on_pure_dp_topology_falls_back_to_dp_with_note():
    p = plan(analysis=analyze(vgg_like(), model_family="vgg16"), objective="speed", topology={"dp": 4},
             neuron_backend="torch", batch_size=8)
    assert p.mode == "dp" and p.optimizer_strategy == "zero"
    assert any("fsdp2_tp" in n and "'dp'" in n for n in p.notes)


def test_speed_generic_on_2d_topology_uses_both_dims():
    p = mk_plan(objective="speed", topology={"dp": 2, "tp": 2})
    assert p.mode == "fsdp2_tp"
    assert any("recommended 'dp'" in n for n in p.notes)
    assert topology_problem(p.mode, p.topology) is None


# ---- memory / capacity -------------------------------------------------------------------------

@pytest.mark.parametrize("objective", ["memory", "capacity"])
def test_memory_on_dp_tp_is_fsdp2_tp(objective):
    p = mk_plan(objective=objective, topology={"dp": 2, "tp": 2})
    assert p.mode == "fsdp2_tp"
    assert p.memopt_level == 1 and p.optimizer_strategy == "none"
    assert p.mesh_shape == (2, 2) and p.dp_mesh_dim == 0 and p.tp_mesh_dim == 1
    assert dict(p.tensor_parallel_plan) == {"body.0": "colwise", "body.1": "local", "body.2": "rowwise",
                                            "head": "colwise_gather"}
    assert p.fsdp_units


@pytest.mark.parametrize("objective", ["memory", "capacity"])
@pytest.mark.parametrize("tp", [2])
def test_memory_on_tp_is_tp(objective, tp):
    p = mk_plan(objective=objective, topology={"tp": tp})
    assert p.mode == "tp" and p.memopt_level == 1
    assert p.dp_size == 1 and p.tp_size == tp and p.per_rank_batch == 8
    assert p.dp_mesh_dim is None and p.tp_mesh_dim == 0
    assert p.fsdp_units == ()


@pytest.mark.parametrize("objective", ["memory", "capacity"])
@pytest.mark.parametrize("dp", [2, 3, 4])
def test_memory_on_dp_only_is_fsdp2_not_tp(objective, dp):
    """Reference defect 1: never tp with tp and dp on the same mesh dim."""
    model = MLP()
    p = plan(analysis=analyze(model), objective=objective, topology={"dp": dp}, neuron_backend="torch", batch_size=12)
    assert p.mode == "fsdp2"
    assert p.mode != "tp" and "tp" not in p.mesh_dim_names
    assert dict(p.tensor_parallel_plan) == {}
    assert p.dp_mesh_dim == 0 and p.dp_size == dp
    assert any("does not fit" in n and "'fsdp2'" in n for n in p.notes)
    assert topology_problem(p.mode, p.topology) is None
    se.preflight(model, p)  # every returned plan passes the model checks apply makes


@pytest.mark.parametrize("objective", ["memory", "capacity"])
def test_memory_on_int_world_size_is_fsdp2(objective):
    assert mk_plan(objective=objective, topology=2).mode == "fsdp2"


def test_capacity_rationale_mentions_pipeline():
    for topology in (1, {"dp": 2}, {"tp": 2}, {"dp": 2, "tp": 2}):
        p = mk_plan(objective="capacity", topology=topology)
        if p.world_size > 1:
            assert any("pipeline" in r for r in p.rationale), p.rationale
        assert p.objective == "capacity"
    p = mk_plan(objective="memory", topology={"tp": 2})
    assert not any("pipeline" in r for r in p.rationale)


def test_explicit_mode_overrides_recommendation():
    p = mk_plan(objective="speed", topology={"dp": 2}, mode="fsdp2")
    assert p.mode == "fsdp2" and p.optimizer_strategy == "none" and not any("recommended" in n for n in p.notes)
    p = mk_plan(objective="memory", topology={"dp": 2}, mode="dp")
    assert p.mode == "dp" and p.optimizer_strategy == "zero" and p.memopt_level == 1
    p = mk_plan(objective="speed", topology={"dp": 2, "tp": 2}, mode="FSDP2_TP")
    assert p.mode == "fsdp2_tp"


def test_case_insensitive_objective_and_backend():
    p = plan(analysis=analyze(MLP()), objective="SPEED", topology=2, neuron_backend="Torch", batch_size=2)
    assert p.objective == "speed" and p.neuron_backend == "torch"


def test_deprecated_backend_keyword_still_plans():
    """``backend=`` (the old name of neuron_backend) still works, with a DeprecationWarning."""
    with pytest.warns(DeprecationWarning, match="neuron_backend"):
        p = plan(analysis=analyze(MLP()), objective="speed", topology=2, backend="inductor", batch_size=2)
    assert p.neuron_backend == "inductor"
    with pytest.warns(DeprecationWarning, match="neuron_backend"):
        assert p.backend == "inductor"
    with pytest.raises(TypeError, match="not both"):
        plan(analysis=analyze(MLP()), objective="speed", topology=2, backend="cupy", neuron_backend="inductor",
             batch_size=2)
    with pytest.warns(DeprecationWarning):
        r = recommend_snn_distributed_strategy(world_size=2, backend="cupy")
    assert r.mode == "dp"


def test_plan_json_from_before_the_backend_rename_loads():
    p = mk_plan(topology={"dp": 2})
    old = p.to_dict()
    old["backend"] = old.pop("neuron_backend")
    assert SNNDistributedPlan.from_dict(old) == p


# ---- recommend_snn_distributed_strategy --------------------------------------------------------

@pytest.mark.parametrize("model,ws,prefer,mode,sharding,memopt", [
    ("generic", 1, "speed", "none", "none", 0),
    ("generic", 1, "memory", "none", "none", 1),
    ("generic", 1, "capacity", "none", "none", 1),
    ("cifar10dvs_vgg", 1, "speed", "none", "none", 0),
    ("generic", 2, "speed", "dp", "zero", 0),
    ("generic", 4, "speed", "dp", "zero", 0),
    ("cifar10dvs_vgg", 2, "speed", "dp", "zero", 0),
    ("cifar10dvs_vgg", 3, "speed", "dp", "zero", 0),
    ("cifar10dvs_vgg", 4, "speed", "fsdp2_tp", "none", 0),
    ("vgg16", 6, "speed", "fsdp2_tp", "none", 0),
    ("cifar10dvs_vgg_small", 8, "speed", "fsdp2_tp", "none", 0),
    ("cifar10dvs_vgg", 5, "speed", "dp", "zero", 0),
    ("spikformer_ti", 4, "speed", "dp", "zero", 0),
    ("generic", 2, "memory", "tp", "none", 1),
    ("generic", 3, "memory", "tp", "none", 1),
    ("generic", 4, "memory", "fsdp2_tp", "none", 1),
    ("generic", 6, "memory", "fsdp2_tp", "none", 1),
    ("generic", 5, "memory", "tp", "none", 1),
    ("generic", 2, "capacity", "tp", "none", 1),
    ("generic", 4, "capacity", "fsdp2_tp", "none", 1),
])
def test_recommendation_table(model, ws, prefer, mode, sharding, memopt):
    r = recommend_snn_distributed_strategy(model, world_size=ws, prefer=prefer)
    assert isinstance(r, StrategyRecommendation)
    assert (r.mode, r.optimizer_sharding, r.memopt_level) == (mode, sharding, memopt)
    assert r.rationale and all(isinstance(s, str) and s for s in r.rationale)
    if prefer == "capacity" and ws > 1:
        assert any("pipeline" in s for s in r.rationale)


def test_recommendation_capacity_pipelining_available_says_so():
    r = recommend_snn_distributed_strategy(world_size=2, prefer="capacity", pipelining_available=True)
    assert r.mode == "tp" and r.mesh_shape == (2,)
    assert any("batch 1 fits no pipeline of 2 stages" in s for s in r.rationale)


@pytest.mark.parametrize("ws,batch,virtual,micro,schedule", [
    (2, 8, 2, 8, "interleaved"),     # B >= 2W: V=2; m in [4, 8]: 8
    (2, 3, 1, 3, "1f1b"),            # W <= B < 2W: V=1; m in [2, 3]: 3
    (4, 100, 2, 25, "interleaved"),  # m in [8, 32]: largest divisor of 100 is 25
    (4, 6, 1, 6, "1f1b"),            # m in [4, 6]: 6
    (2, 1009, None, None, None),     # prime batch: no divisor in [4, 16], the memory decision
    (4, 3, None, None, None),        # B < W: no pipeline
])
def test_recommendation_capacity_with_pipelining(ws, batch, virtual, micro, schedule):
    r = recommend_snn_distributed_strategy(world_size=ws, prefer="capacity", batch_size=batch,
                                           pipelining_available=True)
    if virtual is None:
        assert r.mode != "pp" and r.pp_schedule is None and r.pp_microbatches is None
        return
    assert (r.mode, r.mesh_shape, r.pp_virtual_stages, r.pp_microbatches, r.pp_schedule) == \
        ("pp", (ws,), virtual, micro, schedule)
    assert not recommend_snn_distributed_strategy(world_size=ws, prefer="capacity", batch_size=batch).mode == "pp"


def test_recommendation_is_frozen():
    r = recommend_snn_distributed_strategy(world_size=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.mode = "tp"


# ---- topology ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dims,names,shape", [
    ({"tp": 2, "dp": 3}, ("dp", "tp"), (3, 2)),
    ({"x": 2, "vpp": 1, "pp": 3, "tp": 4, "dp": 5}, ("pp", "dp", "tp", "x", "vpp"), (3, 5, 4, 2, 1)),
    ({"zz": 1, "dp": 2, "aa": 3}, ("dp", "zz", "aa"), (2, 1, 3)),
    ({"b": 2, "a": 3}, ("b", "a"), (2, 3)),
    ({"ep": 2, "tp": 2, "pp": 2}, ("pp", "tp", "ep"), (2, 2, 2)),  # pp outermost, tp innermost of the three
    ({"tp": 2, "dp": 3, "pp": 4}, ("pp", "dp", "tp"), (4, 3, 2)),
])
def test_topology_ordering(dims, names, shape):
    t = SNNDistributedTopology.from_mapping(dims)
    assert t.ordered_dim_names == names
    assert t.mesh_shape == shape
    assert list(t.dims) == list(dims)  # dims keep the order given
    assert t.world_size == int(torch.tensor(shape).prod())


def test_topology_integral_floats_and_world_size():
    t = SNNDistributedTopology.from_mapping({"dp": 2.0, "tp": 2}, world_size=4.0)
    assert dict(t.dims) == {"dp": 2, "tp": 2} and all(type(v) is int for v in t.dims.values())
    assert t.world_size == 4 and type(t.world_size) is int
    assert SNNDistributedTopology({"dp": 4}, world_size=4).world_size == 4
    assert t.size("dp") == 2 and t.size("pp") == 1


def test_topology_coerce_and_read_only():
    t = SNNDistributedTopology.coerce(4)
    assert dict(t.dims) == {"dp": 4}
    assert SNNDistributedTopology.coerce(t) is t
    assert SNNDistributedTopology.coerce({"tp": 2}).dims["tp"] == 2
    with pytest.raises(TypeError):
        t.dims["dp"] = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.world_size = 8
    assert SNNDistributedTopology.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    assert hash(SNNDistributedTopology({"dp": 2})) == hash(SNNDistributedTopology({"dp": 2}))
    assert "dp=4" in repr(t)


# ---- plan fields -------------------------------------------------------------------------------

@pytest.mark.parametrize("mode,dims,shape,tp_dim,dp_dim,per_rank", [
    ("none", {"dp": 1}, (1,), 0, 0, 12),
    ("none", {"tp": 1}, (1,), 0, None, 12),
    ("dp", {"dp": 2}, (2,), 0, 0, 6),
    ("fsdp2", {"dp": 3}, (3,), 0, 0, 4),
    ("tp", {"tp": 2}, (2,), 0, None, 12),
    ("fsdp2_tp", {"tp": 2, "dp": 2}, (2, 2), 1, 0, 6),
    ("fsdp2_tp", {"dp": 3, "tp": 2, "pp": 1}, (1, 3, 2), 2, 1, 4),
    ("tp", {"x": 1, "tp": 2}, (2, 1), 0, None, 12),
])
def test_plan_fields(mode, dims, shape, tp_dim, dp_dim, per_rank):
    tp_plan = {"head": "colwise_gather"} if mode in ("tp", "fsdp2_tp") else {}
    p = SNNDistributedPlan(mode=mode, objective="memory", topology=dims, batch_size=12,
                           tensor_parallel_plan=tp_plan)
    assert p.mesh_shape == shape
    assert p.tp_mesh_dim == tp_dim
    assert p.dp_mesh_dim == dp_dim
    assert p.per_rank_batch == per_rank
    assert isinstance(p.topology, SNNDistributedTopology)


# ---- automatic TP plan -------------------------------------------------------------------------

def expected_chain_plan(n: int) -> dict:
    out = {}
    for i in range(n):
        out[str(4 * i)] = "colwise" if i % 2 == 0 else "rowwise"
        if i % 2 == 0 and i + 1 < n:
            out[str(4 * i + 1)] = "local"  # Leaky between a colwise Linear and the next Linear
    if n % 2:
        out[str(4 * (n - 1))] = "colwise_gather"
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 10])
def test_auto_tp_plan_for_linear_chains(n):
    model = linear_chain(n)
    a = analyze(model)
    assert a.tp_chains == (tuple(str(i) for i in range(4 * n - 3)),)
    p = plan(analysis=a, objective="memory", topology={"tp": 2}, neuron_backend="torch", batch_size=4)
    assert p.mode == "tp"
    got = dict(p.tensor_parallel_plan)
    assert got == expected_chain_plan(n)
    linears = [got[str(4 * i)] for i in range(n)]
    for i, style in enumerate(linears[:-1]):
        assert style == ("colwise" if i % 2 == 0 else "rowwise")
    assert linears[-1] == ("colwise_gather" if n % 2 else "rowwise")
    for i in range(n):  # Dropout / Identity never appear; the last Leaky of a chain is never local
        assert str(4 * i + 2) not in got and str(4 * i + 3) not in got
    assert str(4 * (n - 1) + 1) not in got
    se.preflight(model, p)


def test_auto_tp_plan_nested_sequential_and_singletons():
    model = MLP()
    p = mk_plan(model, objective="memory", topology={"tp": 2})
    assert dict(p.tensor_parallel_plan) == {"body.0": "colwise", "body.1": "local", "body.2": "rowwise",
                                            "head": "colwise_gather"}


def test_explicit_tp_plan_is_accepted_and_carried():
    explicit = {"body.0": "colwise", "body.2": "rowwise"}
    p = mk_plan(objective="memory", topology={"tp": 2}, tensor_parallel_plan=explicit)
    assert p.mode == "tp"
    assert dict(p.tensor_parallel_plan) == {**explicit, "body.1": "local"}  # the neuron keeps local state
    assert "head" not in p.tensor_parallel_plan
    p2 = mk_plan(objective="speed", topology={"dp": 2, "tp": 2}, mode="fsdp2_tp",
                 tensor_parallel_plan={"head": "colwise_gather"})
    assert dict(p2.tensor_parallel_plan) == {"head": "colwise_gather"}
    # With no mode, an explicit plan restricts the choice to TP modes (here the first TP mode fails).
    p3 = mk_plan(objective="speed", topology={"tp": 2}, tensor_parallel_plan={"head": "colwise_gather"})
    assert p3.mode == "tp" and dict(p3.tensor_parallel_plan) == {"head": "colwise_gather"}
    assert any("recommended 'dp'" in n for n in p3.notes)


def test_explicit_tp_plan_without_mode_when_recommendation_is_not_tp():
    p = mk_plan(objective="speed", topology={"dp": 2, "tp": 2}, tensor_parallel_plan={"head": "colwise_gather"})
    assert p.mode == "fsdp2_tp" and dict(p.tensor_parallel_plan) == {"head": "colwise_gather"}


def test_explicit_tp_plan_on_one_rank_is_not_silently_dropped():
    with pytest.raises(ValueError, match="explicit tensor_parallel_plan allows only 'tp', 'fsdp2_tp', 'pp_tp' and 'pp_fsdp2_tp'"):
        mk_plan(objective="memory", topology=1, tensor_parallel_plan={"head": "colwise_gather"})
    p = mk_plan(objective="memory", topology={"tp": 1}, tensor_parallel_plan={"head": "colwise_gather"})
    assert p.mode == "tp" and dict(p.tensor_parallel_plan) == {"head": "colwise_gather"}


# ---- frozen, hashable, serialisable ------------------------------------------------------------

def sample_plans():
    vgg = analyze(vgg_like(), model_family="vgg16")
    return [
        mk_plan(topology=1),
        mk_plan(objective="speed", topology={"dp": 2}),
        mk_plan(objective="memory", topology={"dp": 2}),
        mk_plan(objective="memory", topology={"tp": 2}),
        mk_plan(objective="capacity", topology={"dp": 2, "tp": 2}),
        plan(analysis=vgg, objective="speed", topology={"dp": 3, "tp": 2}, neuron_backend="inductor", batch_size=6,
             features=DistributedFeatureSet(allow_experimental_conv_tp=True)),
        plan(analysis=analyze(MLP(), roots=["body"]), objective="memory", topology={"tp": 2}, neuron_backend="torch",
             batch_size=4),
    ]


@pytest.mark.parametrize("index", range(7))
def test_plan_frozen_hashable_json_round_trip(index):
    p = sample_plans()[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.mode = "dp"
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.batch_size = 2
    with pytest.raises(TypeError):
        p.tensor_parallel_plan["x"] = "colwise"
    assert isinstance(p.rationale, tuple) and isinstance(p.notes, tuple)
    text = json.dumps(p.to_dict())
    q = SNNDistributedPlan.from_dict(json.loads(text))
    assert q == p and hash(q) == hash(p)
    assert q.to_dict() == p.to_dict()
    assert q.mesh_dim_names == p.mesh_dim_names and q.mesh_shape == p.mesh_shape
    assert {p, q} == {p}
    assert p.to_dict()["kind"] == "plan"


@pytest.mark.parametrize("change", [
    {"batch_size": 16}, {"objective": "capacity"}, {"memopt_level": 0}, {"neuron_backend": "inductor"},
    {"notes": ("other",)}, {"rationale": ()}, {"model_family": "spikformer"},
    {"experimental_features": DistributedFeatureSet(allow_experimental_spikformer_tp=True)},
    {"tensor_parallel_plan": {"head": "colwise_gather"}}, {"topology": {"tp": 2, "x": 1}},
])
def test_plan_not_equal_when_a_field_differs(change):
    p = mk_plan(objective="memory", topology={"tp": 2})
    q = dataclasses.replace(p, **change)
    assert q != p
    assert dataclasses.replace(p) == p


def test_plan_not_equal_to_other_types():
    p = mk_plan()
    assert p != p.to_dict() and p != "plan" and p is not None


def test_plan_equality_respects_mesh_dim_order():
    a = SNNDistributedPlan(mode="dp", objective="speed", topology={"dp": 2, "zz": 1, "aa": 1}, batch_size=2)
    b = SNNDistributedPlan(mode="dp", objective="speed", topology={"dp": 2, "aa": 1, "zz": 1}, batch_size=2)
    assert a.mesh_dim_names != b.mesh_dim_names
    assert a != b


def sample_analyses():
    return [
        analyze(MLP()),
        analyze(vgg_like(), model_family="spikformer_ti"),
        analyze(vgg_like(), roots=["0", "3.0"]),
        analyze(nn.Sequential(nn.Conv2d(1, 2, 3))),
        analyze(linear_chain(3), model_family="nonsense"),
    ]


@pytest.mark.parametrize("index", range(5))
def test_analysis_frozen_hashable_json_round_trip(index):
    a = sample_analyses()[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.memory_module_names = ()
    b = SNNDistributedAnalysis.from_dict(json.loads(json.dumps(a.to_dict())))
    assert b == a and hash(b) == hash(a)
    assert {a, b} == {a}
    assert dataclasses.replace(a, notes=a.notes + ("x",)) != a
    assert dataclasses.replace(a, tensor_parallel_roots=("zzz",)) != a


def test_feature_set_frozen_round_trip():
    f = DistributedFeatureSet(allow_experimental_conv_tp=True, allow_zero_optimizer=False)
    assert DistributedFeatureSet.from_dict(json.loads(json.dumps(f.to_dict()))) == f
    assert hash(f) == hash(DistributedFeatureSet(True, False, False))
    assert f != DistributedFeatureSet()
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.allow_zero_optimizer = True
    d = DistributedFeatureSet()
    assert (d.allow_experimental_conv_tp, d.allow_experimental_spikformer_tp, d.allow_zero_optimizer) == \
        (False, False, True)


# ---- family resolution -------------------------------------------------------------------------

@pytest.mark.parametrize("name,family", [
    ("spikformer_ti", "spikformer"), ("Spikformer-8-384", "spikformer"), ("spikformer", "spikformer"),
    ("cifar10dvs_vgg", "cifar10dvs_vgg"), ("vgg16", "cifar10dvs_vgg"), ("cifar10dvs_vgg_small", "cifar10dvs_vgg"),
    ("CIFAR10-DVS-VGG", "cifar10dvs_vgg"), ("generic", "generic"),
])
def test_family_resolution(name, family):
    a = analyze(MLP(), model_family=name)
    assert a.model_family == family
    assert not any("not a known family" in n for n in a.notes)


def test_unknown_family_is_generic_with_note():
    a = analyze(MLP(), model_family="resnet50")
    assert a.model_family == "generic"
    assert any("'resnet50'" in n for n in a.notes)
    # the note travels into plans built from this analysis
    assert any("'resnet50'" in n for n in mk_plan_from(a).notes)


def mk_plan_from(a):
    return plan(analysis=a, objective="speed", topology=1, neuron_backend="torch", batch_size=1)


def test_family_inferred_from_class_names():
    class SpikformerBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x)

    a = analyze(nn.Sequential(SpikformerBlock()))
    assert a.model_family == "spikformer" and any("inferred" in n for n in a.notes)
    assert analyze(MLP()).model_family == "generic"


def test_plan_model_family_overrides_analysis():
    p = plan(analysis=analyze(MLP()), objective="speed", topology=1, neuron_backend="torch", batch_size=1,
             model_family="spikformer_ti")
    assert p.model_family == "spikformer"


def test_plan_unknown_model_family_gets_a_note():
    p = plan(analysis=analyze(MLP()), objective="speed", topology=1, neuron_backend="torch", batch_size=1,
             model_family="resnet50")
    assert p.model_family == "generic"
    assert any("resnet50" in n for n in p.notes)


# ---- neurons -----------------------------------------------------------------------------------

class FakeJellyNode(nn.Module):
    """Looks like a spikingjelly MemoryModule: a ``_memories`` dict and ``reset()``."""

    def __init__(self):
        super().__init__()
        self._memories = {"v": 0.0}
        self.v = 0.0
        self.resets = 0

    def reset(self):
        self.v = 0.0
        self.resets += 1

    def forward(self, x):
        self.v = self.v + x
        return x


class MyNeuron(nn.Module):
    def __init__(self):
        super().__init__()
        self.state = 1.0

    def forward(self, x):
        return x


def test_snntorch_init_hidden_stateful():
    stateful = snn.Leaky(beta=0.9, init_hidden=True)
    plain = snn.Leaky(beta=0.9)
    assert neurons.is_stateful(stateful) and neurons.snn_library(stateful) == "snntorch"
    assert not neurons.is_stateful(plain) and neurons.snn_library(plain) is None
    assert neurons.is_spiking_neuron(plain)
    model = nn.Sequential(nn.Linear(3, 3), stateful, nn.Linear(3, 3), plain)
    a = analyze(model)
    assert a.memory_module_names == ("1",)
    assert a.snn_libraries == (("1", "snntorch"),)


def test_snntorch_reset_zeroes_membrane():
    model = nn.Sequential(nn.Linear(3, 3), snn.Leaky(beta=0.9, init_hidden=True))
    model(torch.ones(2, 3))
    assert neurons.reset_all(model) == 1
    assert torch.count_nonzero(model[1].mem) == 0


def test_spikingjelly_like_module_detected_without_import():
    # that importing snn_explorer pulls in neither library is checked in a fresh process in test_spikingjelly
    model = nn.Sequential(nn.Linear(4, 4), FakeJellyNode())
    a = analyze(model)
    assert a.memory_module_names == ("1",)
    assert a.snn_libraries == (("1", "spikingjelly"),)
    assert neurons.reset_all(model) == 1 and model[1].resets == 1


def test_register_stateful_custom_reset():
    calls = []

    def reset_fn(module):
        calls.append(module)
        module.state = 0.0

    assert not neurons.is_stateful(MyNeuron())
    neurons.register_stateful(MyNeuron, reset_fn)
    try:
        model = nn.Sequential(nn.Linear(2, 2), MyNeuron(), nn.Linear(2, 2))
        a = analyze(model)
        assert a.memory_module_names == ("1",) and a.snn_libraries == (("1", "registered"),)
        assert neurons.reset_all(model) == 1 and calls == [model[1]] and model[1].state == 0.0
        p = plan(analysis=a, objective="speed", topology=1, neuron_backend="torch", batch_size=2)
        rt = se.apply(model=model, plan=p, device_type="cpu")
        model[1].state = 5.0
        assert rt.reset_state() == 1 and model[1].state == 0.0 and len(calls) == 2
    finally:
        se.unregister_stateful(MyNeuron)
    assert not neurons.is_stateful(MyNeuron())
    se.unregister_stateful(MyNeuron)  # idempotent


def test_register_stateful_default_reset_method():
    neurons.register_stateful(FakeJellyNode)  # has its own reset()
    try:
        m = FakeJellyNode()
        assert neurons.snn_library(m) == "registered"
        assert neurons.reset_all(nn.Sequential(m)) == 1 and m.resets == 1
    finally:
        se.unregister_stateful(FakeJellyNode)
    assert neurons.snn_library(FakeJellyNode()) == "spikingjelly"


# ---- analysis with roots -----------------------------------------------------------------------

def test_analysis_roots_restrict_candidates():
    model = vgg_like()
    whole = analyze(model)
    assert whole.tensor_parallel_candidate_names == ("3.0", "3.2")
    assert whole.unsupported_tensor_parallel_names == ("0",)
    assert whole.tensor_parallel_roots is None
    a = analyze(model, roots=["3"])
    assert a.tensor_parallel_candidate_names == ("3.0", "3.2")
    assert a.unsupported_tensor_parallel_names == ()
    assert a.tensor_parallel_roots == ("3",)
    assert a.memory_module_names == ("1", "3.1")  # neurons come from the whole model
    b = analyze(model, roots="3.2")
    assert b.tensor_parallel_candidate_names == ("3.2",) and b.tp_chains == (("3.2",),)
    c = analyze(model, roots=["0"])
    assert c.tensor_parallel_candidate_names == () and c.unsupported_tensor_parallel_names == ("0",)
    assert any("no Linear" in n for n in c.notes) and any("conv" in n for n in c.notes)
    d = analyze(model, roots=["3", "0", "3"])
    assert d.tensor_parallel_roots == ("3", "0")
    assert d.unsupported_tensor_parallel_names == ("0",)


def test_roots_carried_into_plan_and_limit_tp():
    model = MLP()
    p = plan(analysis=analyze(model, roots=["head"]), objective="memory", topology={"tp": 2}, neuron_backend="torch",
             batch_size=4)
    assert p.tensor_parallel_roots == ("head",)
    assert dict(p.tensor_parallel_plan) == {"head": "colwise_gather"}
    assert se.preflight(model, p).tensor_parallel_roots == ("head",)


def test_conv_layers_listed_as_unsupported():
    model = nn.Sequential(nn.Conv1d(1, 2, 3), nn.Conv2d(2, 2, 1), nn.Conv3d(2, 2, 1), nn.Flatten(), nn.Linear(2, 2))
    a = analyze(model)
    assert a.unsupported_tensor_parallel_names == ("0", "1", "2")
    assert a.tensor_parallel_candidate_names == ("4",)


# ---- apply on one rank (no process group) ------------------------------------------------------

def test_apply_none_plan_on_cpu():
    model = MLP()
    p = mk_plan(model)
    rt = se.apply(model=model, plan=p, device_type="cpu")
    assert isinstance(rt, SNNDistributedRuntime)
    assert rt.model is model and rt.mesh is None and rt.plan is p
    assert rt.dp_size == 1 and rt.dp_rank == 0 and rt.tp_rank == 0
    out, labels = rt.prepare_classification_output(torch.randn(3, 4, 10), torch.tensor([[1], [2], [3], [0]]))
    assert out.shape == (4, 10) and labels.tolist() == [1, 2, 3, 0]
    loader = rt.prepare_dataloader(torch.utils.data.TensorDataset(torch.randn(10, 8)), batch_size=4)
    assert loader.batch_size == 4 and len(loader) == 2


def test_apply_keeps_models_with_a_submodule_named_module():
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(4, 4)
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.module(x))

    model = Wrapper()
    rt = se.apply(model=model, plan=mk_plan(model), device_type="cpu")
    assert rt.module is model
    assert rt.model(torch.randn(1, 4)).shape == (1, 2)


# ---- every plan that plan() returns passes the model checks apply makes ------------------------

@pytest.mark.parametrize("topology", [1, 2, 3, 4, {"tp": 2}, {"dp": 2, "tp": 2}, {"dp": 1, "tp": 2},
                                      {"dp": 2, "tp": 1}, {"dp": 3, "tp": 2}, {"x": 1, "tp": 2}])
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_every_returned_plan_fits_topology_and_model(objective, topology):
    for factory, family in ((MLP, None), (vgg_like, "vgg16"), (lambda: linear_chain(3), None)):
        model = factory()
        p = plan(analysis=analyze(model, model_family=family), objective=objective, topology=topology,
                 neuron_backend="torch", batch_size=12)
        assert topology_problem(p.mode, p.topology) is None, p
        if p.mode in ("tp", "fsdp2_tp"):
            assert p.tensor_parallel_plan
        if p.mode == "tp":
            assert "tp" in p.mesh_dim_names and p.topology.size("dp") == 1
        se.preflight(model, p)
        assert SNNDistributedPlan.from_dict(json.loads(json.dumps(p.to_dict()))) == p


# ---- the mode table ----------------------------------------------------------------------------

# What each mode is, written out by hand: (dims, ddp, fsdp, tp).
MODE_FACTS = {
    "none": ((), False, False, False),
    "dp": (("dp",), True, False, False),
    "tp": (("tp",), False, False, True),
    "fsdp2": (("dp",), False, True, False),
    "fsdp2_tp": (("dp", "tp"), False, True, True),
    "pp": (("pp", "dp"), False, False, False),
    "pp_tp": (("pp", "dp", "tp"), False, False, True),
    "pp_fsdp2": (("pp", "dp"), False, True, False),
    "pp_fsdp2_tp": (("pp", "dp", "tp"), False, True, True),
}


def test_mode_table_rows():
    from snn_explorer.core.common import MODE_TABLE, MODES, mode_of

    assert se.core.common.MODES == MODES == tuple(MODE_FACTS) == tuple(m.name for m in MODE_TABLE)
    for name, (dims, ddp, fsdp, tp) in MODE_FACTS.items():
        m = mode_of(name)
        assert (m.dims, m.ddp, m.fsdp, m.tp) == (dims, ddp, fsdp, tp), name
        assert m.distributed == (name != "none") and m.allows_zero == (name == "dp")
    with pytest.raises(ValueError, match=r"unsupported mode='ddp'; expected one of \('none', 'dp'"):
        mode_of("ddp")
    assert mode_of("pp").pp and mode_of("pp").optional_dims == ("dp",) and not any(
        m.pp for m in MODE_TABLE if m.name not in ("pp", "pp_tp", "pp_fsdp2", "pp_fsdp2_tp"))
    assert mode_of("pp_tp").pp and mode_of("pp_tp").optional_dims == ("dp",)
    assert all(mode_of(n).pp and mode_of(n).optional_dims == () for n in ("pp_fsdp2", "pp_fsdp2_tp"))


@pytest.mark.parametrize("name,topology,memopt,sizes", [
    ("none", {"dp": 1}, 1, (1, 1)),
    ("dp", {"dp": 4}, 1, (4, 1)),
    ("tp", {"tp": 2}, 1, (1, 2)),
    ("fsdp2", {"dp": 2}, 0, (2, 1)),
    ("fsdp2", {"dp": 2}, 1, (2, 1)),
    ("fsdp2_tp", {"dp": 2, "tp": 2}, 1, (2, 2)),
])
def test_plan_facts_follow_the_mode(name, topology, memopt, sizes):
    dims, ddp, fsdp, tp = MODE_FACTS[name]
    p = SNNDistributedPlan(mode=name, objective="speed", topology=topology, batch_size=8, memopt_level=memopt,
                           tensor_parallel_plan={"head": "colwise_gather"} if tp else {})
    assert (p.uses_ddp, p.uses_fsdp, p.uses_tp, p.distributed) == (ddp, fsdp, tp, bool(dims))
    assert (p.dp_size, p.tp_size) == sizes == (p.dim_size("dp"), p.dim_size("tp"))
    assert p.reshard_after_forward == (fsdp and memopt == 1)
    assert p.mode_spec.name == name and p.to_dict()["mode"] == name  # JSON keeps the name


def test_no_mode_name_tests_outside_the_mode_table():
    """Code asks a plan's predicates (uses_fsdp, uses_tp, ...), never compares mode names."""
    import pathlib
    import re

    root = pathlib.Path(se.__file__).parent
    pattern = re.compile(r"""\b(mode|chosen)\s*(==|!=|\bin\b|\bnot in\b)\s*[("']|startswith\("fsdp""")
    hits = [f"{path.relative_to(root)}:{n}: {line.strip()}"
            for path in root.rglob("*.py") if path.name != "modes.py"
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, hits


def test_no_schedule_name_tests_outside_the_schedule_registry():
    """Code asks a plan's schedule object (plan.pp_schedule_spec), never compares schedule names."""
    import pathlib
    import re

    from snn_explorer.core.planning import SCHEDULES

    root = pathlib.Path(se.__file__).parent
    names = "|".join(re.escape(n) for n in SCHEDULES)
    pattern = re.compile(rf"""\bschedule\w*\s*(==|!=|\bin\b|\bnot in\b)|["']({names})["']\s*[:,)\]]""")
    hits = [f"{path.relative_to(root)}:{n}: {line.strip()}"
            for path in root.rglob("*.py") if path.name != "pipeline_schedules.py"
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, hits


def test_plan_picks_the_stages_per_rank_a_schedule_needs():
    """Unset virtual stages follow the schedule: 1 for single-stage ones, exactly 2 for zbv."""
    from snn_explorer.zoo import build

    zoo = build("vgg", batch_size=8)
    analysis = se.analyze(zoo.model)
    for schedule, virtual in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved_zb", 2), ("zbv", 2)):
        p = se.plan(analysis=analysis, objective="capacity", topology={"pp": 2}, batch_size=8, mode="pp", options=se.PlanOptions(pp_schedule=schedule))
        assert (p.pp_virtual_stages, p.pp_schedule_spec.name) == (virtual, schedule)
        assert p.to_dict()["pp_schedule"] == schedule
    zbv = se.plan(analysis=analysis, objective="capacity", topology={"pp": 2}, batch_size=8, mode="pp", options=se.PlanOptions(pp_schedule="zbv"))
    assert [zbv.pp_schedule_spec.rank_stages(r, 2, 2) for r in (0, 1)] == [(0, 3), (1, 2)]
