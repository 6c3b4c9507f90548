"""Activation checkpointing and CPU offload as plan features: plan-time checks, JSON, and on real gloo ranks
the checkpointed run equals the run without it (float64, 3 Adam steps) in every mode, for a model stepped
all time steps at once (blocks) and one stepped per time step (time chunks, state carried across chunks).

One 2-rank group and one 4-rank group run every multi-rank case; the tests read their results.
"""
import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_on_ranks
from models import train_share
from torch import nn

import snn_explorer as se
from snn_explorer.core.block_choice import choose_blocks
from snn_explorer.core.chunk_choice import choose_chunks
from snn_explorer.core.memory_levers import ACTIVATION_CHECKPOINTING, find_time_step_module
from snn_explorer.core.parallelize.checkpointing import block_segments, checkpoint_blocks, checkpoint_time_chunks
from snn_explorer.core.plan_types import SNNDistributedPlan
from snn_explorer.zoo import build, reset_state

STEPS = 3
#: the run without checkpointing (the memory objective would checkpoint with the gate on)
PLAIN = dict(activation_checkpointing="none")
TOL = 1e-5
GATES = se.DistributedFeatureSet(allow_activation_checkpointing=True, allow_cpu_offload=True)
#: (zoo model, granularity, k, time_step_module): per-step mlp in chunks of 3 of its 8 steps (state carried
#: across chunks), the all-steps mlp per block and every 2nd block.
MODELS = (("mlp", "time_chunks", 3, "net"), ("mlp_all_steps", "blocks", 1, None), ("mlp_all_steps", "blocks", 2, None))
#: a block chosen on its own (core.block_choice): trained on the 2-rank group's modes, compared to 0 difference
PER_BLOCK = dict(activation_checkpointing="blocks", checkpoint_blocks=("net.2",))
RANK_CASES = {2: (("dp", {"dp": 2}), ("fsdp2", {"dp": 2}), ("tp", {"tp": 2})),
              4: (("fsdp2_tp", {"dp": 2, "tp": 2}), ("fsdp2", {"dp": 4}))}


# ---- plan time ---------------------------------------------------------------------------------------------
def _plan(zoo_name="mlp_all_steps", features=GATES, **kw):
    zoo = build(zoo_name)
    kw.setdefault("topology", {"dp": 2})
    return se.plan(analysis=se.analyze(zoo.model), objective="memory", batch_size=8, features=features, **kw)


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
    # "ops" is asked for, not enumerated (torchtitan's transformer-block policy; tests/test_op_checkpointing.py)
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
                     mode=mode, features=GATES, **lv) for lv in (PLAIN, levers)]
    return zoo, plans


def _measured_peaks(cases):
    """Per memory case: the measured peak of each rank without and with checkpointing (measure()'s step)."""
    from snn_explorer.estimator.measurement.plan_measurement import measure_on_rank
    from snn_explorer.estimator.measurement.settings import measure_settings

    peaks = []
    for case in cases:
        zoo, plans = _memory_plans(case)
        run = measure_settings(zoo.model, plans, zoo.example_input, zoo.labels, 1, "adam", None, 1e-3, "cpu")
        peaks.append([m["row"]["peak_bytes"] for m in measure_on_rank(zoo.model, plans, run)])
    return peaks


