"""Checkpointing chosen block by block (issue 33): the plan field and its refusals, training with the chosen blocks
recomputed equals training without (to 0 difference, spikes firing), and fit_budget choosing the blocks by estimate.

The measured peak of a per-block plan on real gloo ranks against its estimate is a case of test_memory_levers'
shared 2-rank group (MEMORY_CASES).
"""
import dataclasses

import pytest
import torch
from models import adam_steps_recording_spikes

import snn_explorer as se
from snn_explorer.core.levers import choose_blocks, copy_without_levers, lever_label, with_blocks
from snn_explorer.core.model import detached_copy
from snn_explorer.core.parallelize import checkpoint_blocks
from snn_explorer.core.planning import split_options
from snn_explorer.zoo import build

GATES = se.DistributedFeatureSet(allow_activation_checkpointing=True)


def _plan(zoo, **kw):
    return se.plan(analysis=se.analyze(zoo.model), objective="memory", topology={"dp": 2}, mode="fsdp2",
                   batch_size=zoo.batch_size, features=GATES, **split_options(kw))


def test_plan_field_refusals_and_json():
    zoo = build("mlp_all_steps")
    plan = _plan(zoo, activation_checkpointing="blocks", checkpoint_blocks=["net.2"])
    assert plan.checkpoint_blocks == ("net.2",) and lever_label(plan) == "+ac:blocks[net.2]"
    assert se.SNNDistributedPlan.from_dict(plan.to_dict()) == plan
    assert copy_without_levers(plan).checkpoint_blocks == ()
    with pytest.raises(ValueError, match=r"needs activation_checkpointing='blocks', not 'none'"):
        _plan(zoo, activation_checkpointing="none", checkpoint_blocks=("net.2",))
    with pytest.raises(ValueError, match="checkpoint_every=2 both say"):
        _plan(zoo, activation_checkpointing="blocks", checkpoint_every=2, checkpoint_blocks=("net.2",))
    with pytest.raises(ValueError, match="names a block twice"):
        _plan(zoo, activation_checkpointing="blocks", checkpoint_blocks=("net.2", "net.2"))
    with pytest.raises(ValueError, match=r"\['net.1'\], which are not blocks of this model; its blocks are "
                                         r"\['net.0', 'net.2', 'net.4'\]"):
        _plan(zoo, activation_checkpointing="blocks", checkpoint_blocks=("net.1",))
    with pytest.raises(TypeError, match="checkpoint_blocks must be a list of strings"):
        dataclasses.replace(plan, checkpoint_blocks="net.2")
    with pytest.raises(ValueError, match="not blocks of this model"):  # apply checks it before any process group
        se.apply(model=build("vgg").model, plan=plan, device_type="cpu")


def test_training_with_chosen_blocks_equals_training_without():
    """Three Adam steps of vgg (float64) with two of its six blocks recomputed equal three without, to 0 difference;
    spikes fire (mean rate strictly between 0 and 1) and the loss moves."""
    zoo = build("vgg")
    units = se.analyze(zoo.model).fsdp_unit_names
    plain = adam_steps_recording_spikes(detached_copy(zoo.model).double(), zoo)
    model = detached_copy(zoo.model).double()
    assert checkpoint_blocks(model, units, only=(units[0], units[3])) == 2
    chosen = adam_steps_recording_spikes(model, zoo)
    losses, params, rates = plain
    assert 0 < sum(rates) / len(rates) < 1 and max(rates) > 0 and losses[0] != losses[-1]
    assert chosen[0] == losses
    assert all(torch.equal(chosen[1][n], params[n]) for n in params)


def test_blocks_chosen_by_estimate_keep_the_cheap_ones():
    """vgg on 2 fsdp2 ranks at 90 % of its unlevered peak: the blocks chosen one by one (greedy by saved bytes
    freed per recompute second) reach the uniform checkpointing's estimated peak and recompute less (a faster
    step), keep some blocks, and are the greedy order's first set that fits (fit_budget's choice of them: the
    property test in test_fit)."""
    zoo = build("vgg")
    estimate_of = se.plan_estimator(zoo.model, zoo.example_input, zoo.labels, hardware="H100-SXM")
    base = copy_without_levers(_plan(zoo))
    base_est = estimate_of(base)
    budget = int(0.9 * base_est.peak_bytes)
    units = se.analyze(zoo.model).fsdp_unit_names
    choice = choose_blocks(base, units, estimate_of, budget)
    uniform = estimate_of(with_blocks(base, ()))
    assert choice.plan is not None and choice.estimate.peak_bytes <= budget < base_est.peak_bytes
    assert choice.estimate.peak_bytes <= uniform.peak_bytes and choice.estimate.step_time_s < uniform.step_time_s
    assert 0 < len(choice.plan.checkpoint_blocks) < len(units)  # keeps the cheap blocks
    # greedy by value: each block recomputed frees at least as many saved bytes per added second (each block's own
    # estimate, recomputed alone) as any block kept
    gain = {}
    for u in units:
        alone = estimate_of(with_blocks(base, (u,)))
        freed, added = base_est.activations_bytes - alone.activations_bytes, alone.step_time_s - base_est.step_time_s
        gain[u] = freed / added if added > 0 else float("inf") if freed > 0 else float("-inf")
    recomputed = set(choice.plan.checkpoint_blocks)
    assert all(gain[u] > 0 for u in recomputed)
    assert min(gain[u] for u in recomputed) >= max(gain[u] for u in units if u not in recomputed), gain
    assert all(e.peak_bytes > budget for _, e in choice.tried[:-1])  # stopped at the first that fits
    assert "recomputed (greedy by saved bytes freed per recompute second" in choice.note(base_est.peak_bytes)


def test_a_set_of_every_block_is_the_uniform_plan():
    """Where the greedy adds every block, its last set is the uniform every-block plan (no named copy of it): a
    stand-in estimate whose peak falls with each block recomputed."""
    zoo = build("vgg")
    base = copy_without_levers(_plan(zoo))
    units = se.analyze(zoo.model).fsdp_unit_names

    class Est:
        def __init__(self, p):
            on = p.activation_checkpointing == "blocks"
            k = len(p.checkpoint_blocks or units) if on else 0
            self.peak_bytes, self.step_time_s, self.activations_bytes = 1000 - 10 * k, 1.0 + k, 500 - 10 * k

    choice = choose_blocks(base, units, Est)
    uniform = dataclasses.replace(base, activation_checkpointing="blocks")
    assert len(choice.tried) == len(units) and choice.tried[-1][0] == uniform == choice.plan
    assert [len(p.checkpoint_blocks) for p, _ in choice.tried[:-1]] == list(range(1, len(units)))
    assert "by block: every block recomputed" in choice.note(1000)
