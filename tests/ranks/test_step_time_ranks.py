"""Step time: hardware profiles, the alpha-beta calibration, the compute roofline and the overlap rules.
(The tests in one process: tests/unit/test_step_time.py.)"""
import json

import pytest

import snn_explorer as se
from snn_explorer.estimator import enumerate_plans, estimate
from snn_explorer.estimator.timing.hardware import KINDS, HardwareProfile
from snn_explorer.zoo import build


def test_calibrate_on_real_ranks_and_json_round_trip(tmp_path):
    heard = []
    hw = se.calibrate(group_sizes=(2,), backend="gloo", on_progress=lambda *piece: heard.append(piece))
    assert hw.source.startswith("calibrated on") and hw.host
    # the hook heard rank 0's pieces as they came (a poll may bring two at once: the later is told), then the end
    total = heard[-1][1]
    assert [d for d, _, _ in heard] == sorted({d for d, _, _ in heard}) and heard[-1][0] == total > len(KINDS)
    assert len(heard) >= 3 and all(label.startswith("calibrating this machine: ") for *_, label in heard), heard
    assert any(label.endswith(f"2 ranks: {kind} timed") for *_, label in heard for kind in KINDS), heard
    for kind in KINDS:
        alpha, beta = hw.collectives[kind][2]
        assert alpha >= 0 and beta > 0
        # a bigger buffer takes longer, and time is alpha plus bytes times beta
        assert hw.collective_time(kind, 2, 2 ** 22) > hw.collective_time(kind, 2, 2 ** 10)
    assert hw.flops_per_s > 1e8 and hw.bytes_per_s > 1e8 and hw.op_overhead_s > 0
    # every pipeline schedule ran on the ranks and has its cost per action; ZeRO-like broadcast bursts were timed
    from snn_explorer.core.planning import SCHEDULES

    costs = hw.framework_overhead[2]
    assert {f"pp_{cost}:{name}" for name in SCHEDULES for cost in ("action", "link")} | {"broadcast_in_burst"} \
        <= set(costs)
    assert min(costs.values()) >= 0 and costs["broadcast_in_burst"] > 0
    # the checkpointing machinery's cost per checkpointed call, timed in this process (calibration.checkpoint_call)
    assert set(hw.checkpoint_overhead) == {"blocks", "time_chunks"} and min(hw.checkpoint_overhead.values()) >= 0
    # on the machine it was calibrated on, the measured unsharded step corrects the model's phases
    zoo = build("mlp")
    plan = enumerate_plans(se.analyze(zoo.model), world_size=2, batch_size=zoo.batch_size)[0]
    row = estimate(zoo.model, plan, example_input=zoo.example_input, labels=zoo.labels, hardware=hw).time.iloc[0]
    assert row.step_s >= row.compute_s > 0 and row.exposed_comm_s > 0
    hw.save(tmp_path / "hw.json")
    assert HardwareProfile.load(tmp_path / "hw.json") == hw
    json.loads((tmp_path / "hw.json").read_text())


@pytest.fixture(scope="module")
def mlp():
    zoo = build("mlp")
    return zoo, {p.mode: p for p in enumerate_plans(se.analyze(zoo.model, model_family=zoo.family), world_size=2,
                                                    batch_size=zoo.batch_size)}
