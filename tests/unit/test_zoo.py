"""Unit tests for the built-in model zoo (snn_explorer.zoo)."""
from __future__ import annotations

import copy
import io
import time
from collections import defaultdict

import pytest
import snntorch
import torch
from torch import nn

from snn_explorer.zoo import (
    SIZES,
    ZOO_NAMES,
    ATanSurrogate,
    MultiStep,
    SpikingMLP,
    SpikingSelfAttention,
    ZooModel,
    build,
    reset_state,
)

FAMILIES = {"mlp": "mlp", "mlp_all_steps": "mlp", "mlp_tutorial": "generic", "vgg": "cifar10dvs_vgg", "spikformer": "spikformer"}


def leaky_modules(model: nn.Module):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, snntorch.Leaky)]


def spike_rates(model: nn.Module, x: torch.Tensor) -> dict:
    """Mean spike rate of every Leaky module over one forward pass (state reset first)."""
    record = defaultdict(list)
    def spikes(out):  # init_hidden=False neurons return (spk, mem)
        return (out[0] if isinstance(out, tuple) else out).detach()

    hooks = [m.register_forward_hook(lambda mod, inp, out, name=n: record[name].append(spikes(out)))
             for n, m in leaky_modules(model)]
    try:
        reset_state(model)
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return {n: torch.cat([o.flatten() for o in outs]).double().mean().item() for n, outs in record.items()}


def run(z: ZooModel, x: torch.Tensor | None = None) -> torch.Tensor:
    reset_state(z.model)
    return z.model(z.example_input if x is None else x)


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_tiny_forward_backward(name):
    z = build(name, "tiny")
    assert z.name == name and z.family == FAMILIES[name] and z.size == "tiny"
    x = z.example_input
    assert x.shape[:2] == (z.time_steps, z.batch_size)
    assert z.labels.shape == (z.batch_size,) and z.labels.dtype == torch.int64
    assert 0 <= int(z.labels.min()) and int(z.labels.max()) < z.num_classes
    y = run(z)
    assert y.shape == (z.time_steps, z.batch_size, z.num_classes)
    assert torch.isfinite(y).all()
    assert y.std() > 1e-3, "output is constant"
    assert (y[0] - y[-1]).abs().max() > 1e-4 and (y[:, 0] - y[:, 1]).abs().max() > 1e-4
    loss = nn.functional.cross_entropy(y.mean(0), z.labels)
    loss.backward()
    for pname, p in z.model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    first = next(p for p in z.model.parameters() if p.dim() > 1)
    assert first.grad.abs().sum() > 0, "no gradient reaches the first layer"


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_tiny_conventions(name):
    model = build(name, "tiny").model
    neurons = leaky_modules(model)
    assert neurons
    for n, m in neurons:  # the tutorial model passes its membranes explicitly, as snntorch's tutorials do
        assert m.init_hidden == (name != "mlp_tutorial") and not m.output, n
    for n, m in model.named_modules():
        if isinstance(m, snntorch.SpikingNeuron):
            assert isinstance(m, snntorch.Leaky), n
        if isinstance(m, nn.Linear):
            assert m.in_features % 8 == 0 and m.out_features % 8 == 0, n


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_tiny_fast(name):
    z = build(name, "tiny")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # stricter than 2 cores, and immune to thread contention on a busy host
    try:
        best = float("inf")
        for _ in range(5):  # the first pass warms up
            t0 = time.perf_counter()
            run(z).sum().backward()
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    assert best < 0.3


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_deterministic(name):
    a, b, c = build(name, "tiny", seed=3), build(name, "tiny", seed=3), build(name, "tiny", seed=4)
    assert torch.equal(a.example_input, b.example_input) and torch.equal(a.labels, b.labels)
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(run(a), run(b))
    assert not torch.equal(a.example_input, c.example_input)
    assert not all(torch.equal(p, q) for p, q in zip(a.model.parameters(), c.model.parameters()))


def test_build_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build("spikformer", "tiny")
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", ZOO_NAMES)
def test_tiny_spike_rates(name, mode):
    z = build(name, "tiny")
    getattr(z.model, mode)()
    rates = spike_rates(z.model, z.example_input)
    assert set(rates) == {n for n, _ in leaky_modules(z.model)}, "some Leaky never ran"
    bad = {n: round(r, 4) for n, r in rates.items() if not 0.02 <= r <= 0.98}
    assert not bad, f"spike rates outside 2%..98%: {bad}"


def test_state_carries_over_until_reset():
    z = build("vgg", "tiny")
    z.model.eval()
    with torch.no_grad():
        first = run(z)
        again = z.model(z.example_input)  # no reset: membranes carry over
        fresh = run(z)
    assert not torch.equal(first, again)
    assert torch.equal(first, fresh)


def _copy_linears(src: nn.Module, dst: nn.Module) -> None:
    src_l = [m for m in src.modules() if isinstance(m, nn.Linear)]
    dst_l = [m for m in dst.modules() if isinstance(m, nn.Linear)]
    assert len(src_l) == len(dst_l)
    with torch.no_grad():
        for s, d in zip(src_l, dst_l):
            d.weight.copy_(s.weight)
            d.bias.copy_(s.bias)


def test_mlp_steppings_match_float64():
    per, allst = build("mlp", "tiny", seed=1), build("mlp_all_steps", "tiny", seed=2)
    assert isinstance(allst.model.net[1], MultiStep) and isinstance(per.model.net[1], snntorch.Leaky)
    _copy_linears(per.model, allst.model)
    per.model.double()
    allst.model.double()
    x = per.example_input.double()
    rates = spike_rates(per.model, x)
    assert all(0.02 <= r <= 0.98 for r in rates.values()), rates
    y_per, y_all = run(per, x), run(allst, x)
    assert y_per.dtype == torch.float64
    torch.testing.assert_close(y_per, y_all, rtol=1e-12, atol=1e-12)
    assert list(spike_rates(allst.model, x).values()) == list(rates.values())


