"""estimate/: enumeration, table shapes, the per-step TP factor T, and estimation speed (no ranks)."""

import dataclasses

import pytest
import torch

import snn_explorer as se
from snn_explorer.estimator import (
    COLLECTIVE_COLUMNS,
    PER_RANK_COLUMNS,
    enumerate_plans,
    estimate,
    estimate_all,
    model_profile,
)
from snn_explorer.estimator.profile.profiling import FIT_BATCHES, FIT_STEPS, Fit
from snn_explorer.zoo import SpikingMLP, build


def _plans(zoo, world, **kw):
    analysis = se.analyze(zoo.model, model_family=zoo.family)
    return enumerate_plans(analysis, world_size=world, batch_size=zoo.batch_size, **kw)


def test_enumerate_covers_modes_factorisations_and_zero():
    zoo = build("mlp")
    plans = _plans(zoo, 8, objective="memory")
    labels = {(p.mode, p.optimizer_strategy, p.mesh_shape) for p in plans}
    assert labels == {("dp", "none", (8,)), ("dp", "zero", (8,)), ("fsdp2", "none", (8,)), ("tp", "none", (8,)),
                      ("fsdp2_tp", "none", (4, 2)), ("fsdp2_tp", "none", (2, 4))}
    assert all(p.memopt_level == 1 for p in plans)
    for p in plans:
        se.preflight(zoo.model, p)
    assert [(p.mode, p.world_size) for p in _plans(zoo, 1)] == [("none", 1)]


def test_enumerate_leaves_out_infeasible_with_reasons():
    model = SpikingMLP(in_features=16, hidden=(32, 32), num_classes=10)
    analysis = se.analyze(model)
    plans = enumerate_plans(analysis, world_size=4, batch_size=8,
                            features=se.DistributedFeatureSet(allow_zero_optimizer=False))
    assert {p.mode for p in plans} == {"dp", "fsdp2", "fsdp2_tp"}
    assert all(p.optimizer_strategy == "none" for p in plans)
    assert "tp=4 does not divide net.4.out_features=10" in plans.infeasible["tp tp=4"]
    assert "allow_zero_optimizer=False" in plans.infeasible["dp+zero dp=4"]
    assert "divisible by dp=4" in enumerate_plans(analysis, world_size=4, batch_size=6).infeasible["dp dp=4"]


def test_fit_is_exact_on_bilinear_values():
    f = lambda n, t: 7 + 3 * n + 5 * t + 11 * n * t
    fit = Fit.of(*(f(n, t) for t in FIT_STEPS for n in FIT_BATCHES))
    assert fit(16, 25) == pytest.approx(f(16, 25))


def test_tables_have_the_issue_columns_and_a_verdict():
    zoo = build("mlp")
    plan = _plans(zoo, 2)[0]
    est = estimate(zoo.model, plan, example_input=zoo.example_input, labels=zoo.labels)
    assert tuple(est.per_rank.columns) == PER_RANK_COLUMNS and list(est.per_rank["rank"]) == [0, 1]
    assert tuple(est.collectives.columns) == COLLECTIVE_COLUMNS + ("algorithm", "wire_bytes")
    assert est.summary()["batch_per_rank"] == zoo.batch_size // 2
    fits = estimate(zoo.model, plan, example_input=zoo.example_input, memory_budget=10 * 2 ** 20, labels=zoo.labels)
    tight = estimate(zoo.model, plan, example_input=zoo.example_input, memory_budget=1000, labels=zoo.labels)
    assert fits.verdict.startswith("fits") and tight.verdict.startswith("does not fit")


def test_per_step_tp_issues_t_times_the_collectives_of_all_steps():
    counts = {}
    for name in ("mlp", "mlp_all_steps"):
        zoo = build(name)
        plan = next(p for p in _plans(zoo, 2) if p.mode == "tp")
        coll = estimate(zoo.model, plan, example_input=zoo.example_input, labels=zoo.labels).collectives
        counts[name] = coll.set_index(["kind", "phase"])
    assert (counts["mlp"]["count"] == zoo.time_steps * counts["mlp_all_steps"]["count"]).all()
    assert (counts["mlp"]["bytes"] == counts["mlp_all_steps"]["bytes"]).all()


def test_time_steps_and_batch_scale_activations_and_state():
    zoo = build("mlp_all_steps")
    plan = _plans(zoo, 2)[0]
    a = estimate(zoo.model, plan, example_input=zoo.example_input, labels=zoo.labels).per_rank.iloc[0]
    b = estimate(zoo.model, plan, example_input=zoo.example_input, labels=zoo.labels, time_steps=16).per_rank.iloc[0]
    assert b.activations_bytes > 1.9 * a.activations_bytes and b.neuron_state_bytes == a.neuron_state_bytes
    assert b.params_bytes == a.params_bytes


