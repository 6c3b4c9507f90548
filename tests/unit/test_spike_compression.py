"""Spike compression: saved 0/1 tensors kept as bits, bit-exact training on real ranks, estimated as measured.
(The tests on gloo ranks: tests/ranks/test_spike_compression_ranks.py.)"""
import dataclasses

import pytest
import snntorch
import torch
from torch import nn

import snn_explorer as se
from snn_explorer.core.levers import SpikePacker, apply_spike_compression, pack_bits, spike_packer, unpack_bits
from snn_explorer.core.model import detached_copy
from snn_explorer.core.planning import split_options
from snn_explorer.estimator import model_profile
from snn_explorer.estimator.memory.spike_compression import compressed_profile, spike_saving
from snn_explorer.estimator.profile.checkpointed import held_after_forward, levered_profile
from snn_explorer.estimator.timing.compute_work import rank_work
from snn_explorer.zoo import build
from snn_explorer.zoo.mlp import SpikingMLP

GATES = se.DistributedFeatureSet(allow_spike_compression=True)
GATES_AC = se.DistributedFeatureSet(allow_spike_compression=True, allow_activation_checkpointing=True)


def _plan(zoo, mode, topology, compress, checkpointing="none"):
    base = se.plan(analysis=se.analyze(zoo.model), objective="speed", topology=topology, batch_size=zoo.batch_size,
                   mode=mode, features=GATES_AC if checkpointing != "none" else GATES, options=se.PlanOptions(activation_checkpointing=checkpointing))
    return dataclasses.replace(base, spike_compression=compress)


# ---- the packer --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [1, 7, 8, 9, 1000])
def test_bits_restore_the_tensor_exactly(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    spikes = (torch.rand(numel, generator=g) < 0.3).to(dtype).reshape(-1, 1)
    bits = pack_bits(spikes)
    assert bits.dtype == torch.uint8 and bits.numel() == -(-numel // 8)
    back = unpack_bits(bits, spikes.shape, dtype)
    assert back.dtype == dtype and torch.equal(back, spikes)
    assert 0 < spikes.sum() < numel or numel < 8  # both values present where there is room for them


@pytest.mark.parametrize("value", [0.5, 2.0, -1.0, -0.0, float("nan"), float("inf"), 1e-30])
def test_a_tensor_that_is_not_0_or_1_is_saved_unchanged_and_counted(value):
    packer = SpikePacker()
    t = torch.tensor([0.0, 1.0, 1.0, value]).requires_grad_(False) * 1  # not a leaf needing a gradient
    assert packer.pack(t) is t
    assert packer.counts() == dict(packed=0, packed_bytes=0, stored_bytes=0, refused=1, refused_bytes=16)


def test_parameters_and_integer_tensors_are_left_alone():
    packer = SpikePacker()
    weight = nn.Parameter(torch.tensor([0.0, 1.0]))
    index = torch.tensor([0, 1])
    assert packer.pack(weight) is weight and packer.pack(index) is index
    assert packer.counts()["packed"] == packer.counts()["refused"] == 0


def test_gradients_are_bit_identical_in_one_process_and_both_kinds_are_seen():
    zoo = build("spikformer")
    model = zoo.model.double()
    runs = []
    for packer in (None, SpikePacker()):
        model.zero_grad(set_to_none=True)
        for m in model.modules():
            if isinstance(m, snntorch.SpikingNeuron):
                m.reset_mem()
        hooks = packer.hooks() if packer else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with hooks:
            out = model(zoo.example_input.double())
            loss = nn.functional.cross_entropy(out.mean(0), zoo.labels)
        loss.backward()
        runs.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        if packer:
            assert packer.packed > 0 and packer.refused > 0  # spikes packed, membranes and the like not
            assert packer.stored_bytes * 60 < packer.packed_bytes  # 1 bit for 64 (float64)
    assert runs[0][0].std() > 1e-3
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(runs[0][1][n], runs[1][1][n]) for n in runs[0][1])


@pytest.mark.parametrize("kw, error, match", [
    (dict(features=se.DistributedFeatureSet()), ValueError, "allow_spike_compression=True"),
    (dict(mode="pp", topology={"pp": 2}), ValueError, "pipeline stages"),
])
def test_plan_time_refusals_name_the_values(kw, error, match):
    zoo = build("mlp_all_steps")
    args = dict(analysis=se.analyze(zoo.model), objective="speed", topology={"dp": 2}, batch_size=8, mode="dp",
                features=GATES, activation_checkpointing="none")
    args.update(kw)
    base = se.plan(**split_options(args))
    with pytest.raises(error, match=match):
        dataclasses.replace(base, spike_compression=True)
    with pytest.raises(TypeError, match="spike_compression must be a bool"):
        dataclasses.replace(_plan(zoo, "dp", {"dp": 2}, False), spike_compression=1)


def test_bytes_saved_after_the_forward_as_the_detector_predicts():
    """spike_saving's bytes against what a compressed forward measurably no longer leaves for backward
    (storage meter after the forward, plain copy against compressed copy), on three zoo models."""
    for name in ("vgg", "spikformer", "mlp_all_steps"):
        zoo = build(name)
        n = zoo.batch_size // 2
        x, y = zoo.example_input[:, :n], zoo.labels[:n]
        plain, packed = detached_copy(zoo.model), detached_copy(zoo.model)
        apply_spike_compression(packed, _plan(zoo, "dp", {"dp": 2}, True))
        held = held_after_forward(plain, x, y)[0] - held_after_forward(packed, x, y)[0]
        predicted = spike_saving(model_profile(zoo.model, zoo.example_input, zoo.labels), n, zoo.time_steps)
        assert spike_packer(packed).packed > 0 and held > 0.2 * held_after_forward(plain, x, y)[0], name
        assert abs(predicted.saved_bytes - held) <= 0.01 * held, (name, predicted, held)


def test_packing_is_timed_once_on_a_checkpointed_profile():
    """The packer's check, pack and unpack are the estimate's ``extra_s`` (SpikeSaving.seconds); the counted step of
    a compressed profile is its base's, checkpointed or not (a compressed copy of a checkpointed model, counted on
    its own, held the packing operators a second time: 288 forward operators more on this stand-in)."""
    torch.manual_seed(0)
    model = SpikingMLP(6, (8,), 3, init_gain=3.0)
    x, y = torch.bernoulli(torch.full((8, 4, 6), 0.5)), torch.randint(0, 3, (4,))
    profile = model_profile(model, x, y)
    for checkpointing in ("none", "blocks"):
        plan = se.plan(analysis=se.analyze(model), objective="speed", topology={"dp": 1}, batch_size=4, mode="dp",
                       features=GATES_AC, options=se.PlanOptions(activation_checkpointing=checkpointing))
        levered = levered_profile(profile, plan)
        assert spike_saving(levered, 4, 8).packed > 0  # there is packing to count
        plain, packed = rank_work(levered, None, 1, "adam"), rank_work(compressed_profile(levered), None, 1, "adam")
        for phase in ("forward", "backward"):
            for figure in ("flops", "flop_bytes", "other_bytes", "ops"):
                assert getattr(packed.phase(phase), figure)(4, 8) == getattr(plain.phase(phase), figure)(4, 8), \
                    (checkpointing, phase, figure)
