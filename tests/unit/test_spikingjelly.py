"""spikingjelly models (the real library): detection, reset, and TP / dp equal to the unsharded model.
(The tests on gloo ranks: tests/ranks/test_spikingjelly_ranks.py.)"""
import subprocess
import sys

import pytest
import torch
from torch import nn

sj = pytest.importorskip("spikingjelly.activation_based")  # installed by scripts/setup.sh


def jelly_mlp(step_mode: str, seed: int = 0) -> nn.Module:
    from spikingjelly.activation_based import functional, layer, neuron

    torch.manual_seed(seed)
    net = nn.Sequential(
        layer.Linear(16, 32), neuron.LIFNode(tau=2.0),
        layer.SeqToANNContainer(nn.Linear(32, 32)) if step_mode == "m" else layer.Linear(32, 32),
        neuron.LIFNode(tau=2.0), layer.Dropout(0.0), layer.Linear(32, 8),
    )
    functional.set_step_mode(net, step_mode)
    for m in net.modules():
        if isinstance(m, nn.Linear):
            with torch.no_grad():  # strong enough that every layer spikes
                m.weight.mul_(3.0)
                m.bias.fill_(0.5)
    return net if step_mode == "m" else SingleStep(net)


class SingleStep(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return torch.stack([self.net(x_t) for x_t in x])


def jelly_input():
    return torch.rand(6, 4, 16, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 3


def test_import_does_not_pull_snn_libraries():
    code = "import sys, snn_explorer; print(sorted(m for m in ('spikingjelly', 'snntorch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_detects_and_resets_spikingjelly_neurons():
    import snn_explorer as se

    model = jelly_mlp("m").double()
    analysis = se.analyze(model)
    # spikingjelly's Dropout keeps its mask across time steps: stateful (reset), but no neuron
    assert dict(analysis.snn_libraries) == {"1": "spikingjelly", "3": "spikingjelly", "4": "spikingjelly"}
    assert analysis.neuron_names == ("1", "3")
    assert dict(analysis.state_kinds) == {"1": "neuron", "3": "neuron", "4": "dropout mask"}
    assert analysis.tp_chains == (("0", "1", "2.0", "3", "4", "5"),)  # SeqToANNContainer is a Sequential
    model(jelly_input())
    assert isinstance(model[1].v, torch.Tensor) and model[1].v.abs().sum() > 0
    assert se.core.model.neurons.reset_all(model) == 3
    assert model[1].v == 0.0  # spikingjelly resets memories to their initial value


def jelly_spikformer():
    """spikingjelly's own Spikformer (fused q/k/v as a 1x1 Conv1d + BatchNorm1d), tiny."""
    from spikingjelly.activation_based.model.spikformer import Spikformer

    torch.manual_seed(0)
    model = Spikformer(T=2, in_channels=2, img_size_h=16, img_size_w=16, patch_size=4, num_classes=8,
                       embed_dims=32, num_heads=4, mlp_ratio=2.0, depths=1)
    with torch.no_grad():  # stronger q/k/v and attention scores, so that attention's own neurons fire
        model.blocks[0].attn.qkv_conv_bn[1].weight.mul_(2.0)
    model.blocks[0].attn.scale = 2.0
    return model.double()


def spikformer_input():
    return torch.rand(2, 2, 2, 16, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 4


def test_contiguous_qkv_split_would_be_wrong():
    """Why the rows are reordered: a contiguous split of the fused output does not give whole heads."""
    from snn_explorer.core.tp import head_aligned_rows

    rows = head_aligned_rows(8, 2)  # q, k, v of width 8 over 2 ranks
    assert rows[:12].tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]
    assert rows[:12].tolist() != list(range(12))


def test_explorer_tables_shard_what_plan_shards_on_the_spikformer():
    """One decision: with the attention gate on, the Explorer's default layout (its module and
    candidate tables) is the layout plan() builds, for every gate combination."""
    import snn_explorer as se
    from snn_explorer import Explorer

    model = jelly_spikformer()
    ex = Explorer(model, example_input=spikformer_input())
    for heads in (False, True):
        for conv in (False, True):
            features = se.DistributedFeatureSet(allow_experimental_spikformer_tp=heads, allow_experimental_conv_tp=conv)
            plan = ex.make_plan(objective="memory", topology={"tp": 2}, mode="tp", features=features)
            layout = ex.default_tp_plan(features)
            assert layout == dict(plan.tensor_parallel_plan), (heads, conv)
            dp_plan = ex.make_plan(objective="memory", topology={"dp": 2}, mode="dp", features=features)
            for shown_for in (plan, dp_plan):  # a plan without TP shows the layout TP would get
                shown = ex.modules_for(shown_for).set_index("path")["tp_style"]
                assert dict(shown[shown != ""]) == layout, (heads, conv, shown_for.mode)
    assert "qkv_colwise" in layout.values() and len(layout) >= 8


def test_dropout_masks_are_state_but_not_neurons():
    """A spikingjelly Dropout is reset with the neurons but counted, described and serialised as a
    dropout mask; an analysis saved before state kinds existed still loads (all its state neurons)."""
    from spikingjelly.activation_based import functional, layer, neuron

    import snn_explorer as se
    from snn_explorer import Explorer
    from snn_explorer.core.model import reset_all

    torch.manual_seed(0)
    model = nn.Sequential(layer.Linear(16, 32), neuron.LIFNode(), layer.Dropout(0.5), layer.Linear(32, 8))
    functional.set_step_mode(model, "m")
    analysis = se.analyze(model)
    assert analysis.memory_module_names == ("1", "2") and analysis.neuron_names == ("1",)
    again = se.SNNDistributedAnalysis.from_dict(analysis.to_dict())
    assert again == analysis and again.neuron_names == ("1",)
    old = analysis.to_dict()
    del old["state_kinds"]
    assert se.SNNDistributedAnalysis.from_dict(old).neuron_names == ("1", "2")
    table = Explorer(model).modules.set_index("path")
    assert table.loc["2", "state"].startswith("dropout mask") and table.loc["1", "state"].startswith("neuron state")
    assert "2 stateful (1 neurons, 1 other)" in repr(Explorer(model))
    model.train()
    model(torch.rand(3, 2, 16))
    assert isinstance(model[2].mask, torch.Tensor)  # drawn at the first step, kept for the others
    assert reset_all(model) == 2 and model[2].mask is None  # a new batch draws a new mask
