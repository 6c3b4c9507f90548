"""Estimates against measurements on real gloo ranks (2 and 4), every mode.

Exact: parameter, gradient, optimizer-state and buffer bytes per rank, and every collective's
count and bytes per step. Peak tensor memory per rank within 10 %. The order of plans by peak
is the same estimated and measured. The collective recorder agrees with torch's CommDebugMode.
"""
import dataclasses

import pytest
import torch
from distributed_harness import run_on_ranks
from models import dominant_classifier, wide_jelly
from torch import nn

import snn_explorer as se
from snn_explorer.estimator import compare_estimate, enumerate_plans, estimate, measure_many
from snn_explorer.estimator.measurement.plan_measurement import assemble_measurements, measure_on_rank
from snn_explorer.estimator.measurement.settings import measure_settings
from snn_explorer.zoo import SpikingMLP, build

#: Estimates compared with this machine's CPU ranks are made on a CPU-device profile (the operator-count model of
#: what these ranks allocate); a GPU profile predicts what a GPU allocates.
CPU_SIDE = dataclasses.replace(se.hardware_profile("A100-SXM-80GB"), device="cpu", kernel_model=False)

pytestmark = pytest.mark.timeout(900)  # the first test of a world size measures every case of it

PEAK_TOL = 0.10
STEPS = 2  # training steps before the measured one
EXACT = ("params_bytes", "grads_bytes", "optimizer_bytes", "buffers_bytes")


def _padded_mlp():
    """A head of 10 rows: FSDP2 over 4 ranks pads it to 4 x 3 rows, and rank 3 holds 1 real row."""
    torch.manual_seed(0)
    model = SpikingMLP(in_features=16, hidden=(32, 32), num_classes=10, stepping="all_steps", init_gain=2.0)
    x = torch.bernoulli(torch.full((4, 8, 16), 0.4, dtype=torch.float32))
    return model, x, torch.arange(8) % 10


def _plain():
    """No module runs twice per forward, so torch's CommDebugMode can count alongside."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)), torch.randn(3, 4, 16), torch.arange(4) % 8


BUILDERS = {"padded": _padded_mlp, "plain": _plain, "wide_jelly": wide_jelly, "dominant": dominant_classifier}

#: Gates of the experimental TP styles (channel-sharded convolutions, head-aligned attention).
EXPERIMENTAL = se.DistributedFeatureSet(allow_experimental_conv_tp=True, allow_experimental_spikformer_tp=True)


def _setup(name, world, objectives=("speed",), optimizer="adam", features=None):
    """(model, plans, measure settings, input, labels) of one case: its plans of every objective, pp plans left out."""
    if name in BUILDERS:
        model, x, y = BUILDERS[name]()
        family = "generic"
    else:
        zoo = build(name)
        model, x, y, family = zoo.model, zoo.example_input, zoo.labels, zoo.family
    analysis = se.analyze(model, model_family=family)
    plans = [p for obj in objectives for p in enumerate_plans(analysis, world_size=world, batch_size=x.shape[1],
                                                               objective=obj, features=features)]
    plans = list(dict.fromkeys(p for p in plans if (features is None or p.tp_size > 1)
                               and not p.uses_pp))  # measure() refuses pp plans
    return model, plans, measure_settings(model, plans, x, y, STEPS, optimizer, None, 1e-3, "cpu"), x, y


def _measure_cases(cases):
    """On each rank: what measure_many's ranks return, for every (model, plans, settings) case in turn."""
    return [measure_on_rank(model, plans, run) for model, plans, run in cases]


def _measure(setups):
    """key -> measure_many(model, plans, ...) of each case; the cases of one world size share one spawn of ranks."""
    measured = {}
    for world in sorted({CASES[k][1] for k in setups}):
        keys = [k for k in setups if CASES[k][1] == world]
        if world == 1:  # measure_many runs it in this process
            for k in keys:
                model, plans, run, x, y = setups[k]
                measured[k] = measure_many(model, plans, example_input=x, labels=y, steps=STEPS,
                                           optimizer=CASES[k][3], timeout=240)
            continue
        per_rank = run_on_ranks(_measure_cases, world, [setups[k][:3] for k in keys], timeout=840)
        for i, k in enumerate(keys):
            measured[k] = assemble_measurements(setups[k][1], [rank[i] for rank in per_rank], setups[k][2])
    return measured


