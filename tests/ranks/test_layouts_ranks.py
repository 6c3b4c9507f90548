"""Data layouts on real gloo ranks: the time-major, batch-major and per-step forms of one network
(``layout_nets.nets``) measure alike and train alike under dp=2, each rank cutting its share on its
layout's batch dim; spikingjelly 2.0.0's own ``CIFAR10DVSVGG`` (``[N, T, C, H, W]`` in, ``[T, N, C]``
out, shrunk) is detected, estimated, measured and trained unmodified; a one-rank plan measures no
collective."""
import copy

import pytest
import torch
from distributed_harness import run_on_ranks
from layout_nets import CLASSES, N, T, as_layout, data, nets
from models import small_reference_vgg
from torch import nn

import snn_explorer as se
from snn_explorer.core.model import BATCH_MAJOR, DataLayout, reset_all
from snn_explorer.estimator.measurement.plan_measurement import assemble_measurements, measure_on_rank
from snn_explorer.estimator.measurement.settings import measure_settings

pytest.importorskip("spikingjelly.activation_based.examples.memopt.models")  # installed by scripts/setup.sh

STEPS, LR = 3, 0.05


def _dp_plan(model, layout: DataLayout, batch: int = N):
    return se.plan(analysis=se.analyze(model), objective="speed", topology={"dp": 2}, batch_size=batch, mode="dp", options=se.PlanOptions(data_layout=layout))


def _measure_cases(cases):
    """On each rank: what se.measure's ranks return (measure_on_rank), for every (model, plans, settings) in turn."""
    return [measure_on_rank(model, plans, run) for model, plans, run in cases]


