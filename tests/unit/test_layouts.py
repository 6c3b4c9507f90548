"""Data layouts (``snn_explorer.core.model.layouts``): one model computed three ways, time-major ``[T, N, F]``,
batch-major ``[N, T, F]`` and called per step on ``[N, F]``, gets the same estimate; the layout is
detected where the shapes tell it and said so; a wrong one fails loudly; a one-rank plan
communicates nothing. (The three models: tests/layout_nets.py; measurement and training on gloo ranks:
``tests/ranks/test_layouts_ranks.py``.)"""
import dataclasses

import pytest
import torch
from layout_nets import CLASSES, F_IN, HIDDEN, N, T, as_layout, data, firing_and_outputs, nets
from torch import nn

import snn_explorer as se
from snn_explorer.core.model import BATCH_MAJOR, PER_STEP, TIME_MAJOR
from snn_explorer.core.planning import split_options
from snn_explorer.estimator.profile.shape_only import meta_copy

#: The operator-count model (a CPU-device twin of the RTX 4090): what the layouts must leave equal is what the
#: profile runs record; the GPU trace adds the per-step model's outputs before they are stacked.
CPU_SIDE = dataclasses.replace(se.hardware_profile("RTX-4090"), device="cpu", kernel_model=False)

pytest.importorskip("spikingjelly.activation_based.neuron")  # installed by scripts/setup.sh

def test_the_three_models_compute_one_nontrivial_function():
    """First what the comparisons below compare is not vacuous: neurons fire (not always), outputs vary
    by sample, and the three layouts give one output."""
    x, _ = data()
    outputs = {}
    for name, (model, layout) in nets().items():
        rates, outputs[name] = firing_and_outputs(model, layout, x)
        assert len(rates) == 2 and all(0.05 <= r <= 0.95 for r in rates.values()), (name, rates)
    ref = outputs["time_major"]
    assert ref.shape == (T, N, CLASSES) and float(ref.detach().std(dim=1).min()) > 1e-3
    for name, out in outputs.items():
        assert torch.equal(out, ref), name


def test_layouts_are_detected_and_say_how():
    """Batch-major from the labels' N at dim 0; time-major at dim 1; per-step from a neuron that took
    all T steps as one; the output's time dim from one run."""
    x, y = data()
    found = {}
    for name, (model, layout) in nets().items():
        analysis = se.analyze(model, example_input=as_layout(x, layout), labels=y)
        found[name] = analysis.data_layout
        assert "detected" in analysis.data_layout_how and any("data layout" in n for n in analysis.notes)
    assert found == {"time_major": TIME_MAJOR, "batch_major": BATCH_MAJOR, "per_step": PER_STEP}


def test_models_built_on_meta_get_the_layouts_of_their_real_twins():
    """A model on the meta device has no data to run, yet its dry runs on shapes alone find what the
    real model's find: with the labels' N, and without labels (read from the neurons' state)."""
    x, y = data()
    for name, (model, layout) in nets().items():
        twin = meta_copy(model)
        assert next(twin.parameters()).device.type == "meta"
        for labels in (y, None):
            real = se.analyze(model, example_input=as_layout(x, layout), labels=labels)
            meta = se.analyze(twin, example_input=as_layout(x, layout), labels=labels)
            assert (meta.data_layout, meta.data_layout_how) == (real.data_layout, real.data_layout_how), (name, labels)
        assert meta.data_layout == layout, name


def test_an_snntorch_single_step_model_is_detected_per_step():
    """snntorch's tutorial form, ``net(x[step])`` with ``init_hidden=True``: one call took all T steps
    as one (its membrane holds ``[T, 1, ...]``), so it is run per step."""
    import snntorch as snn

    x, y = data()
    model = nn.Sequential(nn.Linear(F_IN, HIDDEN), snn.Leaky(beta=0.9, init_hidden=True), nn.Linear(HIDDEN, CLASSES))
    analysis = se.analyze(model, example_input=x, labels=y)
    assert analysis.data_layout == PER_STEP and "called per step" in analysis.data_layout_how
    looping = nets()["time_major"][0]  # multi-step neurons: time-major, not per step
    assert se.analyze(looping, example_input=x, labels=y).data_layout == TIME_MAJOR


def _plan(model, layout, x, y, **kw):
    analysis = se.analyze(model, example_input=as_layout(x, layout), labels=y, data_layout=layout)
    return se.plan(analysis=analysis, objective="speed", batch_size=N, **split_options(kw))


