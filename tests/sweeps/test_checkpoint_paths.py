"""A checkpointed profile's rank model is new only along the modules checkpointing changes
(core.module_copy.copy_along), the rest shared with the plain rank model, instead of a whole copy: every estimate
figure of every checkpointed variant (blocks every 1st / 2nd, time chunks, with spike compression and offload) equals
the copying path's, on an all-steps MLP deep enough to be composed from cut runs, a per-step MLP (time chunks) and
the zoo's Spikformer (blocks in a ModuleList)."""
import pandas as pd
import pytest
import torch
from torch import nn

import snn_explorer as se
from snn_explorer.core.levers import copy_without_levers, find_time_step_module, lever_variants
from snn_explorer.core.model import copy_along, detached_copy
from snn_explorer.estimator import estimate
from snn_explorer.estimator.budget_fit import FIT_FEATURES
from snn_explorer.estimator.enumerate import enumerate_plans
from snn_explorer.estimator.profile import checkpointed
from snn_explorer.estimator.profile.checkpointed import levered_profile
from snn_explorer.estimator.profile.profiling import ModelProfile, measure_profile
from snn_explorer.zoo import SpikingMLP, build


def _estimates(model, x, labels, plans):
    profile = measure_profile(model, x, labels)
    return profile, [estimate(model, p, example_input=x, labels=labels, profile=profile, hardware="H100-SXM")
                     for p in plans]


def _models():
    """(model, input, labels, the modes whose plans are checked)."""
    torch.manual_seed(0)
    yield SpikingMLP(16, (16,) * 8, 8, stepping="all_steps"), torch.rand(2, 4, 16) * 4, None, ("fsdp2", "tp", "pp")
    yield SpikingMLP(16, (16,) * 2, 8, stepping="per_step"), torch.rand(3, 4, 16) * 4, None, ("fsdp2", "tp")
    zoo = build("spikformer")
    yield zoo.model, zoo.example_input, zoo.labels, ("fsdp2",)  # every 1st block, with compression (not offloaded)


@pytest.mark.parametrize("index", range(3))
def test_checkpointed_profiles_along_their_paths_equal_whole_copies(monkeypatch, index):
    model, x, labels, modes = list(_models())[index]
    analysis = se.analyze(model, example_input=x, labels=labels)
    step_module = find_time_step_module(model, x)
    bases = {copy_without_levers(p) for p in enumerate_plans(analysis, world_size=2, batch_size=x.shape[1],
                                                             features=FIT_FEATURES)}
    plans = [v for b in sorted(bases, key=str)
             for v in lever_variants(b, step_module, offload=True, chunk_every=(1, 2))
             if v.activation_checkpointing != "none" and v.mode in modes
             and (index < 2 or (v.checkpoint_every == 1 and not v.cpu_offload))]
    assert plans and (step_module is None or any(p.activation_checkpointing == "time_chunks" for p in plans))
    profile, fast = _estimates(model, x, labels, plans)
    # shared: a checkpointed rank model's parameters are the plain one's
    some = levered_profile(profile, plans[0])
    plain = ModelProfile.rank_model(profile, plans[0].tensor_parallel_plan, plans[0].tp_size)[1]
    assert next(some.rank_model(plans[0].tensor_parallel_plan, plans[0].tp_size)[1].parameters()) is \
        next(plain.parameters())
    monkeypatch.setattr(checkpointed, "copy_along", lambda m, _paths: detached_copy(m))
    slow_profile, slow = _estimates(model, x, labels, plans)
    copied = levered_profile(slow_profile, plans[0]).rank_model(plans[0].tensor_parallel_plan, plans[0].tp_size)[1]
    slow_plain = ModelProfile.rank_model(slow_profile, plans[0].tensor_parallel_plan, plans[0].tp_size)[1]
    assert next(copied.parameters()) is not next(slow_plain.parameters())  # the slow path did copy the whole model
    for plan, got, want in zip(plans, fast, slow):
        pd.testing.assert_frame_equal(got.per_rank, want.per_rank, check_exact=True)
        assert (got.peak_bytes, got.step_time_s) == (want.peak_bytes, want.step_time_s), plan
    # non-trivial: checkpointing lowers the activations somewhere
    _, (unlevered,) = _estimates(model, x, labels, [copy_without_levers(plans[0])])
    assert min(e.per_rank["activations_bytes"].max() for e in fast) < unlevered.per_rank["activations_bytes"].max()


def test_copy_along_makes_new_only_the_named_paths_and_their_ancestors():
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.Linear(2, 2))
    copy_ = copy_along(model, ["0.1"])
    assert copy_ is not model and copy_[0] is not model[0] and copy_[0][1] is not model[0][1]
    assert copy_[0][0] is model[0][0] and copy_[1] is model[1] and copy_[0][1]._parameters is model[0][1]._parameters
    copy_[0][1].forward = lambda x: x * 0
    copy_.register_forward_hook(lambda m, a, out: None)
    assert torch.equal(copy_(torch.ones(1, 2)), model[1](torch.zeros(1, 2)))
    assert "forward" not in vars(model[0][1]) and not model._forward_hooks
    with pytest.raises(ValueError, match="'0.5' is not a module"):
        copy_along(model, ["0.5"])
