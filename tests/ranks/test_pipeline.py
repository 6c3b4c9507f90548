"""Pipeline parallelism (mode 'pp') on real gloo ranks equals one process, for every schedule.

One rank group per world size (2: pp=2; 4: pp=2 x dp=2) runs every schedule on every model for 3
Adam steps in float64 and returns everything; the tests below read those results from
module-scoped fixtures. The 2-rank group also runs 20 back-to-back pipelines (a hang would time
out the group). Each comparison first shows that it is not vacuous: spike rates 2-98 %, outputs
that vary, a loss that changes.
 (The tests in one process: tests/unit/test_pipeline_unit.py.)"""
import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_on_ranks
from torch import nn

STEPS = 3
TOL = 1e-5
BATCH = 8
SCHEDULES = ("gpipe", "1f1b", "interleaved", "interleaved_zb", "zbv")
MODELS = ("mlp_all_steps", "vgg", "jelly")
BACK_TO_BACK = 20
#: measure()d (model, schedule) cases by topology dims (pp; pp x dp); zbv: a V places one stage boundary
#: inside a rank
MEASURED = {1: tuple(("mlp_all_steps", s) for s in SCHEDULES) + (("jelly", "gpipe"),), 2: (("mlp_all_steps", "1f1b"),)}


def jelly_mlp() -> nn.Module:
    """A spikingjelly multi-step Sequential (LIF neurons with step_mode='m')."""
    from spikingjelly.activation_based import functional, layer, neuron

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = nn.Sequential(layer.Linear(16, 32), neuron.LIFNode(tau=2.0), layer.Linear(32, 32),
                            neuron.LIFNode(tau=2.0), layer.Linear(32, 8))
    functional.set_step_mode(net, "m")
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.Linear):
                m.weight.mul_(3.0)
                m.bias.fill_(0.3)
    return net


def virtual_stages(schedule):
    from snn_explorer.core.planning import schedule_of

    return 2 if schedule_of(schedule).multi_stage else 1


def build(name):
    """(model, inputs [T, N, ...], labels [N]) in float64, the same on every rank."""
    if name == "jelly":
        g = torch.Generator().manual_seed(5)
        x = torch.rand(6, BATCH, 16, generator=g, dtype=torch.float64) * 3
        return jelly_mlp().double(), x, torch.randint(0, 8, (BATCH,), generator=g)
    from snn_explorer.zoo import build as zoo_build

    zoo = zoo_build(name, batch_size=BATCH)
    return zoo.model.double(), zoo.example_input.double(), zoo.labels


def spike_rates(model):
    """Hooks recording the mean output of every stateful neuron."""
    from snn_explorer.core.model import is_stateful

    rates = {}

    def hook(name):
        return lambda _m, _i, out: rates.setdefault(name, []).append(float(out.detach().float().mean()))

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n and is_stateful(m)]
    return rates, handles


def reference(name, chunks=1):
    """The whole model in one process: per-step outputs and losses, last grads, params.

    ``chunks`` > 1 runs the batch as that many equal parts along the batch dim, each from reset
    state, with their gradients accumulated: what a pipeline computes for a model whose layers mix
    samples (BatchNorm normalises over each micro-batch). ``chunks=1`` is the plain whole batch.
    """
    from snn_explorer.core.model import reset_all

    model, x, y = build(name)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    rates, handles = spike_rates(model)
    outs, losses, grads = [], [], None
    for step in range(STEPS):
        optimizer.zero_grad()
        parts, loss = [], 0.0
        for xs, ys in zip(x.chunk(chunks, dim=1), y.chunk(chunks)):
            reset_all(model)
            out = model(xs)
            part = nn.functional.cross_entropy(out.mean(0), ys) / chunks
            part.backward()
            parts.append(out)
            loss = loss + part.detach()
        out = torch.cat(parts, dim=1)
        if step == STEPS - 1:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        outs.append(out.detach())
        losses.append(loss.detach())
    for h in handles:
        h.remove()
    return dict(outs=outs, losses=losses, grads=grads, params={n: p.detach().clone() for n, p in model.named_parameters()},
                rates={n: sum(v) / len(v) for n, v in rates.items()})


