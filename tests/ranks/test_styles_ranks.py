"""Every registered TP style through apply (2 real gloo ranks, one spawned group for all cases),
the estimator and the Explorer's tables and shard chart; plan-time refusals of TP plans that
cannot compute (issue 19): tied weights, broken chains, styles of another layer kind, missing gates.
(The tests in one process: tests/unit/test_styles.py.)"""
import pytest
import torch
from distributed_harness import run_on_ranks
from models import SEWResNet, SpikeDrivenNet, TimeLoop
from torch import nn

import snn_explorer as se
from snn_explorer.core.styles import STYLES
from snn_explorer.zoo import lif

TP = 2
T, N = 3, 4


class FusedAttention(nn.Module):
    """Attention with one fused q/k/v projection (a 1x1 Conv1d or a Linear), its BatchNorm and
    neuron, and an output projection; tokens are ``[N, dim, L]`` (conv) or ``[N, L, dim]`` (Linear)."""

    def __init__(self, dim: int, num_heads: int, conv: bool):
        super().__init__()
        self.num_heads, self.conv = num_heads, conv
        self.qkv = nn.Conv1d(dim, 3 * dim, 1) if conv else nn.Linear(dim, 3 * dim)
        self.qkv_bn = nn.BatchNorm1d(3 * dim)
        self.qkv_lif = lif(0.8)
        self.proj = nn.Conv1d(dim, dim, 1) if conv else nn.Linear(dim, dim)

    def forward(self, x):
        y = self.qkv(x)
        y = self.qkv_bn(y) if self.conv else self.qkv_bn(y.transpose(1, 2)).transpose(1, 2)
        y = self.qkv_lif(y)
        if not self.conv:
            y = y.transpose(1, 2)  # [N, 3 * width, L]
        n, c, length = y.shape  # c = 3 * (this rank's heads x head_dim)
        q, k, v = y.reshape(n, 3, self.num_heads, c // 3 // self.num_heads, length).unbind(1)
        attn = torch.einsum("nhdl,nhdm->nhlm", q, k) * 0.5
        out = torch.einsum("nhlm,nhdm->nhdl", attn, v).reshape(n, c // 3, length)
        return self.proj(out if self.conv else out.transpose(1, 2))


class AttentionNet(nn.Module):
    def __init__(self, conv: bool, dim: int = 8, length: int = 4):
        super().__init__()
        self.attn = FusedAttention(dim, 2, conv)
        self.lif = lif(0.8)
        self.head = nn.Linear(dim * length, 6)

    def forward(self, x):
        return self.head(self.lif(self.attn(x)).flatten(1))


def _strong(model: nn.Module) -> nn.Module:
    with torch.no_grad():  # gains and biases that keep every neuron spiking
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)):
                m.weight.mul_(2.5)
                if m.bias is not None:
                    m.bias.fill_(0.3)
            elif isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.bias.fill_(0.6)
    return model.double()


def build(case: str) -> nn.Module:
    torch.manual_seed(0)
    if case == "linear":
        net = nn.Sequential(nn.Linear(8, 16), lif(0.8), nn.Linear(16, 8), lif(0.8), nn.Linear(8, 6))
    elif case == "conv":
        net = nn.Sequential(nn.Conv2d(2, 8, 3, padding=1), nn.BatchNorm2d(8), lif(0.8), nn.MaxPool2d(2),
                            nn.Conv2d(8, 4, 3, padding=1), lif(0.8), nn.Flatten(), nn.Linear(4 * 4 * 4, 6))
    elif case == "sew":
        return _strong(SEWResNet())
    elif case == "spike_driven":
        return _strong(SpikeDrivenNet())
    else:
        net = AttentionNet(conv=case == "attn_conv")
    return _strong(TimeLoop(net))


def example(case: str):
    g = torch.Generator().manual_seed(1)
    shape = {"linear": (8,), "conv": (2, 8, 8), "attn_conv": (8, 4), "attn_linear": (4, 8), "sew": (2, 4, 4),
             "spike_driven": (8, 4)}[case]
    return torch.rand(T, N, *shape, generator=g, dtype=torch.float64) * 2, torch.arange(N) % 6


FEATURES = {"linear": {}, "conv": dict(allow_experimental_conv_tp=True),
            "attn_conv": dict(allow_experimental_spikformer_tp=True),
            "attn_linear": dict(allow_experimental_spikformer_tp=True),
            "sew": dict(allow_experimental_conv_tp=True), "spike_driven": dict(allow_experimental_spikformer_tp=True)}
CASES = tuple(FEATURES)