@pytest.mark.timeout(120)
def test_layouts_give_the_same_estimate():
    """dp=2: every per-rank byte count and every collective equal for the three layouts (the per-step
    model's peak may add its per-step outputs before they are stacked: at most one ``[T, n, C]``)."""
    x, y = data()
    estimates = {}
    for name, (model, layout) in nets().items():
        plan = _plan(model, layout, x, y, topology={"dp": 2}, mode="dp")
        estimates[name] = se.estimate(model, plan, example_input=as_layout(x, layout), labels=y,
                                      hardware=CPU_SIDE)
        assert estimates[name].data_layout == layout and "given" in estimates[name].data_layout_how
    ref = estimates["time_major"]
    output_bytes = T * (N // 2) * CLASSES * 8
    for name, est in estimates.items():
        assert est.collectives.equals(ref.collectives), name
        for column in ("params_bytes", "grads_bytes", "optimizer_bytes", "buffers_bytes", "neuron_state_bytes",
                       "activations_bytes"):
            assert est.per_rank[column].tolist() == ref.per_rank[column].tolist(), (name, column)
        slack = output_bytes if name == "per_step" else 0
        assert abs(est.peak_bytes - ref.peak_bytes) <= slack, (name, est.peak_bytes, ref.peak_bytes)
    assert ref.comm_bytes > 0


def test_estimate_detects_the_layout_of_an_unstated_plan():
    x, y = data()
    model, layout = nets()["batch_major"]
    plan = se.plan(analysis=se.analyze(model), objective="speed", topology={"dp": 2}, batch_size=N, mode="dp")
    assert plan.data_layout is None
    est = se.estimate(model, plan, example_input=as_layout(x, layout), labels=y, hardware="RTX-4090")
    assert est.data_layout == BATCH_MAJOR and est.data_layout_how.startswith("batch_major: detected")


def test_a_wrong_layout_is_a_clear_error():
    """Stated wrongly: the estimate refuses, naming the layout the batch looks like; where N = T the
    shapes cannot tell, and the neurons' state after one run tells instead of a guess."""
    x, y = data()
    model, _ = nets()["batch_major"]
    plan = se.plan(analysis=se.analyze(model), objective="speed", topology={"dp": 2}, batch_size=N, mode="dp")
    with pytest.raises(ValueError, match=r"data layout time_major .*looks batch_major"):
        se.estimate(model, plan, example_input=x.transpose(0, 1).contiguous(), labels=y, layout=TIME_MAJOR,
                    hardware="RTX-4090")
    square, labels = data(n=T)  # N = T: the shapes cannot tell; the neurons' state can
    plan = se.plan(analysis=se.analyze(model), objective="speed", topology=1, batch_size=T)
    est = se.estimate(model, plan, example_input=square.transpose(0, 1).contiguous(), labels=labels,
                      hardware="RTX-4090")
    assert est.data_layout == BATCH_MAJOR and "neurons' state holds 2" in est.data_layout_how, est.data_layout_how
    with pytest.raises(ValueError, match=r"data layouts disagree"):
        se.estimate(model, _plan(model, BATCH_MAJOR, x, y, topology=1), example_input=x, labels=y,
                    layout=TIME_MAJOR, hardware="RTX-4090")


def test_runtime_refuses_a_batch_in_the_wrong_layout():
    """apply's runtime cuts shares on the plan's batch dim and checks the outputs' N: a batch-major
    batch under a time-major plan fails, it is not trained on wrongly."""
    x, y = data()
    model, _ = nets()["batch_major"]
    plan = se.plan(analysis=se.analyze(model), objective="speed", topology=1, batch_size=N, options=se.PlanOptions(data_layout=TIME_MAJOR))
    runtime = se.apply(model=model, plan=plan, device_type="cpu")
    with pytest.raises(ValueError, match=r"labels of shape \(4,\) do not match outputs \(4, 3, 4\)"):
        runtime.forward_loss(nn.CrossEntropyLoss(), x.transpose(0, 1).contiguous(), y)
    with pytest.raises(ValueError, match=r"hold N=3 samples \(dim 1\).*looks batch_major"):
        runtime.rank_share(x.transpose(0, 1).contiguous(), y)


def test_plan_and_analysis_carry_the_layout_through_json():
    x, y = data()
    model, _ = nets()["batch_major"]
    analysis = se.analyze(model, example_input=as_layout(x, BATCH_MAJOR), labels=y)
    plan = se.plan(analysis=analysis, objective="speed", topology={"dp": 2}, batch_size=N)
    assert plan.data_layout == BATCH_MAJOR
    assert se.SNNDistributedPlan.from_dict(plan.to_dict()) == plan
    assert type(analysis).from_dict(analysis.to_dict()).data_layout == BATCH_MAJOR


def test_one_rank_plan_estimates_no_communication():
    """``topology={"dp": 1}`` with mode dp: DDP on one rank moves nothing, and the estimate says so."""
    x, y = data()
    model, layout = nets()["time_major"]
    plan = _plan(model, layout, x, y, topology={"dp": 1}, mode="dp")
    est = se.estimate(model, plan, example_input=x, labels=y, hardware="RTX-4090")
    assert est.comm_bytes == 0 and len(est.collectives) == 0
    assert "nothing communicated (one rank)" in est.verdict
    assert float(est.time["exposed_comm_s"].max()) == 0.0