def pipelined(name, topology, schedule):
    """The same training through plan/apply/train_step with mode 'pp'."""
    import snn_explorer as se

    model, x, y = build(name)
    analysis = se.analyze(model)
    plan = se.plan(analysis=analysis, objective="capacity", topology=topology, batch_size=BATCH, mode="pp", options=se.PlanOptions(pp_schedule=schedule, pp_virtual_stages=virtual_stages(schedule), pp_microbatches=4))
    runtime = se.apply(model=model, plan=plan, device_type="cpu")
    share = plan.per_rank_batch
    x, y = x[:, runtime.dp_rank * share:(runtime.dp_rank + 1) * share], y[runtime.dp_rank * share:][:share]
    optimizer = runtime.build_optimizer(torch.optim.Adam, lr=1e-2)
    criterion = nn.CrossEntropyLoss()
    forwards = []  # the stage of each forward this rank runs, in order
    hooks = [s.register_forward_pre_hook(lambda m, _a: forwards.append(m.index)) for s in runtime.model.stages]
    outs, losses, grads = [], [], None
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = runtime.train_step(criterion, x, y)
        if step == STEPS - 1:
            grads = runtime.full_gradients()
        optimizer.step()
        outs.append(runtime.model.last_outputs)
        losses.append(loss)
    if plan.dp_size > 1:  # the global batch's outputs and loss: gathered / averaged over dp
        group = runtime.mesh.get_group("dp")
        losses = [_dp_mean(loss, group, plan.dp_size) for loss in losses]
        if runtime.model.holds_last:
            outs = [_dp_cat(out, group, plan.dp_size) for out in outs]
    resets = {s.index: s.resets for s in runtime.model.stages}
    for h in hooks:
        h.remove()
    try:
        runtime.forward_loss(criterion, x, y)
        forward_loss_error = None
    except RuntimeError as exc:
        forward_loss_error = str(exc)
    local_params = sum(p.numel() for p in runtime.model.parameters())
    on_meta = sum(p.numel() for p in model.parameters() if p.is_meta)
    return dict(outs=outs if runtime.model.holds_last else None, losses=losses, grads=grads,
                params=runtime.full_parameters(), resets=resets, plan=plan.to_dict(),
                local_params=local_params, on_meta=on_meta, forward_loss_error=forward_loss_error,
                forwards=forwards, pp_rank=runtime.model.pp_rank)


def _dp_mean(loss, group, size):
    loss = loss.clone()
    dist.all_reduce(loss, group=group)
    return loss / size


