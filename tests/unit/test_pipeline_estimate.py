"""estimate() of pipeline plans: the rank's stages, sends per stage boundary, bubbles (one process)."""
import pytest
import torch

import snn_explorer as se
from snn_explorer.core.model import reset_all
from snn_explorer.core.planning import SCHEDULES
from snn_explorer.estimator import bubble_fraction
from snn_explorer.estimator.memory.pipeline_memory import in_flight
from snn_explorer.zoo import build


@pytest.fixture(scope="module")
def vgg():
    return build("vgg", batch_size=8)


def _plan(zoo, topology, schedule, virtual=1, micro=4, layout=None):
    return se.plan(analysis=se.analyze(zoo.model), objective="capacity", topology=topology, batch_size=8, mode="pp", options=se.PlanOptions(pp_schedule=schedule, pp_microbatches=micro, pp_virtual_stages=virtual, pp_layout=layout))


@pytest.mark.parametrize("schedule,pp,micro,virtual,want", [
    ("gpipe", 2, 4, 1, 1 / 5), ("1f1b", 4, 8, 1, 3 / 11), ("interleaved", 2, 4, 2, 1 / 9),
    # zero bubble: 24 busy units a rank (2 stages x 4 x F, I, W); rank 1 waits 1 for the first forward,
    # rank 0 1 for the last weight backward: a makespan of 25
    ("interleaved_zb", 2, 4, 2, 1 / 25), ("zbv", 2, 4, 2, 1 / 25),
])
def test_bubble_fraction(schedule, pp, micro, virtual, want):
    assert bubble_fraction(schedule, pp, micro, virtual) == pytest.approx(want)


