"""Step time: hardware profiles, the alpha-beta calibration, the compute roofline and the overlap rules.
(The tests on gloo ranks: tests/ranks/test_step_time_ranks.py.)"""
import dataclasses
import math

import pandas as pd
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import snn_explorer as se
from snn_explorer.core.common import SNNDistributedTopology
from snn_explorer.estimator import enumerate_plans, estimate
from snn_explorer.estimator.calibration.fit import MIN_BETA, fit_alpha_beta, median_profile, profile_from
from snn_explorer.estimator.calibration.probes import SIZES_BYTES
from snn_explorer.estimator.profile.step import batch_slice, forward_loss
from snn_explorer.estimator.profile.tp_replica import tp_replica
from snn_explorer.estimator.timing.hardware import KINDS, HardwareProfile, link_table, ring_fraction, ring_steps
from snn_explorer.estimator.timing.step_time import exposed_comm_s
from snn_explorer.zoo import SpikingMLP, build

FLOPS = 1e9


def flops_only(device: str = "cpu", **kw) -> HardwareProfile:
    """Compute is FLOPs / 1 GFLOP/s exactly: no operator cost, unlimited bandwidth."""
    return HardwareProfile(name="flops only", device=device, flops_per_s=FLOPS, bytes_per_s=1e30, op_overhead_s=0.0,
                           collectives=link_table(1e-5, 1e9), source="synthetic", **kw)


def test_alpha_beta_fit_recovers_known_latencies():
    sizes = [4e3, 2.5e5, 1e6, 4e6]
    alpha, beta = 3e-4, 2e-9
    assert fit_alpha_beta(sizes, [alpha + beta * s for s in sizes]) == pytest.approx((alpha, beta), rel=1e-9)
    noisy = [(alpha + beta * s) * f for s, f in zip(sizes, (1.02, 0.98, 1.01, 0.99))]
    a, b = fit_alpha_beta(sizes, noisy)
    assert a == pytest.approx(alpha, rel=0.2) and b == pytest.approx(beta, rel=0.05)
    flat = fit_alpha_beta(sizes, [1.1e-3, 1.0e-3, 0.95e-3, 0.9e-3])  # latency-bound, slope lost in noise
    assert flat == (pytest.approx(0.9e-3), MIN_BETA)


def test_calibration_turns_rank_timings_into_the_known_alpha_beta_per_kind_and_group_size():
    truth = {(k, p): (1e-4 * (i + 1) * p, 1e-9 * (i + 2) / p) for i, k in enumerate(KINDS) for p in (2, 4)}

    def rank_value(p, rank, slow):  # what _calibrate_on_rank returns in a world of p; rank 1 is the slowest
        coll = {(k, s): [slow * (a + b * s)] * 5 for (k, q), (a, b) in truth.items() if q == p for s in SIZES_BYTES}
        return {"alone": dict(flops=2e10, bandwidth=5e9, overhead=2e-6, step=1e-3) if (p, rank) == (2, 0) else None,
                "shared": 1e-3 * p / 2 * slow, "collectives": coll}

    runs = {p: [rank_value(p, r, 1.5 if r == 1 else 1.0) for r in range(p)] for p in (2, 4)}
    hw = profile_from(runs, "gloo", None)
    assert profile_from(runs, "gloo", None, reference_step=0.5e-3).compute_sharing == pytest.approx({2: 3.0, 4: 6.0})
    for (kind, p), (a, b) in truth.items():
        assert hw.collectives[kind][p] == pytest.approx((1.5 * a, 1.5 * b), rel=1e-6)
    assert hw.compute_sharing == pytest.approx({2: 1.5, 4: 3.0})
    assert (hw.flops_per_s, hw.bytes_per_s, hw.op_overhead_s) == (2e10, 5e9, 2e-6)
    assert hw.source.startswith("calibrated on ") and hw.device == "cpu"


