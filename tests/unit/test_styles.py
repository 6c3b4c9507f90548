"""Every registered TP style through apply (2 real gloo ranks, one spawned group for all cases),
the estimator and the Explorer's tables and shard chart; plan-time refusals of TP plans that
cannot compute (issue 19): tied weights, broken chains, styles of another layer kind, missing gates.
(The tests on gloo ranks: tests/ranks/test_styles_ranks.py.)"""
import pytest
import torch
from models import MLP, SEWResNet, SpikeDrivenNet, TimeLoop
from torch import nn

import snn_explorer as se
from snn_explorer.core.tp import STYLES
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


def _expected_rows(path_style: str, dim0: int, tp_rank: int) -> str:
    """The dim-0 index ranges one TP rank holds, written independently of the code under test."""
    if path_style == "qkv_colwise" or path_style == "qkv_norm_local":
        width, local = dim0 // 3, dim0 // 3 // TP
        return "+".join(f"{s * width + tp_rank * local}:{s * width + (tp_rank + 1) * local}" for s in range(3))
    local = dim0 // TP
    return f"{tp_rank * local}:{(tp_rank + 1) * local}"


@pytest.mark.parametrize("case", CASES)
def test_explorer_tables_and_chart_know_every_style(case):
    from snn_explorer import Explorer

    model, (x, y) = build(case), example(case)
    ex = Explorer(model, example_input=x, labels=y)
    plan = plan_for(case, model)
    table = ex.modules_for(plan).set_index("path")
    for path, name in plan.tensor_parallel_plan.items():
        assert table.loc[path, "tp_style"] == name
        assert table.loc[path, "sharded_dim"] == STYLES[name].label != ""
        assert table.loc[path, "not_candidate_because"] == ""
        if not STYLES[name].shards_parameters:
            continue
        layout = ex.layout(plan, path)
        for row in layout.itertuples():
            dim = STYLES[name].split.get(row.param)
            shape = tuple(int(s) for s in row.full_shape.split("x"))
            if dim is None:
                assert row.held == "whole", (path, row)
            else:
                cut = _expected_rows(name, shape[dim], row.tp_rank)
                assert row.held == "[" + ", ".join(cut if d == dim else ":" for d in range(len(shape))) + "]", row
        fig = ex.mesh_chart(plan, path)
        colours = [p.get_facecolor()[:3] for p in fig.axes[0].patches]
        assert len(colours) == TP and all(c != (232 / 255, 232 / 255, 232 / 255) for c in colours), path


def test_plans_table_counts_modules_with_sharded_parameters():
    from snn_explorer.explorer.tables import plans_table

    model = build("attn_conv")
    plan = plan_for("attn_conv", model)
    holding = [p for p in plan.tensor_parallel_plan if any(True for _ in model.get_submodule(p).parameters(recurse=False))]
    assert len(holding) == 4  # qkv, its BatchNorm, proj, head; not the attention module or its neuron
    assert plans_table([plan])["tp_sharded_linears"][0] == len(holding)


# ---- issue 19: plans that cannot compute are refused at plan time ----------------------------------

def _plan(model, tp_plan=None, mode="tp", topology=None, **features):
    return se.plan(analysis=se.analyze(model), objective="memory", topology=topology or {"tp": 2},
                   backend="torch", batch_size=4, mode=mode, features=se.DistributedFeatureSet(**features), options=se.PlanOptions(tensor_parallel_plan=tp_plan))


@pytest.mark.parametrize("tp_plan,message", [
    ({"body.0": "colwise", "body.2": "colwise"}, r"\['body.2'\]='colwise' needs a whole input but gets the sharded "
                                                 r"output of 'body.0'"),
    ({"body.0": "rowwise", "body.2": "rowwise"}, r"\['body.0'\]='rowwise' needs a sharded input but gets a whole"),
    ({"body.2": "rowwise"}, r"\['body.2'\]='rowwise' needs a sharded input"),
    ({"head": "colwise"}, r"the output of 'head' \('colwise'\) leaves .* sharded"),
    ({"body.0": "colwise"}, r"'body.2' gets the sharded output of 'body.0'"),
])
def test_tp_plans_that_cannot_compute_are_refused(tp_plan, message):
    with pytest.raises(ValueError, match=message):
        _plan(MLP(), tp_plan)


def test_a_plan_that_computes_still_plans():
    plan = _plan(MLP(), {"body.0": "colwise", "body.2": "rowwise", "head": "colwise_gather"})
    assert dict(plan.tensor_parallel_plan)["body.1"] == "local"


def test_style_of_another_layer_kind_is_a_clear_error():
    with pytest.raises(ValueError, match=r"\['head'\]='conv_colwise' applies to a convolution .* 'head' is a "
                                         r"Linear TP candidate; styles for it: \['colwise', 'rowwise', 'colwise_gather'\]"):
        _plan(MLP(), {"head": "conv_colwise"}, allow_experimental_conv_tp=True)
    with pytest.raises(ValueError, match=r"\['net.0'\]='colwise' applies to a Linear .* 'net.0' is a "
                                         r"convolution"):
        _plan(build("conv"), {"net.0": "colwise", "net.4": "rowwise"})