def test_micro_batches_in_flight_follow_the_schedule():
    assert [in_flight("gpipe", 4, r, 8) for r in range(4)] == [8, 8, 8, 8]
    assert [in_flight("1f1b", 4, r, 8) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", 4, r, 2) for r in range(4)] == [2, 2, 2, 1]
    # interleaved, 2 stages per rank, 4 micro-batches on 2 ranks (2 rounds of 2): warm-up 2 + 2 and 2, plus one
    assert [in_flight("interleaved", 2, r, 4, 2) for r in range(2)] == [5, 3]
    # zero bubble: a forward's activations stay until its weight backward
    assert [in_flight("zbv", 2, r, 4, 2) for r in range(2)] == [4, 4]


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


def test_pp_dp_all_reduce_in_bf16_counts_the_reduce_dtype():
    """Under bf16 the stages' flat gradient is cast to bf16 before dp's all-reduce (2 bytes per element; it was
    estimated at the fp32 gradients' 4 while measure() counted 2): the two pp ranks' rows add up to every
    trainable parameter's elements x 2."""
    zoo = build("mlp_all_steps")
    plan = se.plan(analysis=se.analyze(zoo.model), objective="speed", topology={"pp": 2, "dp": 2}, mode="pp",
                   batch_size=zoo.batch_size, features=se.DistributedFeatureSet(allow_mixed_precision=True), options=se.PlanOptions(precision="bf16"))
    est = se.estimate(zoo.model, plan, example_input=zoo.example_input, labels=zoo.labels)
    reduces = est.collectives[est.collectives["kind"] == "all_reduce"]
    assert len(reduces) == 2 and sum(reduces["bytes"]) == 2 * sum(p.numel() for p in zoo.model.parameters())


def test_balanced_layout_follows_the_profile(vgg):
    plan = _plan(vgg, {"pp": 2}, "1f1b")
    balanced = se.balanced_pp_plan(vgg.model, plan, vgg.example_input, vgg.labels)
    assert balanced.pp_layout != plan.pp_layout and sum(map(int, balanced.pp_layout.split("|"))) == 19
    est = lambda p: se.estimate(vgg.model, p, example_input=vgg.example_input, labels=vgg.labels).per_rank
    spread = lambda t: t["peak_bytes"].max() / t["peak_bytes"].min()
    assert spread(est(balanced)) < spread(est(plan))


def test_explorer_pipelines_are_balanced_by_default_and_a_chosen_layout_stays(vgg):
    """The Explorer's pp plans (made, and enumerated) get the profile-balanced layout, whose most
    loaded rank peaks lower than core's even cut; a layout the user chose is kept."""
    ex = se.Explorer(vgg.model, example_input=vgg.example_input, labels=vgg.labels)
    even = _plan(vgg, {"pp": 2}, "1f1b")
    made = ex.make_plan(objective="capacity", topology={"pp": 2}, mode="pp", options=se.PlanOptions(pp_schedule="1f1b", pp_microbatches=4))
    assert made.pp_layout == se.balanced_pp_plan(vgg.model, even, vgg.example_input, vgg.labels).pp_layout
    assert made.pp_layout != even.pp_layout
    assert ex.estimate(made).per_rank["peak_bytes"].max() < ex.estimate(even).per_rank["peak_bytes"].max()
    chosen = ex.make_plan(objective="capacity", topology={"pp": 2}, mode="pp", options=se.PlanOptions(pp_schedule="1f1b", pp_microbatches=4, pp_layout=even.pp_layout))
    assert chosen.pp_layout == even.pp_layout
    listed = [p for p in ex.enumerate(2, objective="capacity") if p.uses_pp]
    assert listed and all(p.pp_layout == se.balanced_pp_plan(vgg.model, p, vgg.example_input, vgg.labels).pp_layout
                          for p in listed)


def test_measure_of_a_pipeline_plan_needs_labels_before_starting_ranks(vgg):
    plan = _plan(vgg, {"pp": 2}, "gpipe")
    with pytest.raises(ValueError, match="measure\\(\\) of a pipeline plan .* needs labels"):
        se.measure(vgg.model, plan, example_input=vgg.example_input)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("pp,micro", [(2, 4), (4, 8), (4, 4), (2, 8)])
def test_replayed_timeline_idles_as_the_bubble_fraction(schedule, pp, micro):
    """The chart's replay of torch's action order (dependencies, backward = 2 forwards) idles
    exactly the estimator's bubble fraction; no rank holds more forwards than in_flight says."""
    from snn_explorer.core.planning import idle_fraction
    from snn_explorer.explorer.pipeline_view import timeline

    virtual = 2 if SCHEDULES[schedule].multi_stage else 1
    lines = timeline(schedule, pp, micro, virtual)
    assert idle_fraction(lines) == pytest.approx(bubble_fraction(schedule, pp, micro, virtual))
    for rank, acts in lines.items():
        held = peak = 0
        for kind, *_ in acts:
            held += {"F": 1, "B": -1, "W": -1}.get(kind, 0)
            peak = max(peak, held)
        assert peak == in_flight(schedule, pp, rank, micro, virtual)
        assert sorted((k, s, i) for k, s, i, *_ in acts if k == "F") == [
            ("F", s, i) for s in SCHEDULES[schedule].rank_stages(rank, pp, virtual) for i in range(micro)]


@pytest.mark.parametrize("pp", [2, 4])
def test_gpipe_idles_the_fill_and_drain(pp):
    from snn_explorer.core.planning import idle_fraction
    from snn_explorer.explorer.pipeline_view import timeline

    for micro in (pp, 2 * pp, 8):
        assert idle_fraction(timeline("gpipe", pp, micro)) == pytest.approx((pp - 1) / (micro + pp - 1))


def _order(schedule, pp, micro, virtual=1):
    from snn_explorer.explorer.pipeline_view import timeline

    return {r: " ".join(f"{k}{s}.{i}" for k, s, i, *_ in acts)
            for r, acts in timeline(schedule, pp, micro, virtual).items()}


def test_timeline_order_is_torchs():
    """The chart's per-rank order, written out from torch's Schedule1F1B step (warm-up of
    ``pp - stage`` forwards, then backward / forward in turn) and ScheduleInterleaved1F1B's
    ``pipeline_order`` (torch 2.13, pp=2, 4 micro-batches, 2 stages per rank)."""
    assert _order("1f1b", 2, 4) == {0: "F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 B0.3",
                                    1: "F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3"}
    assert _order("1f1b", 4, 4)[1] == "F1.0 F1.1 F1.2 B1.0 F1.3 B1.1 B1.2 B1.3"
    assert _order("interleaved", 2, 4, 2) == {
        0: "F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3",
        1: "F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 B1.2 B1.3"}
    assert _order("interleaved", 4, 8, 2)[3].startswith("F3.0 F3.1 F3.2 F3.3 F7.0 B7.0 F7.1 B7.1")
    assert _order("zbv", 2, 4, 2)[1].startswith("F1.0 F2.0 F1.1 F2.1 I2.0 W2.0")


def test_pipeline_chart_draws_ranks_and_stages(vgg):
    from snn_explorer.explorer import pipeline_chart

    plan = _plan(vgg, {"pp": 2}, "1f1b")
    fig = pipeline_chart(plan, se.analyze(vgg.model).pipeline_units)
    top, bottom = fig.axes
    assert len(top.patches) == 2 * 2 * 4 and len(bottom.patches) == 2
    assert "idle 20%" in top.get_title()
    fig = pipeline_chart(_plan(vgg, {"pp": 2}, "interleaved", virtual=2), se.analyze(vgg.model).pipeline_units)
    top, bottom = fig.axes
    assert len(top.patches) == 2 * 2 * 2 * 4 and len(bottom.patches) == 4
    assert "idle 11%" in top.get_title() and [t.get_text() for t in bottom.texts][3] == "stage 3 (rank 1)"
    fig = pipeline_chart(_plan(vgg, {"pp": 2}, "zbv", virtual=2), se.analyze(vgg.model).pipeline_units)
    assert [t.get_text() for t in fig.axes[1].texts][3] == "stage 3 (rank 0)"
    assert len(fig.axes[0].patches) == 2 * 2 * 3 * 4  # F, I and W of 4 micro-batches on 2 stages per rank


def test_pp_step_time_is_its_schedule_replayed(vgg):
    """Every rank of a pipeline ends the schedule together (the loss broadcast); its compute, exposed
    communication and bubble add up to it; more micro-batches shrink the bubble against the compute
    (while each micro-batch launches the stage's operators again)."""
    hw = se.hardware_profile("A100-SXM-80GB")
    kw = dict(example_input=vgg.example_input, labels=vgg.labels, hardware=hw)
    single = se.plan(analysis=se.analyze(vgg.model), objective="speed", topology=1, batch_size=8)
    assert se.estimate(vgg.model, single, **kw).time.iloc[0]["bubble_s"] == 0
    ratios = []
    for micro in (2, 8):
        table = se.estimate(vgg.model, _plan(vgg, {"pp": 2}, "gpipe", micro=micro), **kw).time
        # the ranks end the schedule together; their steps differ by their own optimizer step
        assert table["step_s"].to_numpy() == pytest.approx(table["step_s"].max(), rel=0.05)
        assert (table["bubble_s"] > 0).all()
        assert table["step_s"].to_numpy() == pytest.approx(table[["compute_s", "exposed_comm_s", "bubble_s"]].sum(axis=1))
        assert (table["exposed_comm_s"] > 0).all()  # the transfers between the stages and the loss broadcast
        ratios.append(table["bubble_s"].sum() / table["compute_s"].sum())
    assert ratios[1] < ratios[0]


def test_a_schedules_calibrated_costs_add_per_action_and_per_transfer(vgg):
    """``pp_action:<schedule>`` lengthens the step by at least itself times the actions of a rank (its
    actions run one after another); ``pp_link:<schedule>`` delays each transfer between ranks."""
    import dataclasses

    base = se.hardware_profile("A100-SXM-80GB")
    plan = _plan(vgg, {"pp": 2}, "1f1b")
    kw = dict(example_input=vgg.example_input, labels=vgg.labels)
    step = lambda costs: se.estimate(vgg.model, plan, hardware=dataclasses.replace(base, framework_overhead={2: costs}),
                                     **kw).time["step_s"].to_numpy()
    plain = step({})
    assert step({"pp_action:gpipe": 1.0, "pp_link:gpipe": 1.0}) == pytest.approx(plain)  # another schedule's
    assert (step({"pp_action:1f1b": 1e-3}) >= plain + 2 * plan.pp_microbatches * 1e-3 - 1e-12).all()
    # a transfer's extra latency: at least once down the pipe and once back up
    assert (step({"pp_link:1f1b": 1e-3}) >= plain + 2e-3 - 1e-12).all()


def test_replay_with_costs_and_transfers_matches_a_hand_computed_schedule():
    """1F1B on 2 ranks, 2 micro-batches; stage 0: forward 1, backward 2; stage 1: forward 3, backward
    6; each transfer 0.5. By hand: rank 0 F0 [0, 1], F1 [1, 2]; rank 1 F0 [1.5, 4.5], B0 [4.5, 10.5],
    F1 [10.5, 13.5], B1 [13.5, 19.5]; rank 0 B0 [11, 13], B1 [20, 22]. Rank 0 waited 2 x 0.5 for the
    transfers of its gradients, rank 1 0.5 for its first input (the second had arrived)."""
    from snn_explorer.core.planning import replay
    from snn_explorer.estimator.timing.pipeline_time import waited_on_transfers

    orders = SCHEDULES["1f1b"].rank_actions(2, 2)
    cost = {("F", 0): 1.0, ("B", 0): 2.0, ("F", 1): 3.0, ("B", 1): 6.0}
    lines = replay(orders, 2, lambda kind, s: cost[(kind, s)], lambda src, dst: 0.5)
    assert [span[3:] for span in lines[0]] == [(0, 1), (1, 2), (11, 13), (20, 22)]
    assert [span[3:] for span in lines[1]] == [(1.5, 4.5), (4.5, 10.5), (10.5, 13.5), (13.5, 19.5)]
    links = {(0, 1): 0.5, (1, 0): 0.5}
    assert waited_on_transfers(lines, 0, links, 2) == 1.0 and waited_on_transfers(lines, 1, links, 2) == 0.5


def test_equal_stages_keep_the_schedules_bubble():
    """With every stage costing alike the replay's busy share is 1 - the schedule's bubble fraction:
    1F1B on 4 ranks over 4 micro-batches idles 3 / 7 of the step."""
    from snn_explorer.estimator.timing.pipeline_time import busy_share

    plan = _plan(build("vgg"), {"pp": 4}, "1f1b")
    costs = {(kind, s): 2.0 if kind == "B" else 1.0 for s in range(4) for kind in ("F", "B", "I", "W")}
    assert busy_share(plan, costs) == pytest.approx(1 - 3 / 7)


def test_stage_work_adds_up_to_the_whole_models(vgg):
    """The stages' counted FLOPs are the whole model's, forward and backward (the loss on the last)."""
    from snn_explorer.estimator.profile.profiling import model_profile
    from snn_explorer.estimator.timing.compute_work import rank_work
    from snn_explorer.estimator.timing.pipeline_time import plan_stages, stage_work

    profile = model_profile(vgg.model, vgg.example_input, vgg.labels)
    whole = rank_work(profile, None, 1, "adam")
    plan = _plan(vgg, {"pp": 2}, "1f1b", micro=4)
    n, t = 2, vgg.example_input.shape[0]
    stages = stage_work(profile, plan_stages(plan, profile), n, t)
    assert len(stages) == 2 and all(s.forward.flops(n, t) > 0 for s in stages)
    for phase in ("forward", "backward"):
        total = sum(getattr(s, phase).flops(n, t) for s in stages)
        assert total == pytest.approx(whole.phase(phase).flops(n, t), rel=1e-6)


def test_the_slowest_stage_sets_the_pipeline_step(vgg):
    """A layout that gives rank 0 all but one unit: rank 0 computes most, and the step is longer than
    under the layout balanced by the profile."""
    hw = se.hardware_profile("A100-SXM-80GB")
    kw = dict(example_input=vgg.example_input, labels=vgg.labels, hardware=hw)
    skewed = se.estimate(vgg.model, _plan(vgg, {"pp": 2}, "1f1b", layout="18|1"), **kw).time
    balanced = se.estimate(vgg.model, _plan(vgg, {"pp": 2}, "1f1b"), **kw).time
    assert skewed["compute_s"][0] > 3 * skewed["compute_s"][1]
    assert skewed["step_s"].max() > balanced["step_s"].max()


def test_a_rank_without_trainable_parameters_is_refused_at_plan_time():
    """mlp_all_steps has 5 units, 3 with weights (net.0, net.2, net.4): 4 stages leave one rank only a
    neuron, whose optimizer would get no parameters; plan() names it, enumerate_plans lists why."""
    zoo = build("mlp_all_steps", batch_size=8)
    analysis = se.analyze(zoo.model)
    assert analysis.trainable_units == ("net.0", "net.2", "net.4")
    with pytest.raises(ValueError, match=r"pp_layout '2\|1\|1\|1' leaves pp rank 2 .*'net.3'.* without a trainable"):
        se.plan(analysis=analysis, objective="capacity", topology={"pp": 4}, batch_size=8, mode="pp")
    listed = se.enumerate_plans(analysis, world_size=4, batch_size=8)
    assert "without a trainable parameter" in listed.infeasible["pp pp=4"]
    pipes = [p for p in listed if p.mode == "pp"]
    assert [p.pp_layout for p in pipes] == ["2|1|1|1"] and pipes[-1].dp_size == 2  # pp=2 x dp=2


def test_balanced_layout_gives_every_stage_an_eligible_unit():
    from snn_explorer.core.planning import balanced_layout

    assert balanced_layout([1, 1, 1, 1], 2) == (2, 2)
    assert balanced_layout([1, 1, 1, 1], 2, [True, True, False, False]) == (1, 3)
    with pytest.raises(ValueError, match="1 of them eligible, cannot be cut into 2 stages"):
        balanced_layout([1, 1, 1, 1], 2, [True, False, False, False])


def test_trainable_units_survive_json_and_an_older_analysis_reads_as_unknown():
    zoo = build("mlp_all_steps", batch_size=8)
    analysis = se.analyze(zoo.model)
    data = analysis.to_dict()
    assert type(analysis).from_dict(data).trainable_units == analysis.trainable_units
    data.pop("trainable_units")
    assert type(analysis).from_dict(data).trainable_units is None
