"""Activation checkpointing and CPU offload as plan features: plan-time checks, JSON, and on real gloo ranks
the checkpointed run equals the run without it (float64, 3 Adam steps) in every mode, for a model stepped
all time steps at once (blocks) and one stepped per time step (time chunks, state carried across chunks).

One 2-rank group and one 4-rank group run every multi-rank case; the tests read their results.
 (The tests in one process: tests/unit/test_memory_levers.py.)"""

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_on_ranks
from models import train_share
from test_memory_levers import GATES, MEMORY_CASES, PLAIN, _memory_plans

import snn_explorer as se
from snn_explorer.core.planning import split_options
from snn_explorer.zoo import build

STEPS = 3
TOL = 1e-5
#: (zoo model, granularity, k, time_step_module): per-step mlp in chunks of 3 of its 8 steps (state carried
#: across chunks), the all-steps mlp per block and every 2nd block.
MODELS = (("mlp", "time_chunks", 3, "net"), ("mlp_all_steps", "blocks", 1, None), ("mlp_all_steps", "blocks", 2, None))
#: a block chosen on its own (core.block_choice): trained on the 2-rank group's modes, compared to 0 difference
PER_BLOCK = dict(activation_checkpointing="blocks", checkpoint_blocks=("net.2",))
RANK_CASES = {2: (("dp", {"dp": 2}), ("fsdp2", {"dp": 2}), ("tp", {"tp": 2})),
              4: (("fsdp2_tp", {"dp": 2, "tp": 2}), ("fsdp2", {"dp": 4}))}


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
                               batch_size=zoo.batch_size, mode=mode, features=GATES, **split_options(levers))
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
                   mode=mode, features=GATES, **split_options(PER_BLOCK))
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
