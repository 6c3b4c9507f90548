"""snn_explorer.compat on real gloo ranks: measure() on two ranks matches the estimate in every two-rank mode,
and every wait of torch's pipeline schedules goes through the name pipeline_waits wraps (the code paths of the
private torch names that only ranks run). CI runs this file, with tests/unit/test_compat.py,
on each torch of ``compat.TESTED_TORCH`` (scripts/test.sh, scripts/test_torch_next.sh)."""
import pytest
import torch
from torch import nn

import snn_explorer as se
from snn_explorer.estimator import estimate, measure_many

# --- the names on the code paths that use them ------------------------------------------------


def _plain():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)), torch.randn(3, 4, 16), torch.arange(4) % 8


def test_measure_on_two_ranks_matches_the_estimate_in_every_two_rank_mode():
    """measure(): MemTracker and its restarted peak, DDP's logging data, DTensor's local tensors,
    FSDP2's base all-gather / reduce-scatter ops, the mesh's group names, and a pipeline stage's p2p
    op builders and receive buffers, all on real ranks."""
    model, x, y = _plain()
    analysis = se.analyze(model)
    plans = [p for p in se.enumerate_plans(analysis, world_size=2, batch_size=4) if p.optimizer_strategy == "none"]
    assert {p.mode for p in plans} == {"dp", "fsdp2", "tp", "pp"}
    measured = measure_many(model, plans, example_input=x, labels=y, steps=2, optimizer="adam", timeout=240)
    for plan, meas in zip(plans, measured):
        est = estimate(model, plan, example_input=x, labels=y, optimizer="adam")
        for col in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            assert list(est.per_rank[col]) == list(meas.per_rank[col]), (plan, col)
        rows = lambda t: sorted(map(tuple, t[["mesh_dim", "kind", "phase", "count", "bytes"]].values.tolist()))
        assert rows(est.collectives) == rows(meas.collectives), plan
        assert meas.peak_bytes > 0
        if plan.mode == "dp":
            assert meas.per_rank["transient_bytes"].iloc[0] == est.collectives["bytes"].sum()


def _pipeline_waits_on_rank():
    import torch.distributed as dist

    from snn_explorer.core.planning import SCHEDULES
    from snn_explorer.estimator.calibration.step_probes import pipeline_step_times

    torch.set_num_threads(1)
    return {name: pipeline_step_times(dist, torch.device("cpu"), SCHEDULES[name], heavy)
            for name, heavy in (("1f1b", 1), ("interleaved", 24))}


@pytest.mark.timeout(120)
def test_pipeline_waits_time_the_schedules_waits_for_transfers():
    """Every wait of torch's schedules goes through the name pipeline_waits wraps: on 2 ranks each
    rank waits some of its step, never all; with rank 0's blocks 24 times the work under
    interleaved 1F1B, rank 1 waits for rank 0 longer than rank 0 for rank 1."""
    from snn_explorer.ranks import run

    values = run(_pipeline_waits_on_rank, nprocs=2, backend="gloo", timeout=60).values
    for probe in ("1f1b", "interleaved"):
        assert all(0 < v[probe]["waited"] < v[probe]["step"] for v in values), probe
    assert values[1]["interleaved"]["waited"] > values[0]["interleaved"]["waited"]
