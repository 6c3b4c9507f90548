"""StorageMeter counts like torch's MemTracker; estimates are identical in fresh processes."""
import json
import os
import subprocess
import sys

import pytest
import torch

from snn_explorer.compat import mem_tracker_class
from snn_explorer.estimator.instruments.meter import StorageMeter
from snn_explorer.estimator.profile.step import forward_loss
from snn_explorer.zoo import build


def _step_peaks(model, x, labels):
    """(MemTracker peak, StorageMeter peak) of one forward + backward, each above its entry memory."""
    forward_loss(model, x, labels).backward()  # warm-up, so neuron state has its steady size
    model.zero_grad(set_to_none=True)
    tracker = mem_tracker_class()()
    tracker.track_external(model, x)
    with tracker:
        entry = tracker.get_tracker_snapshot()[x.device]["Total"]
        forward_loss(model, x, labels).backward()
    theirs = tracker.get_tracker_snapshot("peak")[x.device]["Total"] - entry
    model.zero_grad(set_to_none=True)
    meter = StorageMeter()
    meter.track(list(model.parameters()) + list(model.buffers()) + [x])
    with meter:
        entry = meter.current
        forward_loss(model, x, labels).backward()
    return theirs, meter.peak - entry


@pytest.mark.parametrize("name", ["mlp", "mlp_all_steps", "vgg", "spikformer"])
def test_meter_peak_equals_memtracker(name):
    zoo = build(name)
    theirs, ours = _step_peaks(zoo.model, zoo.example_input[:, :4], zoo.labels[:4] if zoo.labels is not None else None)
    assert theirs > 5 * zoo.example_input[:, :4].nbytes  # a real step, not an empty one
    assert ours == theirs


def test_meter_releases_freed_storages():
    meter = StorageMeter()
    with meter:
        a = torch.ones(1000)
        b = a * 2
        assert meter.current == 8000
        del a, b
    assert meter.current == 0 and meter.peak == 8000
    assert meter.restart_peak() == 8000 and meter.peak == 0


def _estimate_tables() -> dict:
    """Each plan's per-rank table of the zoo vgg and spikformer at 4 ranks, by model name and plan."""
    import snn_explorer as se
    from snn_explorer.estimator import enumerate_plans, estimate
    out = {}
    for name in ("vgg", "spikformer"):
        zoo = build(name)
        for p in enumerate_plans(se.analyze(zoo.model, model_family=zoo.family), world_size=4,
                                 batch_size=zoo.batch_size):
            e = estimate(zoo.model, p, example_input=zoo.example_input, labels=zoo.labels)
            out[name + repr(p)] = e.per_rank.values.tolist()
    return out


_DUMP = """
import json, sys
sys.path.insert(0, sys.argv[1])
from test_estimate_meter import _estimate_tables
print(json.dumps(_estimate_tables()))
"""


def test_estimates_identical_in_fresh_processes():
    """Saved-activation attribution once depended on which addresses the allocator reused: the tables of a
    fresh interpreter (its own allocator, nothing allocated before) equal those of this test process (whose
    allocator holds what every earlier test left)."""
    run = subprocess.Popen([sys.executable, "-c", _DUMP, os.path.dirname(os.path.abspath(__file__))],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # the fresh process runs beside this one's own estimates
        here = json.loads(json.dumps(_estimate_tables()))  # through JSON as the fresh process's table comes
        out, err = run.communicate(timeout=300)
    finally:  # a timeout or a failure here leaves no process behind
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, err[-2000:]
    fresh = json.loads(out)
    assert len(here) >= 5 and any(row[5] > 0 for t in here.values() for row in t)
    assert fresh == here


@pytest.mark.parametrize("name", ["mlp", "spikformer"])
def test_tp_replica_has_the_local_shapes(name):
    """The model the TP peak is measured on holds each rank's parameter shapes and runs."""
    import snn_explorer as se
    from snn_explorer.estimator import enumerate_plans
    from snn_explorer.estimator.memory.sharding import tp_local_shape
    from snn_explorer.estimator.profile.tp_replica import tp_replica

    zoo = build(name)
    plan = next(p for p in enumerate_plans(se.analyze(zoo.model, model_family=zoo.family), world_size=2,
                                           batch_size=zoo.batch_size) if p.mode == "tp")
    replica = tp_replica(zoo.model, plan.tensor_parallel_plan, plan.tp_size)
    full = dict(zoo.model.named_parameters())
    local = {n: tuple(p.shape) for n, p in replica.named_parameters()}
    assert local == {n: tp_local_shape(plan, n, p.shape) for n, p in full.items()}
    assert any(local[n] != tuple(p.shape) for n, p in full.items())
    out = replica(zoo.example_input)
    assert out.shape == zoo.model(zoo.example_input).shape
