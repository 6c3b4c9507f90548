"""Channel TP on the reference package's own CIFAR10-DVS VGG (spikingjelly 2.0.0's memopt example):
its ``VGGBlock`` (``Sequential(Conv2d, BatchNorm2d)`` then a neuron, pooling between blocks) is found,
sharded output- then input-channel-wise, and equals the unsharded model on 2 gloo ranks.
(The tests on gloo ranks: tests/ranks/test_conv_tp_reference_ranks.py.)"""
import re

import pytest
from torch import nn

pytest.importorskip("spikingjelly.activation_based.examples.memopt.models")  # installed by scripts/setup.sh


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
