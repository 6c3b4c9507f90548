"""Op-level selective activation checkpointing (``activation_checkpointing="ops"``, torchtitan's op policy):
the plan expresses it, its policy keeps the 1st, 3rd, ... matrix product of each block and recomputes the
rest, and on real gloo ranks (one 2-rank spawn) training with it equals training without it bit for bit
(float64, spikes firing) under fsdp2 and tp, while the measured peak drops as the estimate says
(within 5 %, the real and the shape-only profile).
(The tests on gloo ranks: tests/ranks/test_op_checkpointing_ranks.py.)"""
from collections import Counter

import pytest
import torch

import snn_explorer as se
from snn_explorer.compat import SAC_MM
from snn_explorer.core.model import TIME_MAJOR
from snn_explorer.core.parallelize import TORCHTITAN_OPS, checkpoint_blocks, repeated_blocks
from snn_explorer.core.planning import SNNDistributedPlan, split_options
from snn_explorer.estimator import model_profile
from snn_explorer.estimator.profile.step import is_token_labels, loss_of
from snn_explorer.zoo.llm import build_llm, token_batch

GATES = se.DistributedFeatureSet(allow_activation_checkpointing=True)
SHAPE = dict(dim=64, n_heads=4, ffn_dim=256, n_layers=2, vocab_size=128, tied_embeddings=False)
T, BATCH, SEQ, STEPS = 4, 4, 16, 2


def _model(dtype=torch.float64):
    torch.manual_seed(0)
    return build_llm("spiking-llm-tiny", **SHAPE).to(dtype)


def _plan(model, mode="fsdp2", topology=None, **levers):
    extra = dict(tensor_parallel_plan=model.tensor_parallel_plan()) if mode == "tp" else {}
    return se.plan(analysis=se.analyze(model), objective="memory", topology=topology or {"dp": 2},
                   batch_size=BATCH, mode=mode, features=GATES, **split_options({**extra, **levers}))


# ---- plan time and the policy ----------------------------------------------------------------------------
def test_the_plan_expresses_op_checkpointing_and_refuses_k():
    model = _model()
    plan = _plan(model, activation_checkpointing="ops")
    assert plan.activation_checkpointing == "ops" and "+ac:ops" in repr(plan)
    assert SNNDistributedPlan.from_dict(plan.to_dict()) == plan
    with pytest.raises(ValueError, match="checkpoint_every=2 does not go with activation_checkpointing='ops'"):
        _plan(model, activation_checkpointing="ops", checkpoint_every=2)


def test_every_second_matrix_product_of_each_block_is_recomputed():
    """A spiking block runs 6 matrix products (q, k, v, o, fc1, fc2): torchtitan's rule keeps the 1st, 3rd and
    5th of each block; the attention's batched products and every elementwise operator are recomputed."""
    assert [TORCHTITAN_OPS.saves(SAC_MM, i) for i in range(1, 7)] == [True, False, True, False, True, False]
    model = _model(torch.float32)
    tally: Counter = Counter()
    checkpoint_blocks(model, ["blocks.0", "blocks.1"], saved_ops=TORCHTITAN_OPS, tally=tally)
    model(token_batch(model.config, 2, 2, 8)).sum().backward()
    assert tally[("aten.mm.default", "save")] == 2 * 3 and tally[("aten.mm.default", "recompute")] == 2 * 3
    assert tally[("aten.bmm.default", "recompute")] == 2 * 2 and tally[("aten.bmm.default", "save")] == 0
    assert {decision for (op, decision) in tally if op != "aten.mm.default"} == {"recompute"}


def _batch():
    tokens = token_batch(_model().config, T, BATCH, SEQ, seed=1)
    return tokens, torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def small():
    """The float32 model the ranks measured, and its batch: one object, so its profiles are measured once."""
    return _model(torch.float32), _batch()


def _estimate(small, levers, hardware=None, shape_only=None):
    model, (tokens, targets) = small
    profile = model_profile(model, tokens, targets, layout=TIME_MAJOR, shape_only=shape_only)
    return se.estimate(model, _plan(model, activation_checkpointing=levers), example_input=tokens, labels=targets,
                       layout=TIME_MAJOR, profile=profile, hardware=hardware or se.hardware_profile("H100-SXM"))


def test_next_token_labels_give_the_cross_entropy_of_every_position():
    """The estimator's loss for a language model's labels [N, S]: torchtitan's, per position (T = 1: the scores
    as they are; T > 1: their time mean)."""
    scores, labels = torch.randn(1, 2, 5, 7), torch.randint(0, 7, (2, 5))
    want = torch.nn.functional.cross_entropy(scores[0].reshape(10, 7), labels.reshape(10))
    assert is_token_labels(scores, labels) and not is_token_labels(scores[0, :, 0], labels[:, 0])
    assert torch.equal(loss_of(scores, labels), want)
    steps = torch.randn(3, 2, 5, 7)
    assert torch.allclose(loss_of(steps, labels), torch.nn.functional.cross_entropy(
        steps.mean(0).reshape(10, 7), labels.reshape(10)))


def test_ops_checkpoint_the_repeated_blocks_only():
    """As torchtitan wraps ``model.layers``: the decoder blocks, not the embedding, final norm or output layer."""
    model = _model()
    units = ("embed", "blocks.0", "blocks.1", "norm", "head")
    assert repeated_blocks(model, units) == ["blocks.0", "blocks.1"]
    assert repeated_blocks(model, ("embed", "head")) == ["embed", "head"]


def test_gpu_trace_counts_op_checkpointing_as_the_cpu_profile_does(small):
    """On a kernel_model profile (the step traced on meta as the GPU runs it) the kept activations are the
    CPU profile's, up to the CUDA allocator's 512-byte rounding."""
    cpu = _estimate(small, "ops", shape_only=False).per_rank["activations_bytes"].max()
    gpu = _estimate(small, "ops", hardware="RTX-4090-PCIe-noP2P", shape_only=False).per_rank["activations_bytes"].max()
    assert cpu <= gpu <= cpu * 1.05, (cpu, gpu)
