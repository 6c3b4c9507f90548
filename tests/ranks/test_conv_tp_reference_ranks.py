"""Channel TP on the reference package's own CIFAR10-DVS VGG (spikingjelly 2.0.0's memopt example):
its ``VGGBlock`` (``Sequential(Conv2d, BatchNorm2d)`` then a neuron, pooling between blocks) is found,
sharded output- then input-channel-wise, and equals the unsharded model on 2 gloo ranks.
(The tests in one process: tests/unit/test_conv_tp_reference.py.)"""

import pytest
import torch
from distributed_harness import run_on_ranks
from models import SMALL_VGG_CHANNELS, small_reference_vgg
from test_conv_tp_reference import conv_tp_plan_of
from torch import nn

pytest.importorskip("spikingjelly.activation_based.examples.memopt.models")  # installed by scripts/setup.sh

def events() -> tuple:
    """A batch-major DVS-like batch ``[N=2, T=3, 2, 16, 16]`` of 0/1 events, and its labels."""
    g = torch.Generator().manual_seed(4)
    return torch.rand(2, 3, 2, 16, 16, generator=g, dtype=torch.float64).lt(0.3).double(), torch.tensor([1, 7])


def _reference_vgg_rank(tp):
    import snn_explorer as se

    x, y = events()
    ref = small_reference_vgg(kaiming=True)
    rates = {}
    for name, m in ref.named_modules():
        if hasattr(m, "v_threshold"):
            m.register_forward_hook(lambda _m, _i, o, name=name: rates.__setitem__(name, float(o.mean())))
    ref_out = ref(x)
    nn.functional.cross_entropy(ref_out.mean(0), y).backward()
    model = small_reference_vgg(kaiming=True)
    plan = conv_tp_plan_of(model, tp)
    runtime = se.apply(model=model, plan=plan, device_type="cpu")
    loss, out = runtime.forward_loss(nn.CrossEntropyLoss(), x, y)
    loss.backward()
    grads = runtime.full_gradients()
    local_channels = model.features[0].proj_bn[0].weight.shape[0]
    errors = {"outputs": float((out.detach() - ref_out.detach()).abs().max())}
    errors.update({n: float((grads[n] - p.grad).abs().max()) for n, p in ref.named_parameters()})
    return dict(errors=errors, rates=rates, styles=dict(plan.tensor_parallel_plan), local=local_channels,
                out_std=float(ref_out.std()), out_shape=tuple(out.shape))


def test_reference_vgg_channel_tp_equals_unsharded_on_2_ranks():
    results = run_on_ranks(_reference_vgg_rank, 2, 2, timeout=120)
    first = results[0]
    assert len(first["rates"]) == 8, first["rates"]
    for name, rate in first["rates"].items():  # non-trivial first: every neuron fires, outputs vary
        assert 0.02 <= rate <= 0.98, f"{name} spikes at {rate:.3f}: the comparison would be vacuous"
    assert first["out_std"] > 1e-3 and first["out_shape"] == (3, 2, 10)
    assert first["local"] == SMALL_VGG_CHANNELS[0] // 2  # really sharded
    assert sum(s.startswith("conv_") for s in first["styles"].values()) == 8
    for rank, res in enumerate(results):
        for what, err in res["errors"].items():
            assert err <= 1e-9, f"rank {rank}: {what} differs by {err:.3g}"
