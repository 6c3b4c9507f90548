"""spikingjelly models (the real library): detection, reset, and TP / dp equal to the unsharded model.
(The tests in one process: tests/unit/test_spikingjelly.py.)"""
import warnings

import pytest
import torch
from distributed_harness import run_on_ranks
from models import gather_over_dp
from test_spikingjelly import jelly_input, jelly_mlp, jelly_spikformer, spikformer_input
from torch import nn

sj = pytest.importorskip("spikingjelly.activation_based")  # installed by scripts/setup.sh


def _jelly_rank(step_mode, topology, mode):
    from spikingjelly.activation_based import functional

    import snn_explorer as se

    x, y = jelly_input(), torch.arange(4) % 8
    ref = jelly_mlp(step_mode).double()
    rates = []
    for m in ref.modules():
        if hasattr(m, "v_threshold"):
            m.register_forward_hook(lambda _m, _i, o: rates.append(float(o.mean())))
    functional.reset_net(ref)
    ref_out = ref(x)
    nn.functional.cross_entropy(ref_out.mean(0), y).backward()
    model = jelly_mlp(step_mode).double()
    plan = se.plan(analysis=se.analyze(model), objective="memory", topology=topology, backend="torch",
                   batch_size=4, mode=mode)
    with warnings.catch_warnings(record=True) as caught:  # what a user would see
        runtime = se.apply(model=model, plan=plan, device_type="cpu")
        share, start = plan.per_rank_batch, runtime.dp_rank * plan.per_rank_batch
        loss, out = runtime.forward_loss(nn.CrossEntropyLoss(), x[:, start:start + share], y[start:start + share])
        loss.backward()
    out = gather_over_dp(runtime, out)
    grads = runtime.full_gradients()
    err = max([float((out.detach() - ref_out.detach()).abs().max())]
              + [float((grads[n] - p.grad).abs().max()) for n, p in ref.named_parameters()])
    return dict(err=err, rate=sum(rates) / len(rates), min_rate=min(rates), styles=dict(plan.tensor_parallel_plan),
                warnings=[str(w.message)[:200] for w in caught])


@pytest.mark.parametrize("step_mode,topology,mode", [
    ("m", {"tp": 2}, "tp"), ("s", {"tp": 2}, "tp"), ("m", {"dp": 2}, "dp"), ("m", {"dp": 2}, "fsdp2"),
])
def test_spikingjelly_matches_unsharded(step_mode, topology, mode):
    for res in run_on_ranks(_jelly_rank, 2, step_mode, topology, mode, timeout=90):
        assert 0.05 <= res["rate"] <= 0.95 and res["min_rate"] > 0, f"spike rates make it vacuous: {res}"
        assert res["err"] <= 1e-9, res
        assert not res["warnings"], res["warnings"]
        if mode == "tp":
            assert "local" in res["styles"].values()


def _reference_step(ref, x, y):
    """One forward/backward of the unsharded spikingjelly model; returns per-neuron spike rates and outputs."""
    from spikingjelly.activation_based import functional

    rates = {}
    for name, m in ref.named_modules():
        if hasattr(m, "v_threshold"):
            m.register_forward_hook(lambda _m, _i, o, name=name: rates.__setitem__(name, float(o.mean())))
    functional.reset_net(ref)
    ref_out = ref(x)
    nn.functional.cross_entropy(ref_out.mean(0), y).backward()
    return rates, ref_out


def _jelly_spikformer_rank(topology, mode):
    import snn_explorer as se

    x, y = spikformer_input(), torch.arange(2) % 8
    ref = jelly_spikformer()
    rates, ref_out = _reference_step(ref, x, y)
    model = jelly_spikformer()
    plan = se.plan(analysis=se.analyze(model), objective="memory", topology=topology, backend="torch",
                   batch_size=2, mode=mode, features=se.DistributedFeatureSet(allow_experimental_spikformer_tp=True))
    runtime = se.apply(model=model, plan=plan, device_type="cpu")
    share, start = plan.per_rank_batch, runtime.dp_rank * plan.per_rank_batch
    loss, out = runtime.forward_loss(nn.CrossEntropyLoss(), x[:, start:start + share], y[start:start + share])
    loss.backward()
    out = gather_over_dp(runtime, out)
    grads = runtime.full_gradients()
    errors = {"outputs": float((out - ref_out.detach()).abs().max())}
    errors.update({n: float((grads[n] - p.grad).abs().max()) for n, p in ref.named_parameters()})
    return dict(errors=errors, rates=rates, styles=dict(plan.tensor_parallel_plan))


