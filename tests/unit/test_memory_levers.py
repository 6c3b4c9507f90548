"""Activation checkpointing and CPU offload as plan features: plan-time checks, JSON, and on real gloo ranks
the checkpointed run equals the run without it (float64, 3 Adam steps) in every mode, for a model stepped
all time steps at once (blocks) and one stepped per time step (time chunks, state carried across chunks).

One 2-rank group and one 4-rank group run every multi-rank case; the tests read their results.
 (The tests on gloo ranks: tests/ranks/test_memory_levers_ranks.py.)"""
import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import snn_explorer as se
from snn_explorer.core.levers import ACTIVATION_CHECKPOINTING, choose_blocks, choose_chunks, find_time_step_module
from snn_explorer.core.parallelize import block_segments, checkpoint_blocks, checkpoint_time_chunks
from snn_explorer.core.planning import SNNDistributedPlan, split_options
from snn_explorer.zoo import build, reset_state

#: the run without checkpointing (the memory objective would checkpoint with the gate on)
PLAIN = dict(activation_checkpointing="none")
GATES = se.DistributedFeatureSet(allow_activation_checkpointing=True, allow_cpu_offload=True)


# ---- plan time ---------------------------------------------------------------------------------------------
def _plan(zoo_name="mlp_all_steps", features=GATES, **kw):
    zoo = build(zoo_name)
    kw.setdefault("topology", {"dp": 2})
    return se.plan(analysis=se.analyze(zoo.model), objective="memory", batch_size=8, features=features, **split_options(kw))


def test_plan_fields_round_trip_and_old_json_loads():
    plan = _plan("mlp", activation_checkpointing="time_chunks", checkpoint_every=3, time_step_module="net",
                 mode="fsdp2", cpu_offload=True)
    assert (plan.activation_checkpointing, plan.checkpoint_every, plan.cpu_offload, plan.time_step_module) == \
        ("time_chunks", 3, True, "net")
    assert SNNDistributedPlan.from_dict(plan.to_dict()) == plan
    assert "+ac:time_chunks/3+offload" in repr(plan)
    old = plan.to_dict()
    for name in ("activation_checkpointing", "checkpoint_every", "cpu_offload", "time_step_module"):
        old.pop(name)
    for name in ("allow_activation_checkpointing", "allow_cpu_offload"):
        old["experimental_features"].pop(name)
    loaded = SNNDistributedPlan.from_dict(old)
    assert (loaded.activation_checkpointing, loaded.checkpoint_every, loaded.cpu_offload) == ("none", 1, False)
    assert plan.layout_key() != loaded.layout_key()


def test_cpu_offload_picks_an_fsdp2_mode():
    plan = _plan(cpu_offload=True, topology={"dp": 2, "tp": 2})
    assert plan.uses_fsdp and plan.cpu_offload
    assert any("needs CUDA ranks" in note for note in plan.notes)


@pytest.mark.parametrize("kw,match", [
    (dict(activation_checkpointing="blocks", features=se.DistributedFeatureSet()), "allow_activation_checkpointing"),
    (dict(cpu_offload=True, mode="fsdp2", features=se.DistributedFeatureSet()), "allow_cpu_offload"),
    (dict(cpu_offload=True, mode="dp"), "cpu_offload=True offloads FSDP2's shards.*not mode='dp'"),
    (dict(activation_checkpointing="layers"), "activation_checkpointing='layers'; expected one of"),
    (dict(activation_checkpointing="blocks", checkpoint_every=0), "checkpoint_every=0 must be an int >= 1"),
    (dict(activation_checkpointing="none", checkpoint_every=2), "checkpoint_every=2 has no effect with activation_checkpointing='none'"),
    (dict(activation_checkpointing="time_chunks"), "needs time_step_module"),
    (dict(activation_checkpointing="blocks", time_step_module="net"), "only used by .*'time_chunks', not 'blocks'"),
    (dict(activation_checkpointing="time_chunks", time_step_module="net.0"), "time_step_module='net.0' holds none"),
])
def test_plan_time_errors_name_the_values(kw, match):
    with pytest.raises(ValueError, match=match):
        _plan(**kw)


