"""Time chunks' checkpointing cost grows with what the region holds (HardwareProfile.checkpoint_overhead_per_op,
calibration/checkpoint_call.py): the estimated step grows by calls x region operators x the cost per operator, the
region's operators counted directly on one call of the time-step module; a checkpointed step's extra backward work
(recompute, replays) is timed at the forward's measured rate where the step is corrected by a measurement; and the
calibrated costs are scaled by the reference step timed now over its calibrated seconds."""
import dataclasses

import pytest
import torch

import snn_explorer as se
from snn_explorer.core.levers import chunked, copy_without_levers
from snn_explorer.estimator import hardware_profile
from snn_explorer.estimator.calibration.checkpoint_call import CHUNK_LAYERS, region_ops
from snn_explorer.estimator.instruments.op_counter import OpCounter
from snn_explorer.estimator.profile.checkpointed import levered_profile, unlevered
from snn_explorer.estimator.profile.profiling import model_profile
from snn_explorer.estimator.timing import step_time
from snn_explorer.estimator.timing.checkpoint_probe import probe_model
from snn_explorer.estimator.timing.compute_work import rank_work
from snn_explorer.estimator.timing.step_time import at_host_speed, compute_phases
from snn_explorer.zoo.mlp import SpikingMLP

IN, HIDDEN, CLASSES, N, T = 6, 8, 3, 4, 8
PER_OP = 1e-4


def _stand_in(layers: int):
    torch.manual_seed(0)
    model = SpikingMLP(IN, (HIDDEN,) * layers, CLASSES, init_gain=3.0)
    x = torch.bernoulli(torch.full((T, N, IN), 0.5))
    y = torch.randint(0, CLASSES, (N,))
    features = se.DistributedFeatureSet(allow_activation_checkpointing=True)
    plain = copy_without_levers(se.plan(analysis=se.analyze(model), objective="speed", topology={"dp": 1},
                                        batch_size=N, mode="dp", features=features))
    return model, x, y, plain


def _one_call_ops(model, x) -> float:
    """Operators of one call of ``model.net`` (a middle time step, after the earlier ones set the neuron state)."""
    steps = x.unbind(0)
    for x_t in steps[:3]:
        model.net(x_t)
    with OpCounter() as counter:
        model.net(steps[3])
    return counter.counts[3]


def _step_s(model, x, y, plan, hw) -> float:
    return se.plan_estimator(model, x, y, hardware=hw)(plan).step_time_s


@pytest.mark.parametrize("layers", [1, 2])
def test_the_chunk_cost_grows_with_the_operators_of_the_region(layers):
    model, x, y, plain = _stand_in(layers)
    region = _one_call_ops(model, x)
    assert region > 10 * layers  # a Linear and a neuron per hidden layer, and the head
    # the calibrated per-operator cost is a CPU-side figure: the operator-count model (a CPU-device twin of the H100)
    bare = dataclasses.replace(hardware_profile("H100-SXM"), device="cpu", kernel_model=False)
    costed = dataclasses.replace(bare, checkpoint_overhead_per_op={"time_chunks": PER_OP})
    for every in (1, 8):
        plan = chunked(plain, "net", every)
        # by hand: each of the T time steps is one checkpointed call of `net`, whatever the chunk size
        grown = _step_s(model, x, y, plan, costed) - _step_s(model, x, y, plan, bare)
        assert grown == pytest.approx(T * region * PER_OP, rel=1e-9)
    assert _step_s(model, x, y, plain, costed) == _step_s(model, x, y, plain, bare)  # no checkpointing, no cost


def test_the_calibration_probes_count_their_regions_as_the_estimate_does():
    x = torch.bernoulli(torch.full((T, N, 8), 0.5))
    y = torch.randint(0, 2, (N,))
    counts = [region_ops(probe_model(layers), x, y) for layers in CHUNK_LAYERS]
    assert counts == [_one_call_ops(probe_model(layers), x) for layers in CHUNK_LAYERS]
    assert counts[0] < counts[1]  # the per-operator figure is read between two regions of different size


def test_the_extra_backward_of_time_chunks_is_timed_at_the_forward_rate():
    model, x, y, plain_plan = _stand_in(2)
    plan = chunked(plain_plan, "net", 2)
    profile = levered_profile(model_profile(model, x, y), plan)
    work, plain = rank_work(profile, None, 1, "adam"), rank_work(unlevered(profile), None, 1, "adam")
    hw, n, t = hardware_profile("H100-SXM"), plan.per_rank_batch, T
    extra = work.backward.seconds(hw, n, t, 4) - plain.backward.seconds(hw, n, t, 4)
    assert extra > 0  # the recompute and the replays
    correction = {"forward": 3.0, "backward": 0.5, "optimizer": 1.0}
    by_phase = compute_phases(plan, work, hw, t, 4, 1.0, correction)
    split = compute_phases(plan, work, hw, t, 4, 1.0, correction, plain)
    assert split["forward"] == by_phase["forward"] and split["optimizer"] == by_phase["optimizer"]
    assert split["backward"] == pytest.approx(by_phase["backward"] + (3.0 - 0.5) * extra, rel=1e-12)


def test_the_costs_are_scaled_by_the_reference_step_timed_now(monkeypatch):
    timed = []
    monkeypatch.setattr(step_time, "reference_step_s", lambda: timed.append(1) or 3e-3)  # as if 1.5x slower now

    class Plain:  # stands in for the profile the scale is kept on
        pass

    hw = dataclasses.replace(hardware_profile("H100-SXM"), checkpoint_overhead={"blocks": 2e-4, "time_chunks": 4e-4},
                             checkpoint_overhead_per_op={"time_chunks": 1e-5}, checkpoint_reference_s=2e-3)
    plain = Plain()
    for _ in range(2):
        scaled = at_host_speed(hw, plain)
        assert scaled.checkpoint_overhead == pytest.approx({"blocks": 3e-4, "time_chunks": 6e-4}, rel=1e-12)
        assert scaled.checkpoint_overhead_per_op == pytest.approx({"time_chunks": 1.5e-5}, rel=1e-12)
    assert len(timed) == 1  # timed once per profile
    assert hardware_profile("H100-SXM").checkpoint_reference_s is None  # a datasheet profile: nothing to scale
