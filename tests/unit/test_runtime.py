"""Runtime helpers: data loading over the dp coordinate, output preparation, optimizer choice.
(The tests on gloo ranks: tests/ranks/test_runtime_ranks.py.)"""
import pytest
import torch
from torch import nn

import snn_explorer as se


def _single_rank_runtime():
    model = nn.Linear(4, 3)
    plan = se.plan(analysis=se.analyze(model), objective="speed", topology=1, backend="torch", batch_size=4)
    return se.apply(model=model, plan=plan, device_type="cpu")


@pytest.mark.parametrize("labels", [torch.tensor([0, 2]), torch.tensor([[0], [2]]),
                                    torch.nn.functional.one_hot(torch.tensor([0, 2]), 3).float()])
def test_prepare_classification_output_normalises_labels(labels):
    outputs = torch.arange(18, dtype=torch.float32).reshape(3, 2, 3)  # [T, N, C]
    prepared, idx = _single_rank_runtime().prepare_classification_output(outputs, labels)
    assert torch.equal(prepared, outputs.mean(0)) and idx.tolist() == [0, 2] and idx.dtype == torch.long


def test_forward_loss_resets_state_and_returns_outputs():
    from snn_explorer.zoo import build

    zoo = build("mlp")
    plan = se.plan(analysis=se.analyze(zoo.model), objective="speed", topology=1, backend="torch",
                   batch_size=zoo.batch_size)
    runtime = se.apply(model=zoo.model, plan=plan, device_type="cpu")
    loss, out = runtime.forward_loss(nn.CrossEntropyLoss(), zoo.example_input, zoo.labels)
    again, out2 = runtime.forward_loss(nn.CrossEntropyLoss(), zoo.example_input, zoo.labels)
    assert out.shape == (zoo.time_steps, zoo.batch_size, zoo.num_classes) and out.std() > 0
    assert torch.equal(out, out2) and loss.item() == again.item()


def _per_step_cross_entropy(outputs, labels):
    """A criterion written for ``[T, N, C]`` outputs: cross-entropy at every time step."""
    t = outputs.shape[0]
    return nn.functional.cross_entropy(outputs.flatten(0, 1), labels.repeat(t))


def test_forward_loss_reduce_time_chooses_what_the_criterion_sees():
    from snn_explorer.zoo import build

    zoo = build("mlp")
    plan = se.plan(analysis=se.analyze(zoo.model), objective="speed", topology=1, backend="torch",
                   batch_size=zoo.batch_size)
    runtime = se.apply(model=zoo.model, plan=plan, device_type="cpu")
    seen = []
    with pytest.raises((RuntimeError, ValueError)):  # the default mean over time hands the per-step criterion [N, C]
        runtime.forward_loss(lambda out, y: seen.append(out.shape) or _per_step_cross_entropy(out, y),
                             zoo.example_input, zoo.labels)
    assert seen == [(zoo.batch_size, zoo.num_classes)]
    loss, out = runtime.forward_loss(_per_step_cross_entropy, zoo.example_input, zoo.labels, reduce_time=None)
    assert torch.isclose(loss, _per_step_cross_entropy(out, zoo.labels))
    mean_loss, _ = runtime.forward_loss(nn.CrossEntropyLoss(), zoo.example_input, zoo.labels)
    assert torch.isclose(mean_loss, nn.functional.cross_entropy(out.mean(0), zoo.labels))
    assert not torch.isclose(loss, mean_loss), "the two reductions must differ on this model"
    with pytest.raises(ValueError, match=r"reduce_time='sum'; expected one of \('mean', None\)"):
        runtime.forward_loss(nn.CrossEntropyLoss(), zoo.example_input, zoo.labels, reduce_time="sum")


def test_train_step_backpropagates_the_loss_it_returns():
    from snn_explorer.zoo import build

    zoo = build("mlp")
    reference = __import__("copy").deepcopy(zoo.model)
    plan = se.plan(analysis=se.analyze(zoo.model), objective="speed", topology=1, batch_size=zoo.batch_size)
    runtime = se.apply(model=zoo.model, plan=plan, device_type="cpu")
    loss = runtime.train_step(nn.CrossEntropyLoss(), zoo.example_input, zoo.labels)
    expected, _ = se.apply(model=reference, plan=plan, device_type="cpu").forward_loss(
        nn.CrossEntropyLoss(), zoo.example_input, zoo.labels)
    expected.backward()
    assert not loss.requires_grad and loss.item() == expected.item()
    grads = {n: p.grad for n, p in zoo.model.named_parameters()}
    assert any(g.abs().sum() > 0 for g in grads.values()), "the step must produce non-zero gradients"
    for name, param in reference.named_parameters():
        assert torch.equal(grads[name], param.grad), name