@pytest.mark.parametrize("topology,mode", [({"tp": 2}, "tp"), ({"tp": 4}, "tp")])
def test_spikingjelly_spikformer_head_aligned_tp(topology, mode):
    """The fused q/k/v projection is split so each rank owns whole heads (the reference's defect 3).

    TP only: tensor-parallel peers see the whole batch, so BatchNorm statistics match in training
    mode (this model does not spike in eval mode at its initial running statistics)."""
    world = topology.get("dp", 1) * topology["tp"]
    results = run_on_ranks(_jelly_spikformer_rank, world, topology, mode, timeout=120)
    rates = results[0]["rates"]
    assert "blocks.0.attn.attn_lif" in rates and len(rates) >= 6
    for name, rate in rates.items():
        assert 0.02 <= rate <= 0.98, f"{name} spikes at {rate:.3f}: the comparison would be vacuous"
    assert results[0]["styles"]["blocks.0.attn.qkv_conv_bn.0"] == "qkv_colwise"
    for rank, res in enumerate(results):
        for what, err in res["errors"].items():
            assert err <= 1e-9, f"rank {rank}: {what} differs by {err:.3g}"


def jelly_vgg():
    """A CIFAR10-DVS-style VGG from spikingjelly's multi-step layers."""
    from spikingjelly.activation_based import functional, layer, neuron

    torch.manual_seed(0)
    blocks = []
    for c_in, c_out, pool in ((2, 8, True), (8, 16, False), (16, 16, True), (16, 16, False)):
        blocks += [layer.Conv2d(c_in, c_out, 3, padding=1, bias=False), layer.BatchNorm2d(c_out),
                   neuron.LIFNode(tau=2.0)]
        blocks += [layer.MaxPool2d(2)] if pool else []
    net = nn.Sequential(*blocks, layer.Flatten(start_dim=1), layer.Linear(16 * 4 * 4, 32), neuron.LIFNode(tau=2.0),
                        layer.Linear(32, 8))
    functional.set_step_mode(net, "m")
    with torch.no_grad():  # biases and gains that keep every layer spiking (10-25 %)
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.bias.fill_(0.8)
            elif isinstance(m, nn.Linear):
                m.weight.mul_(4.0)
                m.bias.fill_(0.6)
    return net.double()


def _jelly_vgg_rank(tp):
    import snn_explorer as se

    x = torch.rand(3, 2, 2, 16, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64).lt(0.3).double()
    y = torch.tensor([1, 5])
    ref = jelly_vgg()
    rates, ref_out = _reference_step(ref, x, y)
    model = jelly_vgg()
    plan = se.plan(analysis=se.analyze(model, model_family="cifar10dvs_vgg"), objective="memory",
                   topology={"tp": tp}, backend="torch", batch_size=2,
                   features=se.DistributedFeatureSet(allow_experimental_conv_tp=True))
    runtime = se.apply(model=model, plan=plan, device_type="cpu")
    loss, out = runtime.forward_loss(nn.CrossEntropyLoss(), x, y)
    loss.backward()
    grads = runtime.full_gradients()
    errors = {"outputs": float((out.detach() - ref_out.detach()).abs().max())}
    errors.update({n: float((grads[n] - p.grad).abs().max()) for n, p in ref.named_parameters()})
    return dict(errors=errors, rates=rates, styles=dict(plan.tensor_parallel_plan))


@pytest.mark.parametrize("tp", [2, 4])
def test_spikingjelly_vgg_channel_tp(tp):
    for rank, res in enumerate(run_on_ranks(_jelly_vgg_rank, tp, tp, timeout=120)):
        for name, rate in res["rates"].items():
            assert 0.02 <= rate <= 0.98, f"{name} spikes at {rate:.3f}: the comparison would be vacuous"
        assert sorted(set(res["styles"].values())) == ["colwise", "conv_colwise", "conv_rowwise", "local",
                                                        "norm_local", "rowwise"]
        for what, err in res["errors"].items():
            assert err <= 1e-9, f"rank {rank}: {what} differs by {err:.3g}"


@pytest.mark.timeout(240)
def test_estimate_matches_measure_for_fused_qkv_head_aligned_tp():
    """The estimator models the experimental styles too: fused q/k/v, its BatchNorm, local heads."""
    import snn_explorer as se
    from snn_explorer.estimator import compare_estimate, estimate, measure

    model, x, y = jelly_spikformer(), spikformer_input(), torch.arange(2) % 8
    plan = se.plan(analysis=se.analyze(model), objective="memory", topology={"tp": 2}, backend="torch",
                   batch_size=2, mode="tp", features=se.DistributedFeatureSet(allow_experimental_spikformer_tp=True))
    assert {"qkv_colwise", "qkv_norm_local", "heads_local", "conv_rowwise"} <= set(plan.tensor_parallel_plan.values())
    est = estimate(model, plan, example_input=x, labels=y)
    side = compare_estimate(est, measure(model, plan, example_input=x, labels=y, steps=2, timeout=200))
    per_rank, coll = side["per_rank"], side["collectives"]
    for col in ("params_bytes", "grads_bytes", "optimizer_bytes", "buffers_bytes", "neuron_state_bytes"):
        assert (per_rank[f"{col}_est"] == per_rank[f"{col}_meas"]).all(), col
    assert len(coll) and (coll["count_rel_err"] == 0).all() and (coll["bytes_rel_err"] == 0).all()
    assert per_rank["peak_bytes_rel_err"].abs().max() <= 0.10
