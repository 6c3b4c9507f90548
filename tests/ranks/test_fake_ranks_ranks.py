"""record_rank_step: a plan's step on one rank of torch's fake process group, on FakeTensors: its
collectives recorded as issued and its peak as torch's MemTracker follows it, nothing allocated. First
shown equal to what measure() gets on real gloo ranks; then the estimate is checked against it, also at
world sizes and model sizes this machine cannot spawn or hold.
(The tests in one process: tests/unit/test_fake_ranks.py.)"""
import pytest
from test_fake_ranks import _rows, _sharded_plans

from snn_explorer.estimator import measure_many, record_rank_step
from snn_explorer.zoo import build


@pytest.mark.timeout(300)
def test_a_fake_rank_sees_what_a_real_gloo_rank_measures():
    """The MLP's fsdp2 and tp plans on 2 real gloo ranks (measure) and on rank 0 of a fake group:
    the same collectives row for row, the same tracked peak to 0.5 % (gloo's worker thread may hold a
    finished collective's buffer a moment longer on a real rank)."""
    zoo = build("mlp")
    plans = _sharded_plans(zoo.model, 2, zoo.example_input.shape[1], zoo.family)
    assert {p.mode for p in plans} == {"fsdp2", "tp"}
    measured = measure_many(zoo.model, plans, example_input=zoo.example_input, labels=zoo.labels, steps=1,
                            timeout=240)
    for plan, real in zip(plans, measured):
        fake = record_rank_step(zoo.model, plan, zoo.example_input, zoo.labels)
        assert len(fake.collectives) and (fake.collectives["bytes"] > 0).all(), plan  # it communicated
        assert _rows(fake.collectives) == _rows(real.collectives), plan
        real_peak = int(real.per_rank["peak_bytes"].iloc[0])
        assert fake.peak_bytes == pytest.approx(real_peak, rel=0.005), plan
