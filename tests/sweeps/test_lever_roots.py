"""Spike compression's and activation offload's profiles run the base rank model under a root of its own
(core.module_copy.root_over_children) instead of a whole copy: every estimate figure of every lever variant (fsdp2,
tp; checkpointed, compressed, offloaded) equals the copying path's, on an all-steps MLP whose spikes fire."""
import pandas as pd
import torch
from torch import nn

import snn_explorer as se
from snn_explorer.core.levers import apply_spike_compression, copy_without_levers, lever_variants
from snn_explorer.core.model import detached_copy, root_over_children
from snn_explorer.core.parallelize import apply_activation_checkpointing
from snn_explorer.estimator import estimate
from snn_explorer.estimator.budget_fit import FIT_FEATURES
from snn_explorer.estimator.enumerate import enumerate_plans
from snn_explorer.estimator.memory import activation_offload, spike_compression
from snn_explorer.estimator.profile.checkpointed import CheckpointedProfile
from snn_explorer.estimator.profile.profiling import ModelProfile, measure_profile
from snn_explorer.zoo import SpikingMLP


def _copied(base, tp_plan, tp):
    """The copying path: a whole copy of the plain rank model, checkpointed again, then packing."""
    copy_ = detached_copy(ModelProfile.rank_model(base, tp_plan, tp)[1])
    if isinstance(base, CheckpointedProfile):
        apply_activation_checkpointing(copy_, base.plan, base.fsdp_units)
    apply_spike_compression(copy_, spike_compression._COMPRESSED)
    return copy_


def _estimates(model, x, plans):
    profile = measure_profile(model, x)
    return [estimate(model, p, example_input=x, profile=profile, hardware="H100-SXM") for p in plans]


def test_lever_profiles_over_a_root_of_their_own_equal_whole_copies(monkeypatch):
    torch.manual_seed(0)
    model, x = SpikingMLP(16, (32,) * 3, 8, stepping="all_steps"), torch.rand(3, 4, 16) * 4
    analysis = se.analyze(model, example_input=x)
    bases = {}
    for p in enumerate_plans(analysis, world_size=2, batch_size=4, features=FIT_FEATURES):
        bases.setdefault(p.mode, copy_without_levers(p))
    plans = lever_variants(bases["fsdp2"], offload=True) + lever_variants(bases["tp"], offload=True)
    assert any(p.activation_offload for p in plans) and any(p.spike_compression and p.tp_size > 1 for p in plans)
    fast = _estimates(model, x, plans)
    monkeypatch.setattr(spike_compression, "_compressed_copy", _copied)
    monkeypatch.setattr(activation_offload, "root_over_children", detached_copy)
    slow = _estimates(model, x, plans)
    for plan, got, want in zip(plans, fast, slow):
        pd.testing.assert_frame_equal(got.per_rank, want.per_rank, check_exact=True)
        assert got.step_time_s == want.step_time_s, plan
    # non-trivial: spikes are packed (a compressed plan's activations below the plain plan's)
    plain = _estimates(model, x, [bases["fsdp2"]])[0]
    packed = next(e for p, e in zip(plans, fast) if p.spike_compression and p.activation_checkpointing == "none"
                  and not p.cpu_offload and p.tp_size == 1)
    assert packed.per_rank["activations_bytes"].max() < plain.per_rank["activations_bytes"].max()


def test_a_root_over_children_shares_them_and_keeps_its_hooks_to_itself():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    root = root_over_children(model)
    calls = []
    root.register_forward_pre_hook(lambda m, a: calls.append("root"))
    model(torch.ones(1, 2))
    assert calls == [] and root[0] is model[0] and root[0].weight is model[0].weight
    root(torch.ones(1, 2))
    assert calls == ["root"] and not model._forward_pre_hooks
