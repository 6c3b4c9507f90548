"""Model families on real ranks: zoo Spikformer (head-aligned attention TP behind its gate) and DVS VGG.

Each TP-using mode equals the unsharded model in outputs and gradients (float64), with every
neuron, attention's included, firing at 2-98 %. With a dp dim the models run in eval mode, since
BatchNorm's training statistics are per rank under data parallelism (the plan notes this).
"""
import pytest
import snntorch
from distributed_harness import run_on_ranks
from models import gather_over_dp
from torch import nn


def _rates(model):
    rates = {}
    for name, m in model.named_modules():
        if isinstance(m, snntorch.SpikingNeuron):
            m.register_forward_hook(lambda _m, _i, o, name=name: rates.setdefault(name, []).append(float(o.mean())))
    return rates


def _one_step(zoo_name, topology, mode, gates):
    import snn_explorer as se
    from snn_explorer.zoo import build, reset_state

    crit = nn.CrossEntropyLoss()
    ref = build(zoo_name).model.double()
    zoo = build(zoo_name)
    if "dp" in topology:  # BatchNorm batch statistics are per rank under dp: compare with running stats
        ref.eval()
        zoo.model.eval()
    x, y = zoo.example_input.double(), zoo.labels
    rates = _rates(ref)
    reset_state(ref)
    ref_out = ref(x)
    crit(ref_out.mean(0), y).backward()
    model = zoo.model.double()
    plan = se.plan(analysis=se.analyze(model, model_family=zoo.family), objective="memory", topology=topology,
                   neuron_backend="torch", batch_size=zoo.batch_size, mode=mode,
                   features=se.DistributedFeatureSet(**gates))
    runtime = se.apply(model=model, plan=plan, device_type="cpu")
    share, start = plan.per_rank_batch, runtime.dp_rank * plan.per_rank_batch
    loss, out = runtime.forward_loss(crit, x[:, start:start + share], y[start:start + share])
    loss.backward()
    out = gather_over_dp(runtime, out)
    grads = runtime.full_gradients()
    errors = {"outputs": float((out.detach() - ref_out.detach()).abs().max())}
    errors.update({f"grad {n}": float((grads[n] - p.grad).abs().max()) for n, p in ref.named_parameters()})
    return dict(errors=errors, rates={n: sum(v) / len(v) for n, v in rates.items()},
                plan=dict(plan.tensor_parallel_plan), out_std=float(ref_out.std()))


CASES = [
    ("spikformer", {"tp": 2}, "tp", {"allow_experimental_spikformer_tp": True}),
    ("spikformer", {"tp": 4}, "tp", {"allow_experimental_spikformer_tp": True}),
    ("spikformer", {"dp": 2, "tp": 2}, "fsdp2_tp", {"allow_experimental_spikformer_tp": True}),
    ("spikformer", {"tp": 2}, "tp", {}),
    ("vgg", {"tp": 2}, "tp", {}),
    ("vgg", {"dp": 2, "tp": 2}, "fsdp2_tp", {}),
    ("vgg", {"tp": 2}, "tp", {"allow_experimental_conv_tp": True}),
    ("vgg", {"tp": 4}, "tp", {"allow_experimental_conv_tp": True}),
    ("vgg", {"dp": 2, "tp": 2}, "fsdp2_tp", {"allow_experimental_conv_tp": True}),
    ("spikformer", {"tp": 2}, "tp", {"allow_experimental_conv_tp": True, "allow_experimental_spikformer_tp": True}),
]


@pytest.mark.parametrize("name,topology,mode,gates", CASES,
                         ids=[f"{n}-{m}-{'x'.join(map(str, t.values()))}{'-gated' if g else ''}"
                              for n, t, m, g in CASES])
def test_family_tp_equals_unsharded(name, topology, mode, gates):
    world = 1
    for size in topology.values():
        world *= size
    results = run_on_ranks(_one_step, world, name, topology, mode, gates, timeout=120)
    first = results[0]
    assert first["out_std"] > 1e-3
    for layer, rate in first["rates"].items():
        assert 0.02 <= rate <= 0.98, f"{layer} spikes at {rate:.3f}: the comparison would be vacuous"
    if name == "spikformer":
        assert any("attn_lif" in n for n in first["rates"]), "attention neurons must be among the checked"
        styles = {first["plan"][p] for p in first["plan"] if p.endswith("attn.q")}
        assert styles == ({"colwise"} if gates.get("allow_experimental_spikformer_tp") else {"colwise_gather"})
    conv_styles = {s for s in first["plan"].values() if s.startswith("conv_") or s == "norm_local"}
    assert conv_styles == ({"conv_colwise", "conv_rowwise", "norm_local"} if gates.get("allow_experimental_conv_tp")
                           else set())
    for rank, res in enumerate(results):
        for what, err in res["errors"].items():
            assert err <= 1e-9, f"rank {rank}: {what} differs by {err:.3g}"
