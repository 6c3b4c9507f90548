"""The explorer's control-change fast paths equal the slow paths they replace (numbers exact, small models)."""

import torch

import snn_explorer as se
from snn_explorer.core.model import detached_copy, reset_all, shared_storage_copy, stateful_modules
from snn_explorer.estimator.profile.step import forward_loss
from snn_explorer.zoo import SpikingMLP, build
from snn_explorer.zoo.llm import build_llm, token_batch


def _cases():
    torch.manual_seed(0)
    llm = build_llm("spiking-llm-tiny", n_layers=3, tied_embeddings=True)
    for name in ("mlp", "mlp_all_steps", "vgg", "spikformer"):
        zoo = build(name)
        yield name, zoo.model, zoo.example_input, zoo.labels
    yield "deep mlp", SpikingMLP(16, (16,) * 12, 8, stepping="all_steps"), torch.rand(3, 4, 16), None
    yield "tied llm", llm, token_batch(llm.config, 2, 2, 4), torch.randint(0, llm.config.vocab_size, (2, 4))


def _outputs(model, x, y) -> tuple:
    """Output, loss (the estimator's) and parameter gradients of one step from fresh neuron state."""
    reset_all(model)
    torch.manual_seed(1)
    outs = []
    handle = model.register_forward_hook(lambda m, i, o: outs.append(o))
    loss = forward_loss(model, x, y)
    handle.remove()
    loss.backward()
    out = outs[0]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.detach(), loss.detach(), grads


def test_shared_storage_copy_equals_a_detached_deep_copy_but_shares_the_weights():
    """On the zoo models, a deep MLP (snntorch neurons) and a tied-embedding spiking LLM, after a forward left
    neuron state with autograd history: the copy has the deep copy's modules, parameter and buffer names and
    values, tied weights still tied, and computes the same outputs, loss and gradients (spikes firing); its
    parameters are new objects over the original's storage, its buffers and gradients its own."""
    for name, model, x, y in _cases():
        model(x)  # neuron state now holds tensors with autograd history
        deep, shared = detached_copy(model), shared_storage_copy(model)
        assert repr(shared) == repr(deep), name
        params = dict(model.named_parameters(remove_duplicate=False))
        for (n, p), (n2, q) in zip(deep.named_parameters(remove_duplicate=False),
                                   shared.named_parameters(remove_duplicate=False)):
            assert n == n2 and torch.equal(p, q) and q.requires_grad == p.requires_grad, (name, n)
            assert q is not params[n] and q.data_ptr() == params[n].data_ptr(), (name, n)
        assert [n for n, _ in shared.named_parameters()] == [n for n, _ in deep.named_parameters()], name
        for (n, b), (n2, c), orig in zip(deep.named_buffers(), shared.named_buffers(), model.buffers()):
            assert n == n2 and torch.equal(b, c) and c.data_ptr() != orig.data_ptr(), (name, n)
        spikes = []
        for copy_ in (deep, shared):
            hooks = [m.register_forward_hook(lambda m, i, o: spikes.append(float((o[0] if isinstance(o, tuple)
                                                                                  else o).detach().sum())))
                     for _, m in stateful_modules(copy_)]
            out = _outputs(copy_, x, y)
            for h in hooks:
                h.remove()
            if copy_ is deep:
                ref = out
        assert any(s > 0 for s in spikes), f"{name}: no spike fired"
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]) and out[2].keys() == ref[2].keys(), name
        assert all(torch.equal(out[2][k], ref[2][k]) for k in ref[2]), name
        assert all(p.grad is None for p in model.parameters()), f"{name}: the original got gradients"


def _old_fsdp_units(model) -> tuple:
    """fsdp_units as written before the walk kept which modules hold parameters (any(module.parameters()))."""
    has = lambda m: any(True for _ in m.parameters())  # noqa: E731
    children = [(n, c) for n, c in model.named_children() if has(c)]
    if len(children) == 1 and next(iter(children[0][1].children()), None) is not None:
        name, child = children[0]
        children = [(f"{name}.{n}", c) for n, c in child.named_children() if has(c)]

    def units(path, module):
        split = isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)) or (
            isinstance(module, torch.nn.Sequential) and len(module) > 1
            and any(next(iter(c.children()), None) is not None for c in module.children()))
        if not split:
            return (path,)
        return tuple(u for n, c in module.named_children() if has(c)
                     for u in (units(f"{path}.{n}", c) if isinstance(c, (torch.nn.ModuleList, torch.nn.ModuleDict))
                               else (f"{path}.{n}",)))
    return tuple(u for path, child in children for u in units(path, child))


def test_analysis_from_one_walk_of_parameters_equals_the_direct_walks():
    """analyze()'s trainable count, tied-weight groups, trainable pipeline units and FSDP2 units, read from one
    memoized walk of the model's parameters, equal those computed by walking the model directly, on the zoo
    models, a deep MLP with a frozen layer and a tied-embedding spiking LLM."""
    shared_groups = []  # (case name, its analysis' tied-weight groups), in case order
    for name, model, _, _ in _cases():
        if name == "deep mlp":
            model.net[0].weight.requires_grad_(False)
        analysis = se.analyze(model)
        shared_groups.append((name, analysis.shared_parameter_groups))
        assert analysis.trainable_parameters == sum(p.numel() for p in model.parameters() if p.requires_grad) > 0
        groups = {}
        for path, param in model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(param), []).append(path)
        assert analysis.shared_parameter_groups == tuple(tuple(g) for g in groups.values() if len(g) > 1), name
        holders = {".".join(n.split(".")[:i]) for n, p in model.named_parameters(remove_duplicate=False)
                   if p.requires_grad for i in range(1, len(n.split(".")))}
        assert analysis.trainable_units == tuple(u for u in analysis.pipeline_units if u in holders), name
        assert analysis.fsdp_unit_names == _old_fsdp_units(model) and analysis.fsdp_unit_names, name
        assert analysis.explicit_state_names == tuple(
            n for n, m in model.named_modules() if n and "snntorch" in type(m).__module__
            and not getattr(m, "init_hidden", True)), name
    assert shared_groups[0][1] == ()  # the first case ties nothing; the tied LLM's groups are not empty
    assert any(groups for name, groups in shared_groups if name == "tied llm")