def _dp_cat(out, group, size):
    parts = [torch.empty_like(out) for _ in range(size)]
    dist.all_gather(parts, out.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def back_to_back(runs):
    """``runs`` fresh pipelines in a row, one step each, cycling through the schedules."""
    import snn_explorer as se

    done = []
    for i in range(runs):
        model, x, y = build("mlp_all_steps")
        schedule = SCHEDULES[i % len(SCHEDULES)]
        plan = se.plan(analysis=se.analyze(model), objective="capacity", topology={"pp": 2}, batch_size=BATCH,
                       mode="pp", options=se.PlanOptions(pp_schedule=schedule, pp_virtual_stages=virtual_stages(schedule)))
        runtime = se.apply(model=model, plan=plan, device_type="cpu")
        done.append(float(runtime.train_step(nn.CrossEntropyLoss(), x, y)))
    return done


def measured_plan(topology, name, schedule):
    """((model, inputs, labels), plan) of a measured case: the zoo's float32 model, or the float64 jelly."""
    import snn_explorer as se
    from snn_explorer.zoo import build as zoo_build

    if name == "jelly":
        case = build(name)
    else:
        zoo = zoo_build(name, batch_size=BATCH)
        case = (zoo.model, zoo.example_input, zoo.labels)
    plan = se.plan(analysis=se.analyze(case[0]), objective="capacity", topology=topology, batch_size=BATCH,
                   mode="pp", options=se.PlanOptions(pp_schedule=schedule, pp_microbatches=4, pp_virtual_stages=virtual_stages(schedule)))
    return case, plan


def measure_cases(topology):
    """measure()'s rank-side run (2 timed steps, then the measured one) of each MEASURED case, in order."""
    from snn_explorer.estimator.measurement.plan_measurement import measure_on_rank
    from snn_explorer.estimator.measurement.settings import measure_settings

    out = []
    for name in dict.fromkeys(n for n, _ in MEASURED[len(topology)]):
        model, x, y = measured_plan(topology, name, "gpipe")[0]
        plans = [measured_plan(topology, n, s)[1] for n, s in MEASURED[len(topology)] if n == name]
        out += measure_on_rank(model, plans, measure_settings(model, plans, x, y, 2, "adam", None, 1e-3, "cpu"))
    return out


def rank_group(topology, runs):
    """Every (model, schedule) on this rank group, the references on rank 0, then ``runs`` back-to-back runs."""
    results = {(name, schedule): pipelined(name, topology, schedule) for name in MODELS for schedule in SCHEDULES}
    dp = topology.get("dp", 1)  # BatchNorm (vgg) sees micro-batches of the dp shares
    refs = {name: reference(name, dp * 4 if name == "vgg" else 1) for name in MODELS} if dist.get_rank() == 0 else None
    return dict(results=results, refs=refs, back_to_back=back_to_back(runs), measured=measure_cases(topology))


@pytest.fixture(scope="module")
def two_ranks():
    return run_on_ranks(rank_group, 2, {"pp": 2}, BACK_TO_BACK, timeout=300)


@pytest.fixture(scope="module")
def four_ranks():
    return run_on_ranks(rank_group, 4, {"pp": 2, "dp": 2}, 0, timeout=300)


def _close(what, got, want):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    assert err <= TOL, f"{what}: max abs error {err:.3g} > {TOL}"


def _check(results):
    refs = results[0]["refs"]
    for name, ref in refs.items():
        assert ref["rates"], f"{name}: no spiking layer recorded"
        for layer, rate in ref["rates"].items():
            assert 0.02 <= rate <= 0.98, f"{name}: spike rate of {layer} is {rate:.3f}: the comparison is vacuous"
        assert all(out.std() > 1e-3 for out in ref["outs"]), f"{name}: constant outputs"
        assert ref["losses"][0] != ref["losses"][-1], f"{name}: training did not change the loss"
    for rank, res in enumerate(results):
        for (name, schedule), got in res["results"].items():
            ref, what = refs[name], f"rank {rank} {name} {schedule}"
            for step in range(STEPS):
                _close(f"{what} loss step {step}", got["losses"][step], ref["losses"][step])
                if got["outs"] is not None:
                    _close(f"{what} merged outputs step {step}", got["outs"][step], ref["outs"][step])
            assert got["grads"].keys() == ref["grads"].keys() == got["params"].keys()
            for param in ref["grads"]:
                _close(f"{what} grad {param}", got["grads"][param], ref["grads"][param])
                _close(f"{what} param {param}", got["params"][param], ref["params"][param])


def test_pp2_every_schedule_matches_one_process(two_ranks):
    _check(two_ranks)
    assert sum(r["results"][("vgg", "1f1b")]["outs"] is not None for r in two_ranks) == 1  # the last stage's


def test_pp2_dp2_every_schedule_matches_one_process(four_ranks):
    _check(four_ranks)
    assert all(r["results"][("jelly", "gpipe")]["plan"]["topology"]["dims"] == {"pp": 2, "dp": 2}
               for r in four_ranks)


def test_each_rank_holds_only_its_stages(two_ranks):
    """A rank's optimizer-facing parameters are its stages'; the rest of its model copy is on meta."""
    for name in MODELS:
        total = sum(p.numel() for p in build(name)[0].parameters())
        local = [r["results"][(name, "1f1b")]["local_params"] for r in two_ranks]
        meta = [r["results"][(name, "1f1b")]["on_meta"] for r in two_ranks]
        assert sum(local) == total and all(0 < n < total for n in local)
        assert [m + n for m, n in zip(meta, local)] == [total, total]


def test_each_rank_runs_its_forwards_in_the_timelines_order(two_ranks, four_ranks):
    """The stages each rank ran forwards on, in order, are those of the chart's timeline (torch's order)."""
    from snn_explorer.explorer.pipeline_view import timeline

    for res in two_ranks + four_ranks:
        for (name, schedule), got in res["results"].items():
            plan = got["plan"]
            acts = timeline(schedule, 2, plan["pp_microbatches"], plan["pp_virtual_stages"])[got["pp_rank"]]
            assert got["forwards"] == [s for kind, s, *_ in acts if kind == "F"] * STEPS, (name, schedule)


def test_every_stage_resets_before_each_micro_batch(two_ranks):
    for res in two_ranks:
        for (name, schedule), got in res["results"].items():
            micro = got["plan"]["pp_microbatches"]
            assert all(n == STEPS * micro for n in got["resets"].values()), (name, schedule, got["resets"])


def test_state_carried_between_micro_batches_would_change_the_result(two_ranks):
    """Run the model over the micro-batches one after another without a reset in between: the later
    micro-batches' outputs differ from the whole batch's, which the pipeline's outputs equal."""
    model, x, _ = build("mlp_all_steps")
    from snn_explorer.core.model import reset_all

    reset_all(model)
    with torch.no_grad():
        whole = model(x)
        reset_all(model)
        leaked = torch.cat([model(chunk) for chunk in x.chunk(4, dim=1)], dim=1)
    assert (leaked - whole).abs().max() > 1e-2, "carried-over state would not change the outputs here"
    ref = two_ranks[0]["refs"]["mlp_all_steps"]["outs"][0]
    piped = next(r["results"][("mlp_all_steps", "1f1b")]["outs"] for r in two_ranks
                 if r["results"][("mlp_all_steps", "1f1b")]["outs"] is not None)[0]
    _close("pipeline outputs against the whole batch", piped, ref)
    assert (piped - leaked).abs().max() > 1e-2


def test_back_to_back_pipelines_do_not_hang(two_ranks):
    losses = [r["back_to_back"] for r in two_ranks]
    assert len(losses[0]) == BACK_TO_BACK and losses[0] == losses[1]
    assert all(torch.isfinite(torch.tensor(l)).all() for l in losses)


def test_forward_loss_points_to_train_step(two_ranks):
    for res in two_ranks:
        assert "use runtime.train_step(criterion, inputs, labels)" in res["results"][("jelly", "gpipe")][
            "forward_loss_error"]


def pp_train_fn(runtime, step, batch, state, inputs, labels):
    """launch_plan's step function: the runtime's train_step, whatever the mode."""
    state["optimizer"].zero_grad()
    loss = runtime.train_step(nn.CrossEntropyLoss(), inputs, labels)
    state["optimizer"].step()
    return {"loss": loss}


@pytest.mark.timeout(120)
def test_launch_plan_and_export_job_run_a_pp_plan(tmp_path):
    import json
    import sys

    import cloudpickle

    import snn_explorer as se

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    model, x, y = build("mlp_all_steps")
    plan = se.plan(analysis=se.analyze(model), objective="capacity", topology={"pp": 2}, batch_size=BATCH)
    assert plan.uses_pp and plan.pp_schedule == "interleaved"
    result = se.launch_plan(model, plan, pp_train_fn, steps=STEPS, optimizer={"lr": 1e-2}, train_kwargs={"inputs": x, "labels": y}, options=se.LaunchOptions(progress=False, timeout=120))
    want = [float(loss) for loss in reference("mlp_all_steps")["losses"]]
    for rank in (0, 1):
        assert result.losses[rank] == pytest.approx(want, abs=TOL)
    job = se.export_job(plan, pp_train_fn, tmp_path / "job", model=model, steps=STEPS,
                        train_kwargs={"inputs": x, "labels": y})  # its run.py runs the same train_plan_rank
    assert json.load(open(job.plan_file)) == plan.to_dict() and "python run.py" in job.command  # one node


@pytest.mark.parametrize("group,topology", [("two_ranks", {"pp": 2}), ("four_ranks", {"pp": 2, "dp": 2})])
def test_measure_of_pp_plans_lines_up_with_the_estimate(group, topology, request):
    """measure() on the rank groups: the sends recorded per stage boundary (and the loss broadcast,
    the dp gradient all-reduce) equal the estimate's rows exactly, every boundary's receives equal
    its sends; the stage's parameter, gradient, optimizer and receive-buffer bytes equal the estimate;
    every rank's peak and activations are within 10 % of the estimate's (mlp_all_steps under each
    schedule, and the spikingjelly MLP under GPipe, on pp=2; mlp_all_steps under 1F1B on pp=2 x dp=2)."""
    import snn_explorer as se
    from snn_explorer.estimator.measurement.plan_measurement import _assemble

    results = request.getfixturevalue(group)
    for j, (name, schedule) in enumerate(MEASURED[len(topology)]):
        (model, x, y), plan = measured_plan(topology, name, schedule)
        meas = _assemble(plan, [r["measured"][j] for r in results], 2)
        est = se.estimate(model, plan, example_input=x, labels=y)
        cmp = se.compare_estimate(est, meas)
        assert meas.collectives_agree
        comm = cmp["collectives"]
        sends = comm[comm["kind"] == "send"]
        ranks = [plan.pp_schedule_spec.rank_of(s, plan.pp_size, plan.pp_virtual_stages) for s in range(plan.pp_stages)]
        crossing = sum(a != b for a, b in zip(ranks, ranks[1:]))  # a V places one boundary on one rank
        assert len(sends) == 2 * crossing and (sends["count_meas"] == plan.pp_microbatches).all()
        assert (comm["count_est"] == comm["count_meas"]).all() and (comm["bytes_est"] == comm["bytes_meas"]).all()
        assert set(comm["kind"]) == ({"send", "broadcast", "all_reduce"} if plan.dp_size > 1 else {"send", "broadcast"})
        per_rank = cmp["per_rank"]
        assert len(per_rank) == plan.world_size and (per_rank["params_bytes_meas"] > 0).all()
        for col in ("params_bytes", "grads_bytes", "optimizer_bytes", "transient_bytes"):
            assert (per_rank[f"{col}_est"] == per_rank[f"{col}_meas"]).all(), (schedule, col)
        assert (per_rank["peak_bytes_meas"] >= per_rank["params_bytes_meas"] + per_rank["optimizer_bytes_meas"]).all()
        # each rank's peak (its stages' activations, gradients and what torch's schedule keeps referenced)
        # and the most bytes it saved for backward at once
        # (activations within 10 % or 8 float64 scalars: a stage of a few hundred bytes is off by a loss scalar's bytes)
        for col, slack in (("peak_bytes", 0), ("activations_bytes", 64)):
            est_b, meas_b = per_rank[f"{col}_est"], per_rank[f"{col}_meas"]
            assert ((est_b - meas_b).abs() <= 0.10 * meas_b + slack).all(), (name, schedule, col, est_b.tolist(),
                                                                           meas_b.tolist())
        assert meas.time["step_s"].gt(0).all() and meas.time["bubble_s"].isna().all()