def test_calibrations_in_several_worlds_give_the_median_of_every_figure():
    """Three worlds, each slow in another figure: the profile takes each figure's median, so no
    world's outlier (a latency several times the others) reaches it."""
    def profile(alpha, sharing, tp_cost, flops):
        return HardwareProfile(name="w", device="cpu", flops_per_s=flops, bytes_per_s=1e9, op_overhead_s=1e-6,
                               collectives=link_table(alpha, 1e9), compute_sharing={2: sharing},
                               framework_overhead={2: {"tp_module": tp_cost}}, source="calibrated on h")

    worlds = [profile(1e-4, 1.0, 9e-3, 1e9), profile(8e-4, 1.2, 1e-3, 3e9), profile(2e-4, 5.0, 2e-3, 2e9)]
    med = median_profile(worlds)
    assert med.collective_time("all_reduce", 2, 0) == worlds[2].collective_time("all_reduce", 2, 0)
    assert med.compute_sharing == {2: 1.2} and med.overhead("tp_module", 2) == 2e-3 and med.flops_per_s == 2e9
    assert med.source == "calibrated on h, median of 3 worlds per size"
    assert median_profile(worlds[:1]) is worlds[0]
    with pytest.raises(ValueError, match=r"worlds=0 must be a positive int \(fresh worlds per group size\)"):
        se.calibrate(worlds=0)


def test_wrapper_costs_are_what_the_wrapped_step_takes_beyond_the_plain_one_and_its_collectives(mlp):
    from snn_explorer.estimator.calibration.fit import wrapper_costs
    from snn_explorer.estimator.timing.step_time import framework_s

    table = {k: (1e-4, 1e-9) for k in KINDS}  # every collective: 100 us + 1 ns per byte
    made = {"tp": [("all_reduce", 8192)] * 8, "fsdp": [("all_gather", 4096), ("reduce_scatter", 4096)] * 10,
            "ddp": [("all_reduce", 50_000)], "zero": [("broadcast", 1000)] * 6}
    comm = {name: sum(1e-4 + 1e-9 * n for _, n in rows) for name, rows in made.items()}
    framework = dict(plain=1e-3, tp=1e-3 + comm["tp"] + 16 * 4e-4, fsdp=1e-3 + comm["fsdp"] + 20 * 3e-4,
                     ddp=1e-3 + comm["ddp"] + 2e-3, adam=2e-4, zero=2e-4 + comm["zero"] + 7e-4,
                     collectives=made, tp_calls=16)
    slower = dict(framework, tp=framework["tp"] + 16e-4)  # the slowest rank's time counts
    costs = wrapper_costs([{"framework": framework}, {"framework": slower}], table)
    assert costs == pytest.approx(dict(tp_module=5e-4, fsdp_collective=3e-4, ddp_step=2e-3, zero_step=7e-4))
    assert wrapper_costs([{"framework": dict(framework, ddp=1e-3)}], table)["ddp_step"] == 0.0  # never negative
    # broadcasts timed in bursts of 8 at 40 us each (+ 1 KiB at 1 ns per byte): ZeRO's 6 are priced so
    from snn_explorer.estimator.calibration.probes import BURST
    burst = [BURST * (4e-5 + 1024e-9)] * 5
    zero = dict(framework, zero=2e-4 + sum(4e-5 + 1e-9 * n for _, n in made["zero"]) + 7e-4, broadcast_burst=burst)
    with_burst = wrapper_costs([{"framework": zero}], table)
    assert with_burst["broadcast_in_burst"] == pytest.approx(4e-5) and with_burst["zero_step"] == pytest.approx(7e-4)
    # the pipeline probes, 2 ranks under 1F1B, 2 micro-batches, blocks of 1 ms forward and 2 ms backward
    # (rank 0's heavy ones 3 and 6 ms), transfers of L = 100 us + 1000 ns, the loss broadcast 0.1 ms.
    # With rank 0 heavy its step took 25 ms: beyond its 4 actions' 18 ms of compute, the broadcast and
    # 4.9 ms of waits, 0.5 ms per action. By hand the replay of the probe with every block alike,
    # actions of 1.5 and 2.5 ms and transfers of L' each is 3 x 1.5 + 3 x 2.5 + 2 L' = 12 + 2 L' ms:
    # its step of 12.902 ms means L' = 0.401 ms, 0.3 ms beyond the fitted send
    from snn_explorer.core.planning import SCHEDULES
    from snn_explorer.estimator.calibration.probes import PIPELINE_HEAVY
    from snn_explorer.estimator.calibration.step_probes import probe_pipeline

    blocks = dict(light_F=1e-3, light_B=2e-3, heavy_F=3e-3, heavy_B=6e-3, bytes=1000)
    heavy_plan, even_plan = (probe_pipeline(2, SCHEDULES["1f1b"], h)[1] for h in (PIPELINE_HEAVY, 1))
    assert heavy_plan.pp_microbatches == even_plan.pp_microbatches == 2
    probes = [[dict(blocks, step=25e-3, waited=waited, plan=heavy_plan, heavy=PIPELINE_HEAVY),
               dict(blocks, step=12.902e-3, waited=1e-3, plan=even_plan, heavy=1)] for waited in (4.9e-3, 9e-3)]
    with_pp = wrapper_costs([{"framework": dict(framework, pipeline={"1f1b": r})} for r in probes], table)
    assert with_pp["pp_action:1f1b"] == pytest.approx(5e-4) and with_pp["pp_link:1f1b"] == pytest.approx(3e-4)
    zoo, plans = mlp
    hw = dataclasses.replace(flops_only(), framework_overhead={2: costs})
    no_collectives = pd.DataFrame(columns=["mesh_dim", "kind", "phase", "count", "bytes"])
    ddp_plan, zero_plan = (dataclasses.replace(plans["dp"], optimizer_strategy=s) for s in ("none", "zero"))
    assert framework_s(ddp_plan, None, no_collectives, hw, 8) == pytest.approx(2e-3)  # DDP's per step
    assert framework_s(zero_plan, None, no_collectives, hw, 8) == pytest.approx(2e-3 + 7e-4)
    one = dataclasses.replace(ddp_plan, topology=SNNDistributedTopology({"dp": 1}))
    assert one.dp_size == 1 and framework_s(one, None, no_collectives, hw, 8) == 0.0  # no wrapper on one rank