def _rank_group(cases, memory_cases=()):
    """Every (mode, topology) x model case on these ranks: the run with and without checkpointing; then the
    measured peaks of ``memory_cases``."""
    results = []
    for mode, topology in cases:
        for zoo_name, granularity, every, step_module in MODELS:
            runs = {}
            for checkpointing in (False, True):
                zoo = build(zoo_name)
                model = zoo.model.double()
                levers = dict(activation_checkpointing=granularity, checkpoint_every=every,
                              time_step_module=step_module) if checkpointing else PLAIN
                plan = se.plan(analysis=se.analyze(model), objective="memory", topology=topology,
                               batch_size=zoo.batch_size, mode=mode, features=GATES, **levers)
                runtime = se.apply(model=model, plan=plan, device_type="cpu")
                runs[checkpointing] = train_share(runtime, zoo, STEPS)
            per_block = (_per_block_run(mode, topology) if dist.get_world_size() == 2 and zoo_name == "mlp_all_steps"
                         and every == 1 else None)
            results.append(dict(mode=mode, topology=topology, model=zoo_name, granularity=granularity,
                                every=every, rank=dist.get_rank(), plain=runs[False], checkpointed=runs[True],
                                per_block=per_block))
    return results, _measured_peaks(memory_cases)


def _per_block_run(mode, topology):
    """mlp_all_steps trained with PER_BLOCK (apply as the plan says; compared with the case's plain run)."""
    zoo = build("mlp_all_steps")
    model = zoo.model.double()
    plan = se.plan(analysis=se.analyze(model), objective="memory", topology=topology, batch_size=zoo.batch_size,
                   mode=mode, features=GATES, **PER_BLOCK)
    return train_share(se.apply(model=model, plan=plan, device_type="cpu"), zoo, STEPS)


@pytest.fixture(scope="module")
def rank_groups():
    """Each rank group's results, by world size: per rank (equivalence results, measured peaks)."""
    return {world: run_on_ranks(_rank_group, world, cases, MEMORY_CASES if world == 2 else (), timeout=300)
            for world, cases in RANK_CASES.items()}


@pytest.fixture(scope="module")
def rank_results(rank_groups):
    return [r for per_rank in rank_groups.values() for results, _ in per_rank for r in results]


@pytest.fixture(scope="module")
def memory_rows(rank_groups):
    """Per memory case: (estimated peak, measured peak) without and with checkpointing (max over ranks)."""
    measured = [max(per_rank[1][i][j] for per_rank in rank_groups[2]) for i in range(len(MEMORY_CASES))
                for j in (0, 1)]
    rows = []
    for i, case in enumerate(MEMORY_CASES):
        zoo, plans = _memory_plans(case)
        estimated = [se.estimate(zoo.model, p, example_input=zoo.example_input, labels=zoo.labels) for p in plans]
        rows.append(dict(case=case, estimates=estimated, measured=measured[2 * i:2 * i + 2]))
    return rows


def test_checkpointing_lowers_the_measured_peak_as_estimated(memory_rows):
    for row in memory_rows:
        (plain_est, ckpt_est), (plain, ckpt) = row["estimates"], row["measured"]
        label = f"{row['case'][0]} {row['case'][2]} {row['case'][3]}"
        assert ckpt < plain, f"{label}: checkpointing did not lower the measured peak ({ckpt} >= {plain})"
        print(f"{label}: estimated {plain_est.peak_bytes} -> {ckpt_est.peak_bytes} B, measured {plain} -> {ckpt} B")
        for est, got in ((plain_est.peak_bytes, plain), (ckpt_est.peak_bytes, ckpt)):
            assert abs(est - got) <= 0.1 * got, f"{label}: estimated peak {est} vs measured {got}"
        saving_est, saving = plain_est.peak_bytes - ckpt_est.peak_bytes, plain - ckpt
        assert abs(saving_est - saving) <= 0.1 * saving, f"{label}: estimated saving {saving_est} vs measured {saving}"
        assert ckpt_est.per_rank["activations_bytes"].max() < plain_est.per_rank["activations_bytes"].max()
        assert plain_est.recompute_forward_fraction == 0.0 and 0.1 < ckpt_est.recompute_forward_fraction < 3


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