def test_mlp_structure_and_dropout_eval():
    kw = dict(in_features=16, hidden=(24, 32), num_classes=8, dropout=0.25)
    torch.manual_seed(0)
    per = SpikingMLP(**kw, stepping="per_step")
    allst = SpikingMLP(**kw, stepping="all_steps")
    kinds = [type(m).__name__ for m in per.net]
    assert kinds == ["Linear", "Leaky", "Dropout", "Linear", "Leaky", "Dropout", "Linear"]
    assert [type(m).__name__ for m in allst.net] == [k.replace("Leaky", "MultiStep") for k in kinds]
    _copy_linears(per, allst)
    per.eval()
    allst.eval()
    x = torch.rand(5, 3, 16, generator=torch.Generator().manual_seed(0)) * 2
    reset_state(per)
    reset_state(allst)
    torch.testing.assert_close(per(x), allst(x))
    with pytest.raises(ValueError, match="'sideways'"):
        SpikingMLP(4, (8,), 2, stepping="sideways")


def test_attention_split_along_heads_is_exact():
    """Column-split q/k/v and row-split proj along whole heads reproduce the full attention."""
    torch.manual_seed(0)
    dim, heads = 32, 4
    full = SpikingSelfAttention(dim, heads, scale=0.5).double()
    with torch.no_grad():
        for lin in (full.q, full.k, full.v, full.proj):
            lin.weight.mul_(3)
    x = (torch.rand(3, 2, 6, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) < 0.3).double()

    def proj_output(attn):
        out = []
        hook = attn.proj.register_forward_hook(lambda m, i, o: out.append(o))
        reset_state(attn)
        attn(x)
        hook.remove()
        return torch.stack(out).squeeze(0)

    reference = proj_output(full)
    assert 0 < reference.abs().sum()
    partial = torch.zeros_like(reference)
    half = dim // 2
    for r in range(2):
        cols = slice(r * half, (r + 1) * half)
        shard = SpikingSelfAttention(dim, heads, scale=0.5).double()
        with torch.no_grad():
            for name in ("q", "k", "v"):
                src = getattr(full, name)
                lin = nn.Linear(dim, half).double()
                lin.weight.copy_(src.weight[cols])
                lin.bias.copy_(src.bias[cols])
                setattr(shard, name, lin)
            shard.proj = nn.Linear(half, dim).double()
            shard.proj.weight.copy_(full.proj.weight[:, cols])
            shard.proj.bias.copy_(full.proj.bias if r == 0 else torch.zeros_like(full.proj.bias))
        partial += proj_output(shard)
    torch.testing.assert_close(partial, reference, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_overrides(name):
    z = build(name, "tiny", batch_size=3, time_steps=2)
    assert z.example_input.shape[:2] == (2, 3) and z.labels.shape == (3,)
    assert (z.time_steps, z.batch_size) == (2, 3)
    assert run(z).shape == (2, 3, z.num_classes)


def test_surrogate_matches_snntorch_atan_and_keeps_dtype():
    x = torch.randn(50, requires_grad=True, generator=torch.Generator().manual_seed(0))
    ref = snntorch.surrogate.atan()(x)
    ref.sum().backward()
    ref_grad, x.grad = x.grad.clone(), None
    ours = ATanSurrogate()(x)
    ours.sum().backward()
    assert torch.equal(ours, ref) and torch.equal(x.grad, ref_grad)
    assert ATanSurrogate()(x.detach().double()).dtype == torch.float64


@pytest.mark.parametrize("name", ["mlp", "vgg", "spikformer"])
def test_models_pickle_and_deepcopy(name):
    z = build(name, "tiny")
    buffer = io.BytesIO()
    torch.save(z.model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        expected = run(z)
        for clone in (loaded, copy.deepcopy(z.model)):
            reset_state(clone)
            assert torch.equal(clone(z.example_input), expected)


def test_bad_name_and_size():
    with pytest.raises(ValueError, match="'resnet'") as e:
        build("resnet")
    assert all(n in str(e.value) for n in ZOO_NAMES)
    with pytest.raises(ValueError, match="'huge'") as e:
        build("mlp", "huge")
    assert all(s in str(e.value) for s in SIZES)
    with pytest.raises(ValueError):
        build("mlp", time_steps=0)


PARAM_RANGES = {  # (min, max) parameter counts of the realistic sizes
    ("mlp", "small"): (3e5, 3e6), ("mlp", "full"): (5e6, 5e7),
    ("vgg", "small"): (1e6, 1e7), ("vgg", "full"): (8e6, 6e7),
    ("spikformer", "small"): (1e6, 1e7), ("spikformer", "full"): (5e6, 2e7),
}


@pytest.mark.parametrize("name,size", sorted(PARAM_RANGES))
def test_realistic_sizes_construct(name, size):
    z = build(name, size)
    n = sum(p.numel() for p in z.model.parameters())
    lo, hi = PARAM_RANGES[name, size]
    assert lo <= n <= hi, n
    assert z.example_input.shape[:2] == (z.time_steps, z.batch_size)
    assert z.num_classes == 10
    if name == "spikformer":
        assert len(z.model.blocks) == (4 if size == "full" else 2)
        assert z.model.blocks[0].attn.q.in_features == (384 if size == "full" else 256)