CASES = {
    "mlp-1": ("mlp", 1, ("speed",), "adam"),
    "mlp-2": ("mlp", 2, ("speed", "memory"), "adam"),
    "mlp_all_steps-2": ("mlp_all_steps", 2, ("speed", "memory"), "adam"),
    "mlp_all_steps-4": ("mlp_all_steps", 4, ("speed", "memory"), "adam"),
    "vgg-2": ("vgg", 2, ("speed",), "sgd_momentum"),
    "vgg-4": ("vgg", 4, ("speed", "memory"), "adam"),
    "padded-4": ("padded", 4, ("speed",), "adamw"),
    "plain-2": ("plain", 2, ("speed",), "sgd"),
    "wide_jelly-2": ("wide_jelly", 2, ("speed", "memory"), "adam"),
    "dominant-2": ("dominant", 2, ("speed", "memory"), "adam"),
    "vgg-conv-tp-4": ("vgg", 4, ("speed",), "adam", EXPERIMENTAL),
    "spikformer-heads-tp-2": ("spikformer", 2, ("speed",), "adam", EXPERIMENTAL),
}
_RESULTS = {}


def results(key):
    """(plan, estimate, measurement) of each plan of case ``key``; the first call measures every case of its
    world size (one spawn of ranks for them all)."""
    if key not in _RESULTS:
        world = CASES[key][1]
        setups = {k: _setup(*CASES[k]) for k in CASES if CASES[k][1] == world and k not in _RESULTS}
        for k, measured in _measure(setups).items():
            model, plans, run, x, y = setups[k]
            estimated = [estimate(model, p, example_input=x, labels=y, optimizer=CASES[k][3], hardware=CPU_SIDE)
                         for p in plans]
            _RESULTS[k] = list(zip(plans, estimated, measured))
    return _RESULTS[key]


def _rows(table):
    return sorted(tuple(r) for r in table[["mesh_dim", "kind", "phase", "count", "bytes"]].itertuples(index=False))


@pytest.mark.parametrize("key", list(CASES))
def test_sharded_bytes_and_collectives_are_exact(key):
    modes = set()
    for plan, est, meas in results(key):
        modes.add(plan.mode)
        for col in EXACT:
            assert list(est.per_rank[col]) == list(meas.per_rank[col]), (plan, col)
        assert meas.collectives_agree, f"{plan}: ranks issued different collectives"
        assert _rows(est.collectives) == _rows(meas.collectives), plan
    world = CASES[key][1]
    expected = {"none"} if world == 1 else {"dp", "fsdp2", "tp", "fsdp2_tp"} if world == 4 else {"dp", "fsdp2", "tp"}
    if "-tp-" in key:  # the experimental styles: TP plans only
        expected -= {"dp", "fsdp2"}
        assert all(any(s.startswith("conv") for s in p.tensor_parallel_plan.values()) for p, _, _ in results(key))
    if key == "padded-4":
        expected -= {"tp"}  # tp=4 does not divide the head's 10 rows
    assert modes == expected


@pytest.mark.parametrize("key", list(CASES))
def test_peak_within_tolerance(key):
    for plan, est, meas in results(key):
        err = compare_estimate(est, meas)["per_rank"]["peak_bytes_rel_err"]
        assert err.abs().max() <= PEAK_TOL, f"{plan}: peak errors per rank {list(err.round(3))}"