def test_memory_objectives_never_switch_a_lever_on_by_rule():
    """Left to the objective, checkpointing is on only by its estimated effect: without an estimator none, and
    the plan's note says how to let the estimate choose; explicit choices stand."""
    for zoo_name, kw in (("mlp_all_steps", {}), ("mlp", dict(time_step_module="net"))):
        plan = _plan(zoo_name, **kw)
        assert plan.activation_checkpointing == "none" and plan.time_step_module is None
        assert any("peak_estimate=snn_explorer.plan_estimator" in note for note in plan.notes)
    assert _plan(activation_checkpointing="blocks").activation_checkpointing == "blocks"
    assert not any("memory levers" in note for note in _plan(features=se.DistributedFeatureSet()).notes)
    zoo = build("mlp_all_steps")
    speed = se.plan(analysis=se.analyze(zoo.model), objective="speed", batch_size=8, topology={"dp": 2},
                    features=GATES)
    assert speed.activation_checkpointing == "none"
    assert not any("memory levers" in note for note in speed.notes)
    with pytest.raises(TypeError, match="peak_estimate must be a callable"):
        _plan(peak_estimate=42)


def test_the_memory_objective_keeps_the_plan_when_no_lever_lowers_the_injected_peak():
    """plan(peak_estimate=...) with a stand-in estimate: a lever that raises the peak is not taken, the lowest
    peak below the plan's own is (its time cost in the note)."""
    def raising(p):
        return SimpleNamespace(peak_bytes=100 if p.activation_checkpointing == "none" and not p.spike_compression
                               else 120, step_time_s=1.0)

    def every_2nd_lowest(p):
        lowest = p.activation_checkpointing == "blocks" and p.checkpoint_every == 2
        return SimpleNamespace(peak_bytes=80 if lowest else 100, step_time_s=1.5 if lowest else 1.0)

    kept = _plan(peak_estimate=raising)
    assert (kept.activation_checkpointing, kept.spike_compression) == ("none", False)
    assert any(n.startswith("memory levers: none lowers the estimated peak of 100 B") for n in kept.notes)
    chosen = _plan(peak_estimate=every_2nd_lowest)
    assert (chosen.activation_checkpointing, chosen.checkpoint_every) == ("blocks", 2)
    assert any("peak 80 B against 100 B without levers, +500.000 ms per step" in n for n in chosen.notes)


def test_enumerate_plans_offers_checkpointing_variants():
    analysis = se.analyze(build("mlp").model)
    plain = se.enumerate_plans(analysis, world_size=2, batch_size=8)
    gated = se.enumerate_plans(analysis, world_size=2, batch_size=8, features=GATES, time_step_module="net")
    assert {p.activation_checkpointing for p in plain} == {"none"}
    assert len(gated) == 3 * len(plain)
    # "ops" is asked for, not enumerated (torchtitan's transformer-block policy; tests/unit/test_op_checkpointing.py)
    assert {p.activation_checkpointing for p in gated} == set(ACTIVATION_CHECKPOINTING) - {"ops"}


def test_cpu_offload_refused_on_cpu_ranks_before_any_collective():
    plan = _plan(cpu_offload=True, mode="fsdp2")
    with pytest.raises(ValueError, match="cpu_offload=True keeps FSDP2's shards in CPU memory.*device_type='cpu'"):
        se.apply(model=build("mlp_all_steps").model, plan=plan, device_type="cpu")


def test_time_chunks_on_a_model_run_all_steps_at_once_fails_at_its_first_forward():
    zoo = build("mlp_all_steps")
    assert find_time_step_module(zoo.model, zoo.example_input) is None
    assert find_time_step_module(build("mlp").model, zoo.example_input) == "net"
    checkpoint_time_chunks(zoo.model, "net", 2)
    with pytest.raises(ValueError, match="time_step_module='net' ran once in this forward"):
        zoo.model(zoo.example_input)


def test_blocks_are_units_with_their_neurons():
    assert block_segments(build("mlp").model, ("net.0", "net.2", "net.4")) == \
        [("net", ("0", "1")), ("net", ("2", "3")), ("net", ("4",))]


# ---- one process: the state restore is what makes the recompute right ---------------------------------------
def _grads_after_backward(model, zoo):
    reset_state(model)
    out = model(zoo.example_input.double())
    nn.functional.cross_entropy(out.mean(0), zoo.labels).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("zoo_name", ["mlp_all_steps", "mlp"])
