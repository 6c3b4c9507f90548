"""A tutorial-style snntorch net that returns ``(spikes, membranes)`` is estimated and trained on its spikes by
default, on its membranes with ``output=1``, and anything else it might return is refused in one message."""
import pytest
import snntorch
import torch
from torch import nn

import snn_explorer as se
from snn_explorer.core.model.layouts import model_output


class TutorialNet(nn.Module):
    """The snntorch tutorials' shape: explicit membranes, a loop over the steps, ``(spk_rec, mem_rec)`` out."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(12, 16), nn.Linear(16, 3)
        self.lif1 = snntorch.Leaky(beta=0.9)
        self.lif2 = snntorch.Leaky(beta=0.9)
        with torch.no_grad():  # positive weights: both layers fire
            self.fc1.weight.uniform_(0.0, 0.5)
            self.fc2.weight.uniform_(0.0, 0.3)

    def forward(self, x):
        mem1, mem2 = self.lif1.init_leaky(), self.lif2.init_leaky()
        spk_rec, mem_rec = [], []
        for step in range(x.shape[0]):
            spk1, mem1 = self.lif1(self.fc1(x[step]), mem1)
            spk2, mem2 = self.lif2(self.fc2(spk1), mem2)
            spk_rec.append(spk2)
            mem_rec.append(mem2)
        return torch.stack(spk_rec), torch.stack(mem_rec)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.rand(5, 4, 12, generator=g) * 3, torch.tensor([0, 1, 2, 1])


def test_model_output_takes_a_tensor_or_the_chosen_element_and_names_anything_else():
    a, b = torch.zeros(2), torch.ones(2)
    assert model_output(a) is a and model_output((a, b)) is a and model_output([a, b], 1) is b
    with pytest.raises(ValueError, match=r"output=2 picks no element of the model's 2 outputs; expected an index in "
                                         r"0\.\.1"):
        model_output((a, b), 2)
    with pytest.raises(TypeError, match=r"the model returned a dict; expected a tensor, or a tuple of tensors"):
        model_output({"spikes": a})
    with pytest.raises(TypeError, match=r"the model returned a tuple of Tensor, int per step; expected"):
        model_output((a, 3), where="per step")


def test_the_runtime_trains_on_the_spikes_by_default_and_on_the_membranes_when_asked():
    x, y = _batch()
    model = TutorialNet()
    spikes, membranes = model(x)
    assert spikes.sum() > 0  # the net fires: its spikes are not all zero
    plan = se.plan(analysis=se.analyze(model), objective="speed", topology=1, batch_size=4)
    runtime = se.apply(model=model, plan=plan, device_type="cpu")
    criterion = nn.CrossEntropyLoss()
    loss, out = runtime.forward_loss(criterion, x, y)
    torch.testing.assert_close(out, spikes)
    torch.testing.assert_close(loss, criterion(spikes.mean(0), y))
    loss, out = runtime.forward_loss(criterion, x, y, output=1)
    torch.testing.assert_close(out, membranes)
    torch.testing.assert_close(loss, criterion(membranes.mean(0), y))


def test_estimate_takes_the_spikes_of_a_tuple_output():
    x, y = _batch()
    model = TutorialNet()
    plan = se.plan(analysis=se.analyze(model), objective="speed", topology=1, batch_size=4)
    est = se.estimate(model, plan, example_input=x, labels=y, hardware="A100-SXM-80GB")
    assert est.peak_bytes > 0 and est.step_time_s > 0 and est.data_layout.output == "time_major"
