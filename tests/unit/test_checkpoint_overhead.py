"""The checkpointing machinery's calibrated cost per checkpointed call (HardwareProfile.checkpoint_overhead, measured
by estimator/calibration/checkpoint_call.py): on a stand-in profile with a known per-call cost the estimated step
grows by exactly calls x cost, calls counted by hand; the datasheet profiles state none and add nothing."""
import dataclasses

import pytest
import torch

import snn_explorer as se
from snn_explorer.core.levers import chunked, copy_without_levers
from snn_explorer.estimator import hardware_profile
from snn_explorer.zoo.mlp import SpikingMLP

IN, HIDDEN, CLASSES, N, T = 6, 8, 3, 4, 8
COST = {"blocks": 1e-3, "time_chunks": 3e-3}


@pytest.fixture(scope="module")
def stand_in():
    torch.manual_seed(0)
    model = SpikingMLP(IN, (HIDDEN, HIDDEN), CLASSES, init_gain=3.0)  # net: Linear, LIF, Linear, LIF, Linear
    x = torch.bernoulli(torch.full((T, N, IN), 0.5))
    y = torch.randint(0, CLASSES, (N,))
    features = se.DistributedFeatureSet(allow_activation_checkpointing=True)
    make = lambda ck: se.plan(analysis=se.analyze(model), objective="speed", topology={"dp": 1}, batch_size=N,
                              mode="dp", features=features, options=se.PlanOptions(activation_checkpointing=ck))
    plain = copy_without_levers(make("none"))
    return model, x, y, plain, make("blocks")


def _step_s(model, x, y, plan, overhead):
    # the calibrated per-call cost is a CPU-side figure: the operator-count model (a CPU-device twin of the H100)
    hw = dataclasses.replace(hardware_profile("H100-SXM"), device="cpu", kernel_model=False, checkpoint_overhead=overhead)
    return se.plan_estimator(model, x, y, hardware=hw)(plan).step_time_s


@pytest.mark.parametrize("case", ["none", "blocks", "chunks of 1", "chunks of 2", "chunks of 8"])
def test_the_step_grows_by_calls_times_the_cost_per_call(stand_in, case):
    model, x, y, plain, blocks = stand_in
    # by hand: three blocks (each Linear with the neuron after it; the head alone), each called once per time step;
    # time chunks checkpoint every call of `net`, once per time step, whatever the chunk size
    plan, calls, key = {"none": (plain, 0, "blocks"), "blocks": (blocks, 3 * T, "blocks"),
                        "chunks of 1": (chunked(plain, "net", 1), T, "time_chunks"),
                        "chunks of 2": (chunked(plain, "net", 2), T, "time_chunks"),
                        "chunks of 8": (chunked(plain, "net", 8), T, "time_chunks")}[case]
    without, with_cost = _step_s(model, x, y, plan, {}), _step_s(model, x, y, plan, COST)
    assert with_cost - without == pytest.approx(calls * COST[key], rel=1e-9, abs=1e-15)


def test_datasheet_profiles_state_no_checkpoint_cost():
    for name in ("H100-SXM", "RTX-4090"):
        assert dict(hardware_profile(name).checkpoint_overhead) == {}


@pytest.mark.parametrize("bad", [{"block": 1e-3}, {"ops": 1e-3}, {"blocks": -1e-3}, {"time_chunks": "1"},
                                 {"blocks": True}])
def test_a_checkpoint_cost_of_no_granularity_or_no_seconds_is_refused(bad):
    with pytest.raises(ValueError, match=r"checkpoint_overhead\[.*expected seconds >= 0 per call"):
        dataclasses.replace(hardware_profile("H100-SXM"), checkpoint_overhead=bad)
    kept = dataclasses.replace(hardware_profile("H100-SXM"), checkpoint_overhead={"blocks": 1, "time_chunks": 2e-4})
    assert kept.checkpoint_overhead == {"blocks": 1.0, "time_chunks": 2e-4}
