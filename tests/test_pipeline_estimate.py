"""estimate() of pipeline plans: the rank's stages, sends per stage boundary, bubbles (one process)."""
import pytest
import torch

import snn_explorer as se
from snn_explorer.core.neurons import reset_all
from snn_explorer.estimator.pipeline_estimate import in_flight
from snn_explorer.zoo import build


@pytest.fixture(scope="module")
def vgg():
    return build("vgg", batch_size=8)


def _plan(zoo, topology, schedule, virtual=1, micro=4, layout=None):
    return se.plan(analysis=se.analyze(zoo.model), objective="capacity", topology=topology, batch_size=8, mode="pp",
                   pp_schedule=schedule, pp_microbatches=micro, pp_virtual_stages=virtual, pp_layout=layout)


@pytest.mark.parametrize("schedule,pp,micro,virtual,want", [
    ("gpipe", 2, 4, 1, 1 / 5), ("1f1b", 4, 8, 1, 3 / 11), ("interleaved", 2, 4, 2, 1 / 9),
])
def test_bubble_fraction(schedule, pp, micro, virtual, want):
    assert se.bubble_fraction(schedule, pp, micro, virtual) == pytest.approx(want)


def test_micro_batches_in_flight_follow_the_schedule():
    assert [in_flight("gpipe", 4, r, 8) for r in range(4)] == [8, 8, 8, 8]
    assert [in_flight("1f1b", 4, r, 8) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", 4, r, 2) for r in range(4)] == [2, 2, 2, 1]
    # interleaved, 2 stages per rank, 4 micro-batches on 2 ranks (2 rounds of 2): warm-up 2 + 2 and 2, plus one
    assert [in_flight("interleaved", 2, r, 4, 2) for r in range(2)] == [5, 3]


def test_interleaved_order_is_torchs_and_a_changed_torch_is_named(monkeypatch):
    """The interleaved order comes from torch's own schedule code; without it, the error names it."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    from snn_explorer.compat import TorchCompatError
    from snn_explorer.estimator.pipeline_estimate import rank_order

    order = rank_order("interleaved", 2, 1, 4, 2)
    assert order[:4] == [("F", 1, 0), ("F", 1, 1), ("F", 3, 0), ("B", 3, 0)] and len(order) == 16
    monkeypatch.delattr(ScheduleInterleaved1F1B, "_calculate_single_rank_operations")
    with pytest.raises(TorchCompatError, match="_calculate_single_rank_operations"):
        in_flight("interleaved", 2, 0, 4, 2)


def test_pp_estimate_splits_parameters_and_counts_sends(vgg):
    plan = _plan(vgg, {"pp": 2}, "1f1b", layout=["features.4.conv"])
    est = se.estimate(vgg.model, plan, example_input=vgg.example_input, labels=vgg.labels)
    total = sum(p.numel() * p.element_size() for p in vgg.model.parameters())
    assert est.per_rank["params_bytes"].sum() == total and (est.per_rank["params_bytes"] > 0).all()
    assert est.bubble_fraction == pytest.approx(1 / 5)
    assert list(est.pipeline["microbatches_in_flight"]) == [2, 1]
    # the boundary's activation, computed here by running the first stage's modules on one micro-batch
    model = vgg.model
    reset_all(model)
    with torch.no_grad():
        boundary = model.features[:4](vgg.example_input[:, :2])
    sends = est.collectives[est.collectives["kind"] == "send"]
    assert list(sends["phase"]) == ["forward 0->1", "backward 1->0"]
    assert list(sends["count"]) == [4, 4]
    assert list(sends["bytes"]) == [4 * boundary.numel() * boundary.element_size()] * 2
    assert est.per_rank["peak_bytes"].max() < se.estimate(
        vgg.model, se.plan(analysis=se.analyze(vgg.model), objective="speed", topology={"dp": 1}, batch_size=8,
                           mode="none"), example_input=vgg.example_input, labels=vgg.labels).peak_bytes


def test_pp_dp_estimate_adds_the_stage_gradient_all_reduce(vgg):
    plan = _plan(vgg, {"pp": 2, "dp": 2}, "interleaved", virtual=2)
    est = se.estimate(vgg.model, plan, example_input=vgg.example_input, labels=vgg.labels)
    reduces = est.collectives[est.collectives["kind"] == "all_reduce"]
    grads = est.per_rank.drop_duplicates("grads_bytes")["grads_bytes"]
    assert sorted(reduces["bytes"]) == sorted(grads) and list(reduces["count"]) == [1, 1]
    assert len(est.per_rank) == 4 and est.bubble_fraction == pytest.approx(1 / 9)
    assert est.collectives[est.collectives["kind"] == "send"]["count"].tolist() == [4] * 6


def test_balanced_layout_follows_the_profile(vgg):
    plan = _plan(vgg, {"pp": 2}, "1f1b")
    balanced = se.balanced_pp_plan(vgg.model, plan, vgg.example_input, vgg.labels)
    assert balanced.pp_layout != plan.pp_layout and sum(map(int, balanced.pp_layout.split("|"))) == 19
    est = lambda p: se.estimate(vgg.model, p, example_input=vgg.example_input, labels=vgg.labels).per_rank
    spread = lambda t: t["peak_bytes"].max() / t["peak_bytes"].min()
    assert spread(est(balanced)) < spread(est(plan))


def test_measure_of_a_pipeline_plan_needs_labels_before_starting_ranks(vgg):
    plan = _plan(vgg, {"pp": 2}, "gpipe")
    with pytest.raises(ValueError, match="measure\\(\\) of a pipeline plan .* needs labels"):
        se.measure(vgg.model, plan, example_input=vgg.example_input)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,micro", [(2, 4), (4, 8), (4, 4)])
def test_replayed_timeline_idles_as_the_bubble_fraction(schedule, pp, micro):
    """The chart's replay of torch's action order (dependencies, backward = 2 forwards) idles
    exactly the estimator's bubble fraction; 1F1B never holds more forwards than in_flight says."""
    from snn_explorer.explorer.pipeline_view import idle_fraction, timeline

    assert idle_fraction(schedule, pp, micro) == pytest.approx(se.bubble_fraction(schedule, pp, micro))
    for rank, acts in timeline(schedule, pp, micro).items():
        held = peak = 0
        for kind, *_ in acts:
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
        assert peak == in_flight(schedule, pp, rank, micro)


def test_pipeline_chart_draws_ranks_and_stages(vgg):
    from snn_explorer.explorer import pipeline_chart

    plan = _plan(vgg, {"pp": 2}, "1f1b")
    fig = pipeline_chart(plan, se.analyze(vgg.model).pipeline_units)
    top, bottom = fig.axes
    assert len(top.patches) == 2 * 2 * 4 and len(bottom.patches) == 2
    assert "idle 20%" in top.get_title()
    with pytest.raises(NotImplementedError, match="may come later"):
        pipeline_chart(_plan(vgg, {"pp": 2}, "interleaved", virtual=2), se.analyze(vgg.model).pipeline_units)


def test_pp_step_time_has_the_schedules_bubble(vgg):
    """A pipeline rank computes its stage's share and idles the schedule's bubble:
    ``bubble_s / (step's forward + backward)`` is ``f / (1 - f)``, which more micro-batches shrink
    (while each micro-batch launches the stage's operators again)."""
    hw = se.hardware_profile("A100-SXM-80GB")
    kw = dict(example_input=vgg.example_input, labels=vgg.labels, hardware=hw)
    single = se.plan(analysis=se.analyze(vgg.model), objective="speed", topology=1, batch_size=8)
    whole = se.estimate(vgg.model, single, **kw).time.iloc[0]
    assert whole["bubble_s"] == 0
    ratios = []
    for micro in (2, 8):
        est = se.estimate(vgg.model, _plan(vgg, {"pp": 2}, "gpipe", micro=micro), **kw)
        row = est.time.iloc[0]
        assert 0 < row["bubble_s"]
        if micro == 2:  # 2 micro-batches through half the model: the operator launches of one whole pass
            assert row["compute_s"] < whole["compute_s"]
        assert row["step_s"] == pytest.approx(row["compute_s"] + row["exposed_comm_s"] + row["bubble_s"])
        assert row["exposed_comm_s"] > 0  # the sends between the stages are on the critical path
        ratios.append(row["bubble_s"] / row["compute_s"])
    f2, f8 = se.bubble_fraction("gpipe", 2, 2), se.bubble_fraction("gpipe", 2, 8)
    assert ratios[1] < ratios[0]
    # the optimizer's share of compute_s keeps the ratio under f / (1 - f)
    assert ratios[0] <= f2 / (1 - f2) + 1e-12 and ratios[1] <= f8 / (1 - f8) + 1e-12