def test_cpu_ranks_sharing_a_host_pay_the_costs_of_the_world_they_share_it_with():
    """A CPU profile calibrated at 2 and 4 ranks: a 2-rank group of a 4-rank plan pays the 4-rank
    world's latency (ring-scaled to 2 ranks) and wrapper costs; a GPU profile is unchanged."""
    tables = {k: {2: (1e-4, 1e-9), 4: (3e-3, 2e-9)} for k in KINDS}
    cpu = HardwareProfile(name="cpu", device="cpu", flops_per_s=1e9, bytes_per_s=1e9, op_overhead_s=0.0,
                          collectives=tables, framework_overhead={2: {"tp_module": 1e-4}, 4: {"tp_module": 9e-4}},
                          source="synthetic")
    seen = cpu.seen_by(4)
    for kind in KINDS:
        alpha4, beta4 = tables[kind][4]
        expect = alpha4 * ring_steps(kind, 2) / ring_steps(kind, 4) + 1e6 * beta4 * ring_fraction(kind, 2) / ring_fraction(kind, 4)
        assert seen.collective_time(kind, 2, 1e6) == pytest.approx(expect)
        assert cpu.collective_time(kind, 2, 1e6) == pytest.approx(1e-4 + 1e-3)
    assert seen.overhead("tp_module", 2) == 9e-4 and cpu.overhead("tp_module", 2) == 1e-4
    two = cpu.seen_by(2)  # a 2-rank plan: the 2-rank world's own figures
    assert two.collective_time("all_reduce", 2, 1e6) == cpu.collective_time("all_reduce", 2, 1e6)
    assert two.overhead("tp_module", 2) == 1e-4 and cpu.seen_by(3) is cpu  # no 3-rank world calibrated
    gpu = dataclasses.replace(cpu, device="cuda")
    assert gpu.seen_by(4) is gpu and gpu.overlaps_comm and not cpu.overlaps_comm