def test_estimates_reuse_one_run_per_batch_and_layout(monkeypatch):
    """Every plan of 8 ranks for a ~120-module model: the profile's peak runs are one per distinct
    per-rank batch and TP layout (FSDP2 plans replay the same run, whatever their dp and
    resharding), and estimating them all again runs the model not at all. The time this takes is
    in ``benchmarks/estimator_accuracy.py --speed``."""
    from snn_explorer.estimator.profile import profile_runs
    from snn_explorer.estimator.profile import profiling as profile_mod

    model = SpikingMLP(in_features=64, hidden=(64,) * 40, num_classes=8, stepping="all_steps")
    assert 115 <= sum(1 for _ in model.modules()) <= 130
    x = torch.rand(4, 16, 64)
    plans = [p for obj in ("speed", "memory") for p in enumerate_plans(se.analyze(model), world_size=8, batch_size=16,
                                                                       objective=obj)]
    assert {p.mode for p in plans} == {"dp", "fsdp2", "tp", "fsdp2_tp", "pp", "pp_tp", "pp_fsdp2", "pp_fsdp2_tp"}
    assert len({p.memopt_level for p in plans}) == 2
    runs = []
    real = profile_mod.run_point
    counted = lambda *a, **k: runs.append(k.get("saved_only", True)) or real(*a, **k)  # noqa: E731
    monkeypatch.setattr(profile_mod, "run_point", counted)
    monkeypatch.setattr(profile_runs, "run_point", counted)
    # the operator-count model's runs (a CPU-device profile; a GPU profile traces the step on meta instead)
    cpu_side = dataclasses.replace(se.hardware_profile("A100-SXM-80GB"), device="cpu", kernel_model=False)
    estimate(model, plans[0], example_input=x, hardware=cpu_side)
    runs.clear()
    table = estimate_all(model, plans, example_input=x, hardware=cpu_side)
    layouts = {(p.per_rank_batch, tuple(sorted(p.tensor_parallel_plan.items())) if p.tp_size > 1 else ())
               for p in plans if not p.uses_pp}  # a pipeline's estimate reads the profile's fits only
    assert len(table) == len(plans) and runs.count(False) == len(layouts) - 1  # plans[0]'s was run before
    runs.clear()
    estimate_all(model, plans, example_input=x, hardware=cpu_side)
    assert runs == []
    assert model_profile(model, x) is model_profile(model, x)


def test_unknown_tp_styles_are_refused_clearly():
    from snn_explorer.estimator.profile.tp_replica import tp_replica

    zoo = build("mlp")
    with pytest.raises(NotImplementedError, match="'diagonal'"):
        tp_replica(zoo.model, {"net.0": "diagonal"}, 2)


def test_measure_device_is_checked_before_any_rank_starts():
    from snn_explorer.estimator import measure

    zoo = build("mlp")
    plan = _plans(zoo, 2)[0]
    with pytest.raises(ValueError, match=r"device='tpu'; expected 'cpu' \(gloo ranks\) or 'cuda'"):
        measure(zoo.model, plan, example_input=zoo.example_input, device="tpu")
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match=r"device='cuda' needs one GPU per rank: 2 ranks, \d GPU\(s\) visible"):
            measure(zoo.model, plan, example_input=zoo.example_input, device="cuda")


def test_fsdp2_replay_recovers_the_meters_peaks_and_frees_every_buffer():
    """The logged run gives back a plain StorageMeter's forward and backward peaks exactly; replayed
    for FSDP2 (dp=2, with and without resharding) every buffer FSDP2 allocates is gone after the
    backward, which leaves the run's bytes minus the unsharded gradients plus the sharded ones, and
    resharding after forward lowers the forward's peak."""
    from snn_explorer.core.model import fsdp_units
    from snn_explorer.estimator.instruments.meter import StorageMeter
    from snn_explorer.estimator.memory.fsdp_timeline import FsdpTimeline, replay_fsdp
    from snn_explorer.estimator.memory.sharding import local_params
    from snn_explorer.estimator.profile.profile_runs import run_point as _run_point
    from snn_explorer.estimator.profile.profiling import trainable_shapes
    from snn_explorer.estimator.profile.step import forward_loss

    zoo = build("mlp_all_steps")
    model, x, y = zoo.model, zoo.example_input[:, :4], zoo.labels[:4]
    forward_loss(model, x, y).backward()  # warm: the neuron state takes its size
    model.zero_grad(set_to_none=True)
    meter = StorageMeter()
    meter.track(list(model.parameters()) + list(model.buffers()) + [x])
    with meter:
        entry = meter.current
        loss = forward_loss(model, x, y)
        fwd = meter.restart_peak() - entry
        loss.backward()
        del loss
        after = meter.current - entry
    bwd = meter.peak - entry
    model.zero_grad(set_to_none=True)
    units = fsdp_units(model)
    assert len(units) == 3
    run = _run_point(model, x, y, saved_only=False, units=units)
    assert replay_fsdp(run["log"], run["entry"])[:3] == (fwd, bwd, after)
    assert fwd > 0 and bwd > fwd and after >= run["grads"] > 0

    plan = se.plan(analysis=se.analyze(model), objective="memory", neuron_backend="torch", mode="fsdp2",
                   topology={"dp": 2}, batch_size=8)
    params = local_params(trainable_shapes(model), plan, 4)
    peaks = {}
    for reshard in (False, True):
        timeline = FsdpTimeline.of(params, 2, reshard)
        shards = sum(u.shard for u in timeline.units)
        f, b, a, held = replay_fsdp(run["log"], run["entry"], timeline)
        assert a == after - run["grads"] + shards
        assert held >= max(u.unsharded + u.flat for u in timeline.units)
        peaks[reshard] = f
    assert peaks[True] < peaks[False]


def test_work_counter_bytes_match_pytree_flattening_of_every_operator():
    """The step-time counter's own flattening counts the same bytes as torch's pytree on a real step."""
    from snn_explorer.compat import tree_leaves
    from snn_explorer.estimator.instruments import op_counter

    seen = []

    class Both(op_counter.OpCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            mine = op_counter.tensor_bytes((args, kwargs or {}, out))
            ref = sum(v.numel() * v.element_size() for v in tree_leaves((args, kwargs or {}, out))
                      if isinstance(v, torch.Tensor))
            seen.append((func, mine, ref))
            return out

    zoo = build("spikformer")
    with Both():
        zoo.model(zoo.example_input).sum().backward()
    assert len(seen) > 100 and sum(m for _, m, _ in seen) > 0
    assert [(f, m) for f, m, r in seen if m != r] == []
