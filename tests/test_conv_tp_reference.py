"""Channel TP on the reference package's own CIFAR10-DVS VGG (spikingjelly 2.0.0's memopt example):
its ``VGGBlock`` (``Sequential(Conv2d, BatchNorm2d)`` then a neuron, pooling between blocks) is found,
sharded output- then input-channel-wise, and equals the unsharded model on 2 gloo ranks."""
import re

import pytest
import torch
from distributed_harness import run_on_ranks
from models import SMALL_VGG_CHANNELS, small_reference_vgg
from torch import nn

pytest.importorskip("spikingjelly.activation_based.examples.memopt.models")  # installed by scripts/setup.sh

def events() -> tuple:
    """A batch-major DVS-like batch ``[N=2, T=3, 2, 16, 16]`` of 0/1 events, and its labels."""
    g = torch.Generator().manual_seed(4)
    return torch.rand(2, 3, 2, 16, 16, generator=g, dtype=torch.float64).lt(0.3).double(), torch.tensor([1, 7])


def conv_tp_plan_of(model, tp: int):
    import snn_explorer as se

    return se.plan(analysis=se.analyze(model), objective="memory", topology={"tp": tp}, neuron_backend="torch",
                   batch_size=2, mode="tp", features=se.DistributedFeatureSet(allow_experimental_conv_tp=True))


def test_full_size_model_gets_every_conv_sharded_and_the_note_says_so():
    """The model as the package ships it: 8 convolutions, 4 pairs, BatchNorms and neurons between
    each pair on their shard; the note promises exactly what the plan does."""
    from spikingjelly.activation_based.examples.memopt.models import CIFAR10DVSVGG

    import snn_explorer as se

    model = CIFAR10DVSVGG()
    analysis = se.analyze(model)
    assert len(analysis.conv_chains) == 1 and len(analysis.conv_shapes) == 8
    styles = dict(conv_tp_plan_of(model, 2).tensor_parallel_plan)
    convs = [c.name for c in analysis.conv_shapes]
    assert [styles[c] for c in convs] == ["conv_colwise", "conv_rowwise"] * 4
    assert styles["features.0.proj_bn.1"] == "norm_local" and styles["features.0.neuron"] == "local"
    assert "features.1.proj_bn.1" not in styles and "features.1.neuron" not in styles  # after the rowwise: whole
    assert styles["classifier.1"] == "colwise_gather"
    note = next(n for n in analysis.notes if "conv layer" in n)
    sharded = sum(s.startswith("conv_") for s in styles.values())
    assert re.search(r"shards the channels of (\d+) of them", note).group(1) == str(sharded) == "8", note


def test_note_names_convolutions_left_whole():
    """A lone convolution (no partner to pair with) is named whole, not promised a sharding."""
    import snn_explorer as se

    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4, 2))
    analysis = se.analyze(model)
    note = next(n for n in analysis.notes if "conv layer" in n)
    assert "shards none of them" in note and "1 stay whole (0)" in note, note
    assert analysis.conv_chains == ()


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