def test_builtin_profiles_are_datasheet_labelled_and_checked():
    profiles = se.hardware_profiles()
    assert {"A100-SXM-80GB", "H100-SXM", "H200-SXM", "RTX-4090", "2x8-A100-SXM-80GB", "8x8-H100-SXM"} <= set(profiles)
    for name, hw in profiles.items():
        assert hw.source == "datasheet and documented measurements" and HardwareProfile.from_dict(hw.to_dict()) == hw
    a100 = se.hardware_profile("A100-SXM-80GB")  # efficiency 1: its rates are the achieved ones, with sources
    assert a100.with_efficiency(0.3).flops() == pytest.approx(a100.flops() * 0.3)
    with pytest.raises(ValueError, match="no built-in hardware profile 'B200'"):
        se.hardware_profile("B200")
    with pytest.raises(ValueError, match=r"efficiency=0; expected a fraction"):
        a100.with_efficiency(0)
    with pytest.raises(ValueError, match="no timings for"):
        HardwareProfile(name="x", device="cpu", flops_per_s=1, bytes_per_s=1, op_overhead_s=0,
                        collectives={"all_reduce": {2: (0, 1e-9)}})
    with pytest.raises(TypeError, match="hardware must be a HardwareProfile"):
        zoo = build("mlp")
        plan = enumerate_plans(se.analyze(zoo.model), world_size=1, batch_size=zoo.batch_size)[0]
        estimate(zoo.model, plan, example_input=zoo.example_input, hardware=3)


def test_group_sizes_not_calibrated_follow_the_ring_and_tree_formulas():
    hw = flops_only()
    for kind in KINDS:
        alpha, beta = hw.collectives[kind][2]
        expect = alpha * ring_steps(kind, 8) / ring_steps(kind, 2) + 1e6 * beta * ring_fraction(kind, 8) / ring_fraction(kind, 2)
        assert hw.collective_time(kind, 8, 1e6) == pytest.approx(expect)
    assert ring_steps("all_reduce", 1024) == 20 and ring_steps("all_gather", 1024) == 1023
    nodes = se.hardware_profile("2x8-H100-SXM")
    assert nodes.collective_time("all_reduce", 16, 1e8, spans_nodes=True) > nodes.collective_time("all_reduce", 16, 1e8)


@pytest.fixture(scope="module")
def mlp():
    zoo = build("mlp")
    return zoo, {p.mode: p for p in enumerate_plans(se.analyze(zoo.model, model_family=zoo.family), world_size=2,
                                                    batch_size=zoo.batch_size)}


def test_tp_wrapper_cost_is_paid_per_call_of_a_wrapped_module_not_of_a_neuron_on_its_shard(mlp):
    """The zoo MLP's TP plan wraps its three Linears (each called once per time step) and leaves the
    neuron between them ('local') as it is: the calibrated DTensor cost is paid 3 x T times a step."""
    zoo, plans = mlp
    tp = plans["tp"]
    assert sorted(tp.tensor_parallel_plan.values()) == ["colwise", "colwise_gather", "local", "rowwise"]
    t = zoo.example_input.shape[0]
    with_cost = dataclasses.replace(flops_only(), framework_overhead={2: {"tp_module": 1e-3}})
    extra = _compute(zoo, tp, hardware=with_cost) - _compute(zoo, tp)
    assert extra == pytest.approx(3 * t * 1e-3)


def _compute(zoo, plan, hardware=None, **kw):
    return estimate(zoo.model, plan, example_input=zoo.example_input, labels=zoo.labels,
                    hardware=hardware or flops_only(), **kw).time["compute_s"].iloc[0]


def _step_flops(model, zoo, n, t):
    x, y = batch_slice(zoo.example_input, zoo.labels, n, t)
    with FlopCounterMode(display=False) as counter:
        forward_loss(model, x, y).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def test_compute_time_scales_with_batch_time_steps_and_tp_shards(mlp):
    zoo, plans = mlp
    single = enumerate_plans(se.analyze(zoo.model), world_size=1, batch_size=zoo.batch_size)[0]
    full = _compute(zoo, single)
    t = zoo.example_input.shape[0]
    assert full == pytest.approx(_step_flops(zoo.model, zoo, zoo.batch_size, t) / FLOPS, rel=1e-6)  # torch's count
    assert _compute(zoo, plans["dp"]) == pytest.approx(full / 2, rel=1e-6)  # half the batch per rank
    assert _compute(zoo, single, time_steps=2 * t) == pytest.approx(2 * full, rel=1e-6)
    tp = plans["tp"]
    replica = tp_replica(zoo.model, dict(tp.tensor_parallel_plan), tp.tp_size)
    sharded = _step_flops(replica, zoo, tp.per_rank_batch, t) / FLOPS
    assert _compute(zoo, tp) == pytest.approx(sharded, rel=1e-6)
    assert sharded == pytest.approx(full / tp.tp_size)  # every Linear of this MLP is sharded