@pytest.mark.parametrize("case,tp_plan,gate", [
    ("conv", {"net.0": "conv_colwise", "net.1": "norm_local", "net.4": "conv_rowwise"},
     "allow_experimental_conv_tp=True"),
    ("attn_conv", {"net.attn": "heads_local", "net.attn.qkv": "qkv_colwise", "net.attn.qkv_bn": "qkv_norm_local",
                   "net.attn.proj": "conv_rowwise"}, "allow_experimental_spikformer_tp=True"),
])
def test_gated_style_without_its_gate_is_refused(case, tp_plan, gate):
    model = build(case)
    with pytest.raises(ValueError, match=r"is experimental; it needs DistributedFeatureSet\(.*" + gate):
        _plan(model, tp_plan)
    assert _plan(model, tp_plan, **{gate.split("=")[0]: True}).tensor_parallel_plan  # with the gate it plans


class Tied(nn.Module):
    """Two Linears sharing one weight, in one chain (enc -> neuron -> dec) and in two FSDP2 units."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.lif = lif(0.8)
        self.dec = nn.Linear(8, 8)
        self.dec.weight = self.enc.weight

    def forward(self, x):
        return self.dec(self.lif(self.enc(x)))


def test_tied_weights_are_found_and_not_split():
    analysis = se.analyze(Tied())
    assert analysis.shared_parameter_groups == (("enc.weight", "dec.weight"),)
    assert se.SNNDistributedAnalysis.from_dict(analysis.to_dict()) == analysis
    with pytest.raises(ValueError, match=r"\['enc.weight', 'dec.weight'\] are one tied parameter, and the "
                                         r"tensor_parallel_plan shards \['enc.weight', 'dec.weight'\]"):
        _plan(Tied(), {"enc": "colwise", "dec": "rowwise"})
    with pytest.raises(ValueError, match=r"\['enc.weight', 'dec.weight'\] are one tied parameter, but fall in "
                                         r"different FSDP2 units \['dec', 'enc'\]"):
        _plan(Tied(), mode="fsdp2", topology={"dp": 2})
    plan = se.plan(analysis=analysis, objective="memory", topology={"dp": 2}, backend="torch", batch_size=4)
    assert plan.mode == "dp"  # the planner falls back past fsdp2


def test_apply_refuses_a_hand_made_plan_that_splits_tied_weights():
    plan = se.SNNDistributedPlan(mode="tp", objective="memory", topology={"tp": 2},
                                 tensor_parallel_plan={"enc": "colwise", "dec": "rowwise", "lif": "local"})
    from snn_explorer.core import preflight

    with pytest.raises(ValueError, match="tied parameter"):
        preflight(Tied(), plan)


def _plan_styles(model, **features):
    from snn_explorer.core.tp import default_tp_plan

    return default_tp_plan(se.analyze(model), se.DistributedFeatureSet(**features))


def test_planner_shards_sew_blocks_and_spike_driven_heads():
    sew = _plan_styles(SEWResNet(), allow_experimental_conv_tp=True)
    assert {p: s for p, s in sew.items() if p.startswith("blocks.")} == {
        f"blocks.{i}.{leaf}": style for i in (0, 1) for leaf, style in
        (("conv1", "conv_colwise"), ("bn1", "norm_local"), ("sn1", "local"), ("conv2", "conv_rowwise"))}
    attn = _plan_styles(SpikeDrivenNet(), allow_experimental_spikformer_tp=True)
    assert sorted(p for p, s in attn.items() if s in ("conv_colwise", "conv_rowwise")) == \
        ["attn.k_conv", "attn.proj_conv", "attn.q_conv", "attn.v_conv"]
    assert attn["attn"] == "heads_local" and attn["attn.attn_lif"] == "local"
    assert "attn.proj_bn" not in attn  # after the row-wise projection the stream is whole again
    # without the gates only the head is sharded
    assert set(_plan_styles(SEWResNet())) == set(_plan_styles(SpikeDrivenNet())) == {"head"}


def test_recognisers_refuse_near_misses():
    grouped = se.analyze(SEWResNet(groups=2))
    assert grouped.block_conv_chains == ()  # a grouped second conv cannot take channel shards
    assert "blocks.0.conv2" not in _plan_styles(SEWResNet(groups=2), allow_experimental_conv_tp=True)
    softmax = SpikeDrivenNet()
    softmax.attn.mix = nn.Softmax(dim=2)  # a child the recogniser cannot see through: not split by heads
    assert se.analyze(softmax).branch_attention_blocks == ()
    odd = SpikeDrivenNet()
    odd.attn.num_heads = 3  # 8 channels do not split into 3 heads
    assert se.analyze(odd).branch_attention_blocks == ()


def test_branch_attention_split_all_or_nothing():
    from snn_explorer.core.tp import check_tp_plan

    model = SpikeDrivenNet()
    analysis = se.analyze(model)
    plan = _plan_styles(model, allow_experimental_spikformer_tp=True)
    check_tp_plan(analysis, plan, TP)
    plan.pop("attn")
    with pytest.raises(ValueError, match="split by heads only"):
        check_tp_plan(analysis, plan, TP)
    assert se.core.model.analysis.SNNDistributedAnalysis.from_dict(analysis.to_dict()) == analysis