def test_fsdp2_peaks_follow_its_buffers():
    """FSDP2 on 2 ranks and FSDP2 x TP on 2 x 2, with and without resharding after forward: its
    all-gather outputs, unsharded parameters, reduce-scatter inputs and backward prefetch replayed
    on the profile run put the peak within 1 % on this all-steps model (whose measured peak does not
    vary between runs). (FSDP2 on 4 ranks with resharding is 6 % over: inside the 10 % above.)"""
    res = [r for key in ("mlp_all_steps-2", "mlp_all_steps-4") for r in results(key)
           if r[0].mode == "fsdp2" and r[0].dp_size == 2 or r[0].mode == "fsdp2_tp"]
    assert {(p.mode, p.memopt_level) for p, _, _ in res} == {(m, k) for m in ("fsdp2", "fsdp2_tp") for k in (0, 1)}
    for plan, est, meas in res:
        err = compare_estimate(est, meas)["per_rank"]["peak_bytes_rel_err"]
        assert err.abs().max() <= 0.01, f"{plan}: peak errors per rank {list(err.round(3))}"


@pytest.mark.parametrize("key", ["wide_jelly-2", "dominant-2"])
def test_fsdp2_peaks_with_one_dominant_weight(key):
    """Models outside the zoo whose FSDP2 units hold one or two very large weights: the replay
    frees the unsharded parameters before the reduce-scatter input (torch reshards first) and keeps
    the previous all-gather output until the copy-out ends, so every peak is within 5 % (it was
    one extra shard of the largest weight over, ~11 %)."""
    res = [r for r in results(key) if r[0].uses_fsdp]
    assert {p.memopt_level for p, _, _ in res} == {0, 1}
    for plan, est, meas in res:
        err = compare_estimate(est, meas)["per_rank"]["peak_bytes_rel_err"]
        assert err.abs().max() <= 0.05, f"{plan}: peak errors per rank {list(err.round(3))}"


@pytest.mark.parametrize("key", ["mlp-2", "vgg-2"])
def test_plans_ordered_by_peak_alike(key):
    res = [r for r in results(key) if r[0].objective == "speed"]  # memopt 0/1 differ by ~1 %: not an order
    by_est = sorted(range(len(res)), key=lambda i: res[i][1].peak_bytes)
    by_meas = sorted(range(len(res)), key=lambda i: res[i][2].peak_bytes)
    assert by_est == by_meas, [(str(p), e.peak_bytes, m.peak_bytes) for p, e, m in res]


def test_padding_and_uneven_optimizer_state_are_measured():
    fsdp = next((e, m) for p, e, m in results("padded-4") if p.mode == "fsdp2")
    est, meas = fsdp
    opt = list(meas.per_rank["optimizer_bytes"])
    assert opt[3] < opt[0], "rank 3 holds fewer real rows of the padded head"
    assert len(set(meas.per_rank["params_bytes"])) == 1, "padded storage is the same on every rank"


def test_recorder_agrees_with_comm_debug_mode():
    for plan, est, meas in results("plain-2"):
        assert meas.comm_debug_counts is not None, plan
        recorded = meas.collectives.groupby("kind")["count"].sum().to_dict()
        debug = {k: v for k, v in meas.comm_debug_counts.items() if v}
        names = {"all_reduce": "all_reduce", "allreduce_": "all_reduce", "broadcast_": "broadcast",
                 "all_gather_into_tensor": "all_gather", "_allgather_base_": "all_gather",
                 "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter"}
        mapped = {}
        for k, v in debug.items():
            mapped[names.get(k, k)] = mapped.get(names.get(k, k), 0) + v
        assert mapped == recorded, (plan, debug, recorded)


def test_measured_step_time_lines_up_with_the_estimate_column_for_column():
    import math

    for plan, est, meas in results("mlp-2"):
        timing = compare_estimate(est, meas)["time"]
        assert list(timing["step_s_meas"]) == pytest.approx(meas.step_time_s) and (timing["step_s_meas"] > 0).all()
        assert (timing["step_s_est"] >= timing["compute_s_est"]).all()
        for row in meas.time.itertuples():
            if plan.uses_ddp or plan.uses_fsdp:  # their waits are outside the recorder: not split
                assert math.isnan(row.exposed_comm_s), plan
            else:  # TP: the blocked time in its functional collectives, the rest is compute
                assert 0 < row.exposed_comm_s <= row.step_s and row.compute_s + row.exposed_comm_s == pytest.approx(row.step_s)
