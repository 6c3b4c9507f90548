"""The data layout's detection and the time-step module are found once per model object while its structure stays
the same (core.model_memo): asked again of the same model (as a second fit_budget asks), neither runs again, and the
answers are the same; a change to a module, its configuration, hooks or parameter shapes asks again."""
import torch
from torch import nn

from snn_explorer.core.levers import find_time_step_module, memory_levers
from snn_explorer.core.model import detect_layout, layouts, neurons, structure_key
from snn_explorer.zoo import SpikingMLP


def _counting(monkeypatch):
    copies, copy_ = [], neurons.detached_copy

    def counted(model):
        copies.append(model)
        return copy_(model)
    monkeypatch.setattr(layouts, "detached_copy", counted)
    monkeypatch.setattr(memory_levers.neurons, "detached_copy", counted)
    return copies


def test_answers_are_kept_until_the_structure_changes(monkeypatch):
    copies = _counting(monkeypatch)
    torch.manual_seed(0)
    model, x = SpikingMLP(4, (8, 8), 3, stepping="per_step"), torch.rand(5, 2, 4)
    first = detect_layout(model, x, neurons.reset_all, assume="time_major")
    step = find_time_step_module(model, x)
    assert (first[0].input, step, len(copies)) == ("time_major", "net", 2)  # non-trivial answers, each from a run
    model(x[0])  # neuron state changes: not the structure
    assert detect_layout(model, x, neurons.reset_all, assume="time_major") == first
    assert find_time_step_module(model, x) == step and len(copies) == 2
    assert detect_layout(model, x[:, :1], neurons.reset_all, assume="time_major") and len(copies) == 3  # new shape
    changes = [lambda: model.net[0].register_forward_hook(lambda *a: None),
               lambda: setattr(model.net[1], "reset_delay", False),
               lambda: setattr(model, "extra", nn.Linear(2, 2)),
               lambda: setattr(model.net, "0", nn.Linear(4, 8)),  # replaced by one of the same shape
               lambda: model.train(False)]
    for change in changes:
        before = structure_key(model)
        change()
        assert structure_key(model) != before
        count = len(copies)
        assert find_time_step_module(model, x) == step and len(copies) == count + 1


def test_a_spikingjelly_step_mode_or_a_configuration_changed_in_place_asks_again():
    from spikingjelly.activation_based import functional, layer, neuron  # lazy: spikingjelly only for this test

    net = nn.Sequential(layer.Linear(4, 4), neuron.LIFNode())
    net.cfg = {"width": 4}
    keys = [structure_key(net)]
    net(torch.rand(2, 4))  # a single-step run changes neuron state only
    assert structure_key(net) == keys[0]
    functional.set_step_mode(net, "m")  # kept in the private _step_mode
    keys.append(structure_key(net))
    net.cfg["width"] = 8  # the same dict, changed in place
    keys.append(structure_key(net))
    assert len(set(keys)) == 3
    for model in (SpikingMLP(4, (8,), 3), SpikingMLP(4, (8,), 3, stepping="all_steps")):
        before = structure_key(model)
        model(torch.rand(5, 2, 4))
        assert structure_key(model) == before  # no private counter a run changes