def test_recompute_without_state_restore_differs(zoo_name):
    zoo = build(zoo_name)
    zoo.model.double()
    apply = (lambda m, restore: checkpoint_blocks(m, ("net.0", "net.2", "net.4"), 1, restore=restore)) \
        if zoo_name == "mlp_all_steps" else (lambda m, restore: checkpoint_time_chunks(m, "net", 3, restore=restore))
    runs = {}
    for restore in (True, False):
        model = copy.deepcopy(zoo.model)
        apply(model, restore)
        try:
            runs[restore] = _grads_after_backward(model, zoo)
        except torch.utils.checkpoint.CheckpointError as exc:  # torch saw recomputed tensors of other shapes
            runs[restore] = exc
    want = _grads_after_backward(zoo.model, zoo)
    assert all(torch.equal(runs[True][n], want[n]) for n in want)
    if not isinstance(runs[False], Exception):
        assert max((runs[False][n] - want[n]).abs().max().item() for n in want) > 1e-3


# ---- real ranks ------------------------------------------------------------------------------------------
#: Memory cases (2 ranks, T=MEMORY_T): the measured peak with and without checkpointing, beside the estimate.
MEMORY_T = 16
MEMORY_CASES = (("dp", {"dp": 2}, "mlp_all_steps", dict(activation_checkpointing="blocks")),
                ("tp", {"tp": 2}, "mlp_all_steps", dict(activation_checkpointing="blocks")),
                ("fsdp2", {"dp": 2}, "mlp_all_steps", dict(activation_checkpointing="blocks", checkpoint_every=2)),
                ("dp", {"dp": 2}, "mlp", dict(activation_checkpointing="time_chunks", checkpoint_every=4,
                                               time_step_module="net")),
                # the blocks choose_blocks picks for it (test_the_measured_per_block_case_is_the_estimators_choice)
                ("dp", {"dp": 2}, "mlp_all_steps", dict(activation_checkpointing="blocks", checkpoint_blocks=("net.0",))))


def _memory_plans(case):
    mode, topology, zoo_name, levers = case
    zoo = build(zoo_name, time_steps=MEMORY_T)
    analysis = se.analyze(zoo.model)
    plans = [se.plan(analysis=analysis, objective="memory", topology=topology, batch_size=zoo.batch_size,
                     mode=mode, features=GATES, **split_options(lv)) for lv in (PLAIN, levers)]
    return zoo, plans


def test_the_measured_per_block_case_is_the_estimators_choice():
    zoo, (plain, chosen) = _memory_plans(MEMORY_CASES[-1])
    choice = choose_blocks(plain, se.analyze(zoo.model).fsdp_unit_names,
                           se.plan_estimator(zoo.model, zoo.example_input, zoo.labels))
    assert choice.plan.layout_key() == chosen.layout_key()  # the same plan, its notes aside


def test_the_measured_time_chunk_case_is_the_estimators_choice():
    """The time-chunk case measured on the ranks (k = 4) is the size choose_chunks takes by estimate at T = 16."""
    zoo, (plain, chunked) = _memory_plans(MEMORY_CASES[3])
    choice = choose_chunks(plain, "net", se.plan_estimator(zoo.model, zoo.example_input, zoo.labels))
    assert [p.checkpoint_every for p, _ in choice.tried] == [1, 2, 4, 8, 16]
    assert choice.plan.layout_key() == chunked.layout_key()  # the same plan, its notes aside


def test_granularities_listed():
    assert ACTIVATION_CHECKPOINTING == ("none", "blocks", "time_chunks", "ops")


def test_explorer_charts_time_chunk_activations_against_time_steps():
    from snn_explorer.estimator.memory.activation_curve import activation_curve

    ex = se.Explorer.from_zoo(build("mlp"))
    plan = ex.make_plan(objective="memory", topology={"dp": 2}, features={"allow_activation_checkpointing": True}, options=se.PlanOptions(activation_checkpointing="time_chunks", checkpoint_every=4))
    assert (plan.activation_checkpointing, plan.time_step_module) == ("time_chunks", "net")
    figure = ex.activation_chart(plan, (4, 8))
    lines = figure.axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["checkpointing: none", "checkpointing: time_chunks"]
    plain, chunked = (line.get_ydata() for line in lines)
    assert (chunked < plain).all() and plain[1] > plain[0]
    all_steps = se.Explorer.from_zoo(build("mlp_all_steps"))
    blocks = all_steps.make_plan(objective="memory", topology={"dp": 2}, features=GATES, options=se.PlanOptions(activation_checkpointing="blocks"))
    all_steps.estimate(blocks)
    curve = activation_curve(all_steps._profile, blocks, (4, 8))
    by = {k: rows["activations_bytes"].to_numpy() for k, rows in curve.groupby("plan")}
    assert blocks.activation_checkpointing == "blocks" and (by["blocks"] < by["none"]).all()
