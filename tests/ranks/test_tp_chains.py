"""TP of Linear chains of any length (1, 2, 3, 10) with neurons, dropout and identity between.
(The tests in one process: tests/unit/test_tp_chains_unit.py.)"""
import pytest
import snntorch
import torch
from distributed_harness import run_on_ranks
from models import TimeLoop
from torch import nn

import snn_explorer as se
from snn_explorer.zoo import lif

WIDTH = 16


def chain_model(n_linears: int, seed: int = 0) -> nn.Module:
    """Linear layers with a stateful neuron, dropout(p=0) or identity between, stepped over time."""
    torch.manual_seed(seed)
    layers = []
    between = [lambda: lif(0.8), lambda: nn.Dropout(0.0), nn.Identity]
    for i in range(n_linears):
        layers.append(nn.Linear(WIDTH, WIDTH))
        with torch.no_grad():  # strong enough that all ten layers keep spiking
            layers[-1].weight.mul_(2.0)
            layers[-1].bias.fill_(0.3)
        if i < n_linears - 1:
            layers.append(between[i % 3]())
            if i % 3:
                layers.append(lif(0.8))
    return TimeLoop(nn.Sequential(*layers, lif(0.8)))


def chain_input():
    g = torch.Generator().manual_seed(3)
    return torch.rand(6, 4, WIDTH, generator=g, dtype=torch.float64) * 2


def _run_chains(tp_size):
    out = {}
    for n in (1, 2, 3, 10):
        ref_model = chain_model(n).double()
        x = chain_input()
        se.core.model.neurons.reset_all(ref_model)
        per_neuron = {}
        for name, m in ref_model.named_modules():
            if isinstance(m, snntorch.SpikingNeuron):
                m.register_forward_hook(lambda _m, _i, o, name=name: per_neuron.setdefault(name, []).append(
                    float(o.mean())))
        with torch.no_grad():
            ref = ref_model(x)
        spikes = [sum(v) / len(v) for v in per_neuron.values()]
        model = chain_model(n).double()
        plan = se.plan(analysis=se.analyze(model), objective="memory", topology={"tp": tp_size},
                       backend="torch", batch_size=4, mode="tp")
        runtime = se.apply(model=model, plan=plan, device_type="cpu")
        runtime.reset_state()
        got = runtime.model(x)
        got.sum().backward()
        local_widths = {name: runtime.module.get_submodule(name).mem.shape[-1]
                        for name, style in plan.tensor_parallel_plan.items() if style == "local"}
        out[n] = dict(ref=ref, got=got.detach(), spikes=spikes, local=local_widths)
    return out


@pytest.mark.parametrize("tp_size", [2, 4])
def test_chains_equal_unsharded(tp_size):
    results = run_on_ranks(_run_chains, tp_size, tp_size, timeout=90)
    for rank, per_n in enumerate(results):
        for n, res in per_n.items():
            rate = sum(res["spikes"]) / len(res["spikes"])
            assert 0.02 <= min(res["spikes"]) and max(res["spikes"]) <= 0.98 and 0.05 <= rate, \
                f"chain {n}: spike rates {min(res['spikes']):.3f}..{max(res['spikes']):.3f} make it vacuous"
            assert (res["got"] - res["ref"]).abs().max() <= 1e-9, f"rank {rank}, chain of {n} differs"
            for name, width in res["local"].items():
                assert width == WIDTH // tp_size, f"{name} state is not the local shard"
            if n >= 2:
                assert res["local"], f"chain {n}: expected neurons with local sharded state"


def _state_does_not_leak():
    import snn_explorer as se
    from snn_explorer.zoo import build

    zoo = build("mlp")
    plan = se.plan(analysis=se.analyze(zoo.model), objective="memory", topology={"tp": 2}, backend="torch",
                   batch_size=zoo.batch_size)
    runtime = se.apply(model=zoo.model, plan=plan, device_type="cpu")
    crit = nn.CrossEntropyLoss()
    with torch.no_grad():
        _, first = runtime.forward_loss(crit, zoo.example_input, zoo.labels)
        _, again = runtime.forward_loss(crit, zoo.example_input, zoo.labels)
        _, leaked = runtime.forward_loss(crit, zoo.example_input, zoo.labels, reset=False)
        runtime.reset_state()
        mems = [m.mem for m in runtime.module.modules() if isinstance(m, snntorch.SpikingNeuron)]
    return dict(same=bool(torch.equal(first, again)), leaked_differs=not torch.allclose(first, leaked),
                zero_after_reset=all(bool((m == 0).all()) for m in mems), nonconstant=float(first.std()))


def test_neuron_state_reset_between_batches():
    for res in run_on_ranks(_state_does_not_leak, 2, timeout=60):
        assert res["nonconstant"] > 1e-3
        assert res["same"], "reset_state did not clear neuron state between batches"
        assert res["leaked_differs"], "without reset the state should carry over (the test would be vacuous)"
        assert res["zero_after_reset"]


def _wrong_input_is_caught():
    import snn_explorer as se

    model = chain_model(2)
    plan = se.plan(analysis=se.analyze(model), objective="memory", topology={"tp": 2}, backend="torch",
                   batch_size=4, mode="tp")
    runtime = se.apply(model=model, plan=plan, device_type="cpu")
    neuron = runtime.module.get_submodule([n for n, s in plan.tensor_parallel_plan.items() if s == "local"][0])
    try:
        neuron(torch.zeros(4, WIDTH))  # a full-width input: not this rank's shard
    except RuntimeError as exc:
        return str(exc)
    return None


def test_local_neuron_checks_its_input_is_the_shard():
    for message in run_on_ranks(_wrong_input_is_caught, 2, timeout=60):
        assert message is not None and "expects inputs with 8 features" in message
