"""A model of one's own: snntorch's tutorial style (state passed by forward), and models the user
has already run (state with autograd history left in the modules)."""
import pytest
import torch
from torch import nn

import snn_explorer as se
from snn_explorer.core.model import detached_copy
from snn_explorer.zoo import build


def _state_tensors(model):
    """Every buffer of the model, by path, as (object id, values)."""
    return {n: (id(b), b.detach().clone()) for n, b in model.named_buffers()}


def _run_without_reset(zoo):
    """What a user does before asking for an estimate: a forward and backward, no reset."""
    out = zoo.model(zoo.example_input)
    nn.functional.cross_entropy(out.mean(0), zoo.labels).backward()
    zoo.model.zero_grad(set_to_none=True)


def test_tutorial_style_neurons_are_found_and_explained():
    zoo = build("mlp_tutorial")
    analysis = se.analyze(zoo.model)
    assert analysis.explicit_state_names == ("lif1", "lif2")
    assert analysis.memory_module_names == ()  # nothing the runtime must reset between batches
    note = next(n for n in analysis.notes if n.startswith("lif1, lif2"))
    assert "init_hidden=False" in note and "forward" in note


@pytest.mark.parametrize("name", ["mlp_tutorial", "mlp", "spikformer"])
def test_estimate_after_the_user_ran_the_model(name):
    zoo = build(name)
    _run_without_reset(zoo)
    with_history = [n for n, b in zoo.model.named_buffers() if b.grad_fn is not None]
    assert with_history, "the forward must leave state with autograd history for this test to mean anything"
    before = _state_tensors(zoo.model)
    plans = se.enumerate_plans(se.analyze(zoo.model, model_family=zoo.family), world_size=2,
                               batch_size=zoo.batch_size)
    assert plans
    for p in plans:
        est = se.estimate(zoo.model, p, example_input=zoo.example_input, labels=zoo.labels)
        assert est.peak_bytes > 0
    after = _state_tensors(zoo.model)
    assert before.keys() == after.keys()
    for n, (ident, value) in before.items():
        assert after[n][0] == ident and torch.equal(after[n][1], value), f"estimate changed the user's {n}"


def test_explorer_compares_a_tutorial_style_model_after_a_run():
    zoo = build("mlp_tutorial")
    _run_without_reset(zoo)
    ex = se.Explorer.from_zoo(zoo)
    ex.enumerate(world_size=2)
    table = ex.compare()
    assert len(table.columns) >= 3


def test_detached_copy_keeps_values_and_drops_history():
    zoo = build("mlp")
    _run_without_reset(zoo)
    copy_ = detached_copy(zoo.model)
    assert all(b.grad_fn is None for b in copy_.buffers())
    for (n, p), q in zip(zoo.model.named_parameters(), copy_.parameters()):
        assert torch.equal(p, q) and p is not q, n
    assert any(b.grad_fn is not None for b in zoo.model.buffers()), "the user's model is left as it was"