def plan_for(case: str, model: nn.Module):
    return se.plan(analysis=se.analyze(model), objective="memory", topology={"tp": TP}, backend="torch",
                   batch_size=N, mode="tp", features=se.DistributedFeatureSet(**FEATURES[case]))


def _rates(model: nn.Module, x, y):
    """Spike rate of every neuron in one forward/backward of the unsharded ``model``."""
    import snntorch
    from spikingjelly.activation_based.neuron import BaseNode

    rates = {}
    for name, m in model.named_modules():
        if isinstance(m, (snntorch.SpikingNeuron, BaseNode)):
            m.register_forward_hook(lambda _m, _i, o, name=name: rates.setdefault(name, []).append(float(o.detach().mean())))
    se.core.neurons.reset_all(model)
    out = model(x)
    nn.functional.cross_entropy(out.mean(0), y).backward()
    return {k: sum(v) / len(v) for k, v in rates.items()}, out.detach()


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _layout_problems(model, fresh, plan, tp_rank):
    """Each sharded tensor's local shape and values against its style's local_shape and held."""
    problems = []
    for path, name in plan.tensor_parallel_plan.items():
        style, module, full = STYLES[name], model.get_submodule(path), fresh.get_submodule(path)
        for leaf in style.split:
            tensor = getattr(module, leaf, None)
            if tensor is None:
                continue
            local, whole = _local(tensor.detach()), getattr(full, leaf).detach()
            if tuple(local.shape) != style.local_shape(leaf, whole.shape, TP):
                problems.append(f"{path}.{leaf}: shape {tuple(local.shape)}")
            dim, index = style.held(leaf, whole.shape, TP, tp_rank)
            if not torch.equal(local, whole.index_select(dim, torch.tensor(index))):
                problems.append(f"{path}.{leaf}: values are not rows {index} of dim {dim}")
    return problems


def _all_cases_on_rank():
    from snn_explorer.estimator.instruments.recorder import CollectiveRecorder

    results = {}
    for case in CASES:
        x, y = example(case)
        rates, ref_out = _rates(ref := build(case), x, y)
        model = build(case)
        plan = plan_for(case, model)
        runtime = se.apply(model=model, plan=plan, device_type="cpu")
        layout = _layout_problems(runtime.module, build(case), plan, runtime.tp_rank)
        recorder = CollectiveRecorder()
        with recorder:
            loss, out = runtime.forward_loss(nn.CrossEntropyLoss(), x, y)
            recorder.phase = "backward"
            loss.backward()
        grads = runtime.full_gradients()
        errors = {"outputs": float((out.detach() - ref_out).abs().max())}
        errors.update({n: float((grads[n] - p.grad).abs().max()) for n, p in ref.named_parameters()})
        results[case] = dict(rates=rates, errors=errors, layout=layout, styles=dict(plan.tensor_parallel_plan),
                             collectives=recorder.table({"tp": runtime.mesh.get_group("tp")}),
                             params_bytes=sum(_local(p).numel() * p.element_size() for p in runtime.module.parameters()))
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(_all_cases_on_rank, TP, timeout=240)


def test_every_registered_style_is_exercised(ranks):
    used = {s for res in ranks[0].values() for s in res["styles"].values()}
    assert used == set(STYLES) == set(se.TP_STYLES)


@pytest.mark.parametrize("case", CASES)
def test_apply_equals_the_single_process(ranks, case):
    rates = ranks[0][case]["rates"]
    assert rates and all(0.02 <= r <= 0.98 for r in rates.values()), f"spike rates make it vacuous: {rates}"
    for rank, res in enumerate(ranks):
        assert res[case]["layout"] == [], f"rank {rank}: {res[case]['layout']}"
        for what, err in res[case]["errors"].items():
            assert err <= 1e-9, f"rank {rank}: {what} differs by {err:.3g}"


@pytest.mark.parametrize("case", CASES)
def test_estimate_matches_the_ranks(ranks, case):
    from snn_explorer.estimator import estimate

    model, (x, y) = build(case), example(case)
    est = estimate(model, plan_for(case, model), example_input=x, labels=y)
    key = lambda rows: sorted((r["kind"], r["phase"], r["count"], r["bytes"]) for r in rows if r["mesh_dim"] == "tp")
    for res in ranks:
        assert key(res[case]["collectives"]) == key(est.collectives.to_dict("records"))
        assert len(res[case]["collectives"]) > 0
    assert (est.per_rank["params_bytes"] == [res[case]["params_bytes"] for res in ranks]).all()


# ---- issue 19: plans that cannot compute are refused at plan time ----------------------------------