def test_overlap_never_makes_a_step_faster_than_its_compute(mlp):
    zoo, plans = mlp
    slow_net = HardwareProfile(name="slow net", device="cpu", flops_per_s=1e9, bytes_per_s=1e9, op_overhead_s=1e-5,
                               collectives=link_table(1e-3, 1e6), source="synthetic")
    for hw in (flops_only(), flops_only("cuda"), slow_net, dataclasses.replace(slow_net, device="cuda"),
               se.hardware_profile("8x8-H100-SXM")):
        for plan in plans.values():
            est = estimate(zoo.model, plan, example_input=zoo.example_input, labels=zoo.labels, hardware=hw)
            row = est.time.iloc[0]
            raw = sum(hw.collective_time(r.kind, plan.tp_size if r.mesh_dim == "tp" else plan.dp_size, r.bytes, r.count)
                      for r in est.collectives.itertuples())
            assert row.step_s >= row.compute_s > 0 and row.bubble_s == 0
            assert 0 <= row.exposed_comm_s <= raw + 1e-12
            assert est.step_time_s == pytest.approx(row.step_s)
            assert est.samples_per_s == pytest.approx(zoo.batch_size / row.step_s)
            if plan.uses_tp:
                assert row.exposed_comm_s == pytest.approx(raw)  # TP's collectives are on the critical path


def test_ddp_hides_all_but_one_bucket_behind_a_long_backward_and_fsdp_its_prefetched_gathers():
    hw = flops_only(device="cuda")
    plan = type("P", (), dict(dp_size=4, tp_size=1, uses_zero=False))()
    table = pd.DataFrame([dict(mesh_dim="dp", kind="all_reduce", phase="backward", count=4, bytes=4e6)])
    total = hw.collective_time("all_reduce", 4, 4e6, 4)
    assert exposed_comm_s(plan, table, hw, {"forward": 1, "backward": 100}) == pytest.approx(total / 4)
    assert exposed_comm_s(plan, table, hw, {"forward": 1, "backward": 0}) == pytest.approx(total)
    fsdp = pd.DataFrame([dict(mesh_dim="dp", kind="all_gather", phase="forward", count=5, bytes=5e6)])
    gathers = hw.collective_time("all_gather", 4, 5e6, 5)
    assert exposed_comm_s(plan, fsdp, hw, {"forward": 100, "backward": 1}) == pytest.approx(gathers / 5)


def test_every_plan_of_1024_ranks_is_valid_and_timed():
    model = SpikingMLP(in_features=16, hidden=(16, 16, 16), num_classes=8, stepping="all_steps")
    x = torch.rand(2, 8, 16)
    analysis = se.analyze(model)
    plans = enumerate_plans(analysis, world_size=1024, batch_size=1024)
    assert {p.mode for p in plans} >= {"dp", "fsdp2", "fsdp2_tp"} and all(p.world_size == 1024 for p in plans)
    hw = se.hardware_profile("8x8-H100-SXM")
    for plan in plans:
        se.preflight(model, plan)
        assert se.SNNDistributedPlan.from_dict(plan.to_dict()) == plan
        est = estimate(model, plan, example_input=x, hardware=hw)
        assert len(est.time) == 1024 and math.isfinite(est.step_time_s)
        assert (est.time["step_s"] >= est.time["compute_s"]).all()