@pytest.mark.timeout(300)
def test_layouts_give_the_same_measurement():
    """Measured on 2 gloo ranks: bytes of every kind and every collective equal for the three layouts
    (the per-step model's peak may add its per-step outputs before stacking: one ``[T, n, C]``)."""
    x, y = data()
    cases, layouts = {}, {}
    for name, (model, layout) in nets().items():
        layouts[name] = layout
        plans = [_dp_plan(model, layout)]
        cases[name] = (model, plans, measure_settings(model, plans, as_layout(x, layout), y, 2, "adam", None, 1e-3,
                                                      "cpu"))
    per_rank = run_on_ranks(_measure_cases, 2, list(cases.values()), timeout=240)  # what se.measure runs, one spawn
    measured = {}
    for i, (name, (model, plans, run)) in enumerate(cases.items()):
        measured[name] = assemble_measurements(plans, [rank[i] for rank in per_rank], run)[0]
        assert measured[name].data_layout == layouts[name]
    ref = measured["time_major"]
    assert ref.collectives["bytes"].sum() > 0 and ref.collectives_agree
    for name, m in measured.items():
        assert m.collectives.equals(ref.collectives), (name, m.collectives, ref.collectives)
        for column in ("params_bytes", "grads_bytes", "optimizer_bytes", "buffers_bytes", "neuron_state_bytes",
                       "activations_bytes"):
            assert m.per_rank[column].tolist() == ref.per_rank[column].tolist(), (name, column)
        slack = T * (N // 2) * CLASSES * 8 if name == "per_step" else 0
        assert abs(m.peak_bytes - ref.peak_bytes) <= slack, (name, m.peak_bytes, ref.peak_bytes)


def _sgd_losses(runtime, inputs, labels, steps, lr) -> list:
    """``steps`` SGD steps of ``runtime`` on its share: each step's loss."""
    opt = runtime.build_optimizer(torch.optim.SGD, lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(float(runtime.train_step(nn.CrossEntropyLoss(), inputs, labels)))
        opt.step()
    return losses


def _train_rank(models, x_tm, y, steps, lr):
    """Each model (its plan's layout) trained ``steps`` steps on its share of one global batch, cut by
    ``runtime.rank_share``: the losses (under pp the mean of the micro-batches'), the full parameters
    after, by name and by sorted name's position, and the share's shape."""
    out = {}
    for name, (model, plan) in models.items():
        runtime = se.apply(model=model, plan=plan, device_type="cpu")
        inputs, labels = runtime.rank_share(as_layout(x_tm, plan.layout), y)
        losses = _sgd_losses(runtime, inputs, labels, steps, lr)
        params = {k: v.detach().clone() for k, v in runtime.full_parameters().items()}
        out[name] = dict(losses=losses, params=params, by_position=[params[k] for k in sorted(params)],
                         share=tuple(inputs.shape))
    return out


def _time_major_call(model, part):
    return model(part)


def _reference_training(model, x_tm, y, steps, lr, call=_time_major_call, halves: int = 2):
    """Plain torch, what dp=2 computes: each half of the batch (``x_tm`` time-major; ``call(model,
    half)`` returns ``[T, n, C]``) gives its time-mean cross-entropy (its own BatchNorm statistics),
    the gradients are averaged, SGD steps. Returns each step's loss per half, and the parameters."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    size = x_tm.shape[1] // halves
    for _ in range(steps):
        opt.zero_grad()
        per_half = []
        for h in range(halves):
            reset_all(model)
            out = call(model, x_tm[:, h * size:(h + 1) * size])
            loss = nn.functional.cross_entropy(out.mean(0), y[h * size:(h + 1) * size])
            (loss / halves).backward()
            per_half.append(loss.item())
        losses.append(per_half)
        opt.step()
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _dp_models():
    """The three layouts' models (one set of weights), each with its dp=2 plan."""
    return {name: (model, _dp_plan(model, layout)) for name, (model, layout) in nets().items()}


def _pp_models():
    """pp=2, 2 micro-batches: a batch-major ``nn.Sequential`` of the time-major model's layers and the per-step
    network, each with its plan."""
    built = nets()
    batch_major = nn.Sequential(SwapTN(), *copy.deepcopy(built["time_major"][0].net), SwapTN())
    models = {}
    for name, model, layout, cut in (("batch_major", batch_major, BATCH_MAJOR, "3|3"),
                                     ("per_step", *built["per_step"], "2|2")):
        models[name] = (model, se.plan(analysis=se.analyze(model), objective="speed", topology={"pp": 2},
                                       batch_size=N, mode="pp", options=se.PlanOptions(data_layout=layout, pp_schedule="gpipe", pp_microbatches=2, pp_virtual_stages=1, pp_layout=cut)))
    return models


@pytest.fixture(scope="module")
def trained():
    """Per rank, per group ("dp", "pp"): _train_rank's results; the dp and the pp models train in one spawn."""
    x, y = data()
    groups = {"dp": _dp_models(), "pp": _pp_models()}
    models = {(group, name): m for group, ms in groups.items() for name, m in ms.items()}
    results = run_on_ranks(_train_rank, 2, models, x, y, STEPS, LR, timeout=240)
    return [{group: {name: res for (g, name), res in result.items() if g == group} for group in groups}
            for result in results]


@pytest.mark.timeout(300)
def test_layouts_train_alike_on_2_ranks(trained):
    """Same data, three layouts, dp=2: each rank's share has N/2 samples on its layout's batch dim, and
    losses and parameters after 3 steps equal a plain single-process run of the time-major model."""
    x, y = data()
    ref_losses, ref_params = _reference_training(nets()["time_major"][0], x, y, STEPS, LR)
    assert ref_losses[0] != pytest.approx(ref_losses[-1], abs=1e-6)  # training moved the loss
    assert all(len(result["dp"]) == 3 for result in trained)
    for rank, result in enumerate(r["dp"] for r in trained):
        for name, res in result.items():
            expected_share = {"batch_major": (N // 2, T, 6)}.get(name, (T, N // 2, 6))
            assert res["share"] == expected_share, (rank, name, res["share"])
            assert res["losses"] == pytest.approx([step[rank] for step in ref_losses], rel=1e-9), (rank, name)
            for key, value in ref_params.items():
                assert torch.allclose(res["params"][key], value, rtol=0, atol=1e-10), (rank, name, key)


class SwapTN(nn.Module):
    """``[a, b, ...]`` -> ``[b, a, ...]``: lets a batch-major network be a plain ``nn.Sequential``."""

    def forward(self, x):
        return x.transpose(0, 1)


@pytest.mark.timeout(300)
def test_pipeline_micro_batches_follow_the_layout(trained):
    """pp=2, 2 micro-batches: a batch-major ``nn.Sequential`` (micro-batches cut and outputs merged on
    dim 0) and the per-step network (each stage runs its units once per step) train as plain torch."""
    x, y = data()
    ref_losses, ref_params = _reference_training(nets()["time_major"][0], x, y, STEPS, LR)
    expected = [ref_params[k] for k in sorted(ref_params)]  # net.1.*, net.3.* sort as 1.*, 3.* do
    assert all(set(result["pp"]) == {"batch_major", "per_step"} for result in trained)
    for rank, result in enumerate(r["pp"] for r in trained):
        for name, res in result.items():
            assert res["losses"] == pytest.approx([sum(step) / 2 for step in ref_losses], rel=1e-9), (rank, name)
            assert len(res["by_position"]) == len(expected)
            for got, want in zip(res["by_position"], expected):
                assert torch.allclose(got, want, rtol=0, atol=1e-10), (rank, name)


def events(n: int = 4, t: int = 3):
    """A batch-major DVS-like batch ``[N, T, 2, 16, 16]`` of 0/1 events, and its labels."""
    g = torch.Generator().manual_seed(4)
    return (torch.rand(n, t, 2, 16, 16, generator=g, dtype=torch.float64).lt(0.3).double(),
            torch.tensor([1, 7, 3, 0][:n]))


def _vgg_rank(model, plan, x, y, steps, lr):
    rates = {}
    for name, m in model.named_modules():
        if hasattr(m, "v_threshold"):
            m.register_forward_hook(lambda _m, _i, o, name=name: rates.__setitem__(name, float(o.detach().mean())))
    runtime = se.apply(model=model, plan=plan, device_type="cpu")
    inputs, labels = runtime.rank_share(x, y)
    losses = _sgd_losses(runtime, inputs, labels, steps, lr)
    return dict(losses=losses, rates=rates, share=tuple(inputs.shape),
                params={k: v.detach().clone() for k, v in runtime.full_parameters().items()})


def _vgg_measure_and_train(model, plan, run, x, y, steps, lr):
    """One spawn for both: what se.measure's ranks return for ``plan`` (it copies the model), then the training."""
    return dict(measured=measure_on_rank(model, [plan], run), **_vgg_rank(model, plan, x, y, steps, lr))


@pytest.mark.timeout(300)
def test_reference_vgg_batch_major_unmodified():
    """``CIFAR10DVSVGG`` as the package ships it takes ``[N, T, C, H, W]`` and returns ``[T, N, C]``:
    detected so (and said how); estimated and measured alike on 2 gloo ranks; trained under dp=2
    equal to plain torch on the same halves; its one-rank plan communicates nothing, measured too."""
    x, y = events()
    model = small_reference_vgg()
    analysis = se.analyze(model, example_input=x, labels=y)
    assert analysis.data_layout == DataLayout("batch_major", "time_major"), analysis.data_layout_how
    assert "labels' N=4 is dim 0" in analysis.data_layout_how and "(3, 1, 10)" in analysis.data_layout_how
    plan = se.plan(analysis=analysis, objective="speed", topology={"dp": 2}, batch_size=4, mode="dp")
    assert plan.data_layout == analysis.data_layout
    est = se.estimate(model, plan, example_input=x, labels=y, hardware="RTX-4090")
    run = measure_settings(model, [plan], x, y, 2, "adam", None, 1e-3, "cpu")  # se.measure's, steps=2
    results = run_on_ranks(_vgg_measure_and_train, 2, model, plan, run, x, y, STEPS, LR, timeout=240)
    measured = assemble_measurements([plan], [r["measured"] for r in results], run)[0]
    assert measured.data_layout == analysis.data_layout
    assert est.comm_bytes == int(measured.collectives["bytes"].sum()) > 0
    one = se.plan(analysis=analysis, objective="speed", topology={"dp": 1}, batch_size=4, mode="dp")
    assert se.estimate(model, one, example_input=x, labels=y, hardware="RTX-4090").comm_bytes == 0
    assert len(se.measure(model, one, example_input=x, labels=y, steps=2, timeout=120).collectives) == 0

    ref_losses, ref_params = _reference_training(model, x.transpose(0, 1), y, STEPS, LR,
                                                 call=lambda m, part: m(part.transpose(0, 1)))
    rates = results[0]["rates"]
    assert len(rates) == 8 and all(0.02 <= r <= 0.98 for r in rates.values()), rates  # spikes firing, not saturated
    assert ref_losses[0] != pytest.approx(ref_losses[-1], abs=1e-6)
    for rank, res in enumerate(results):
        assert res["share"] == (2, 3, 2, 16, 16)  # 2 samples each, cut on dim 0
        assert res["losses"] == pytest.approx([step[rank] for step in ref_losses], rel=1e-9), rank
        for key, value in ref_params.items():
            assert torch.allclose(res["params"][key], value, rtol=0, atol=1e-9), (rank, key)