def test_per_block_checkpointing_trains_as_without_it_to_0_difference(rank_groups):
    """mlp_all_steps with one of its three blocks recomputed, applied on 2 gloo ranks in dp, fsdp2 and tp: outputs,
    losses, gradients and parameters after 3 Adam steps equal the run without, bit for bit; spikes fire."""
    runs = [r for results, _ in rank_groups[2] for r in results if r["per_block"] is not None]
    assert len(runs) == 2 * len(RANK_CASES[2])
    for r in runs:
        plain, got = r["plain"], r["per_block"]
        assert all(0.02 <= rate <= 0.98 for rate in plain["rates"].values()) and plain["rates"]
        assert plain["losses"][0] != plain["losses"][-1]
        for what in ("outs", "losses"):
            assert len(got[what]) == len(plain[what]) > 0, (r["mode"], what)
            assert all(torch.equal(g, w) for g, w in zip(got[what], plain[what])), (r["mode"], what)
        for what in ("grads", "params"):
            assert all(torch.equal(got[what][n], plain[what][n]) for n in plain[what]), (r["mode"], what)


def _close(name, got, want):
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    assert err <= TOL, f"{name}: max abs error {err:.3g} > {TOL}"


def test_every_mode_and_model_ran_on_every_rank(rank_results):
    seen = {(r["mode"], str(r["topology"]), r["model"], r["granularity"], r["every"]) for r in rank_results}
    assert len(seen) == sum(len(c) for c in RANK_CASES.values()) * len(MODELS)
    assert len(rank_results) == sum(w * len(c) for w, c in RANK_CASES.items()) * len(MODELS)


def test_comparisons_are_not_vacuous(rank_results):
    for r in rank_results:
        plain = r["plain"]
        assert plain["rates"], "no spiking layers recorded"
        for name, rate in plain["rates"].items():
            assert 0.02 <= rate <= 0.98, f"{r['mode']} {r['model']}: spike rate of {name} is {rate:.3f}"
        assert all(out.std() > 1e-3 for out in plain["outs"]), "outputs are constant"
        assert plain["losses"][0] != plain["losses"][-1], "training did not change the loss"


@pytest.mark.parametrize("what", ["outs", "losses", "grads", "params"])
def test_checkpointed_run_equals_plain_run(rank_results, what):
    for r in rank_results:
        label = f"{r['mode']} {r['model']} {r['granularity']}/{r['every']} rank {r['rank']} {what}"
        got, want = r["checkpointed"][what], r["plain"][what]
        if isinstance(want, dict):
            assert got.keys() == want.keys()
            for name in want:
                _close(f"{label} {name}", got[name], want[name])
        else:
            for step, (g, w) in enumerate(zip(got, want)):
                _close(f"{label} step {step}", g, w)


def test_granularities_listed():
    assert ACTIVATION_CHECKPOINTING == ("none", "blocks", "time_chunks", "ops")


def test_explorer_charts_time_chunk_activations_against_time_steps():
    from snn_explorer.estimator.memory.activation_curve import activation_curve

    ex = se.Explorer.from_zoo(build("mlp"))
    plan = ex.make_plan(objective="memory", topology={"dp": 2}, features={"allow_activation_checkpointing": True},
                        activation_checkpointing="time_chunks", checkpoint_every=4)
    assert (plan.activation_checkpointing, plan.time_step_module) == ("time_chunks", "net")
    figure = ex.activation_chart(plan, (4, 8))
    lines = figure.axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["checkpointing: none", "checkpointing: time_chunks"]
    plain, chunked = (line.get_ydata() for line in lines)
    assert (chunked < plain).all() and plain[1] > plain[0]
    all_steps = se.Explorer.from_zoo(build("mlp_all_steps"))
    blocks = all_steps.make_plan(objective="memory", topology={"dp": 2}, features=GATES, activation_checkpointing="blocks")
    all_steps.estimate(blocks)
    curve = activation_curve(all_steps._profile, blocks, (4, 8))
    by = {k: rows["activations_bytes"].to_numpy() for k, rows in curve.groupby("plan")}
    assert blocks.activation_checkpointing == "blocks" and (by["blocks"] < by["none"]).all()