def test_work_count_does_not_depend_on_what_ran_before_and_the_profile_runs_count_the_same():
    """The step's operator count is taken in the state of a training step (neuron state of this
    batch size, gradients None): a run at another batch size that leaves gradients and neuron state
    behind changes nothing, and the count the profile runs took equals a count of its own."""
    from snn_explorer.estimator import model_profile
    from snn_explorer.estimator.instruments.isolation import one_thread
    from snn_explorer.estimator.timing.compute_work import count_work, rank_work

    zoo = build("spikformer")
    profile = model_profile(zoo.model, zoo.example_input, zoo.labels)
    with one_thread():  # as estimate() counts
        first = count_work(profile.model, profile, "adam")
        assert first.forward.ops(1, 4) > 100 and first.backward.flops(1, 4) > 0 and first.optimizer.ops(1, 1) > 0
        forward_loss(profile.model, *batch_slice(zoo.example_input, zoo.labels, 1, 4)).backward()  # state, grads
        assert any(p.grad is not None for p in profile.model.parameters())
        assert count_work(profile.model, profile, "adam") == first
        assert len(profile.step_counts) == 4 and rank_work(profile, None, 1, "adam") == first


@pytest.mark.parametrize("optimizer", ["adam", "sgd_momentum"])
def test_optimizer_count_on_zero_gradients_is_that_of_a_step_after_a_real_backward(optimizer):
    """The optimizer's second step counted on zero gradients of the parameters a backward reaches
    equals the second step counted after real backwards (operators and bytes follow shapes only)."""
    from snn_explorer.estimator.instruments.op_counter import OpCounter, grad_names
    from snn_explorer.estimator.profile.step import OPTIMIZERS
    from snn_explorer.estimator.timing.compute_work import optimizer_work

    zoo = build("mlp")
    model = zoo.model
    model.net[4].weight.requires_grad_(False)  # a frozen parameter: no gradient, not stepped
    opt = OPTIMIZERS[optimizer].make([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    for _ in range(2):
        forward_loss(model, zoo.example_input, zoo.labels).backward()
        if _ == 0:
            opt.step()
    with OpCounter() as real:
        opt.step()
    names = grad_names(model)
    assert "net.4.weight" not in names and len(names) == sum(p.requires_grad for p in model.parameters())
    model.zero_grad(set_to_none=True)
    counted = optimizer_work(model, names, optimizer)
    assert real.counts[3] > 10 and [f.c0 for f in (counted.flops, counted.flop_bytes, counted.other_bytes,
                                                   counted.ops)] == real.counts


def test_zero_broadcasts_are_priced_as_a_burst_where_one_was_calibrated():
    """ZeroRedundancyOptimizer issues its broadcasts back to back: each then costs the calibrated
    ``broadcast_in_burst`` instead of the alpha of one alone; bytes still cost beta each."""
    hw = dataclasses.replace(flops_only(), framework_overhead={2: {"broadcast_in_burst": 2e-5}})
    alpha, beta = hw.collectives["broadcast"][2]
    assert alpha != 2e-5
    assert hw.collective_time("broadcast", 2, 1e6, 10, burst=True) == pytest.approx(10 * 2e-5 + 1e6 * beta)
    assert hw.collective_time("broadcast", 2, 1e6, 10) == pytest.approx(10 * alpha + 1e6 * beta)
    assert flops_only().collective_time("broadcast", 2, 1e6, 10, burst=True) == pytest.approx(10 * alpha + 1e6 * beta)
    plan = type("P", (), dict(dp_size=2, tp_size=1, uses_zero=True))()
    table = pd.DataFrame([dict(mesh_dim="dp", kind="broadcast", phase="optimizer", count=10, bytes=1e6)])
    assert exposed_comm_s(plan, table, hw, {"forward": 0, "backward": 0}) == pytest.approx(10 * 2e-5 + 1e6 * beta)


def test_nothing_overlaps_on_cpu_ranks():
    hw = flops_only()
    plan = type("P", (), dict(dp_size=4, tp_size=1, uses_zero=False))()
    table = pd.DataFrame([dict(mesh_dim="dp", kind="all_reduce", phase="backward", count=4, bytes=4e6),
                          dict(mesh_dim="dp", kind="all_gather", phase="forward", count=5, bytes=5e6)])
    total = hw.collective_time("all_reduce", 4, 4e6, 4) + hw.collective_time("all_gather", 4, 5e6, 5)
    assert exposed_comm_s(plan, table, hw, {"forward": 100, "backward": 100}) == pytest.approx(total)
