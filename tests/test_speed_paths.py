"""The estimator's fast paths equal the slow paths they replace, on small models (numbers exact)."""
import torch

from snn_explorer.core.neurons import stateful_modules
from snn_explorer.estimator.instruments import op_counter
from snn_explorer.estimator.profile.step import batch_slice
from snn_explorer.estimator.timing.compute_work import counted_pass
from snn_explorer.zoo import build


def _counts(model, x, y) -> list:
    """Forward and backward counts of one step, in the state counted_pass counts in (after a forward at this size)."""
    counts = counted_pass(model, x, y)
    model.zero_grad(set_to_none=True)
    return counts


def test_flops_cached_by_shape_equal_each_formula_called(monkeypatch):
    """OpCounter's FLOPs, looked up per operator and shapes, equal those of calling torch's formula for every
    operator, on a spiking transformer (matrix products, attention) forward and backward with spikes firing."""
    zoo = build("spikformer")
    x, y = batch_slice(zoo.example_input, zoo.labels, 2, 2)
    spikes = []
    neuron = next(m for _, m in stateful_modules(zoo.model))
    handle = neuron.register_forward_hook(lambda m, i, out: spikes.append(float(out.detach().sum())))
    _counts(zoo.model, x, y)  # the model's first step (lazily created state) is not the one compared
    handle.remove()
    op_counter._FLOPS_OF_SHAPES.clear()
    cold = _counts(zoo.model, x, y)
    warm = _counts(zoo.model, x, y)  # every shape seen: all from the cache
    monkeypatch.setattr(op_counter, "flop_formula_reads_shapes_only", lambda formula: False)
    called = _counts(zoo.model, x, y)
    assert cold[0][0] > 0 and cold[1][0] > cold[0][0] and spikes and all(s > 0 for s in spikes)
    assert cold == warm == called
    assert len(op_counter._FLOPS_OF_SHAPES) > 0


def test_shape_key_tells_lists_tuples_and_tensors_apart():
    t = torch.zeros(2, 3)
    assert op_counter.shape_key((t, [1, 2])) != op_counter.shape_key((t, (1, 2)))
    assert op_counter.shape_key(t) == op_counter.shape_key(torch.ones(2, 3)) != op_counter.shape_key(torch.ones(3, 2))
