"""StorageMeter counts like torch's MemTracker; estimates are identical in fresh processes."""

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
