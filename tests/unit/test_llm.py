"""The zoo's decoder-only (spiking) language model: runs and learns signal at test size, builds every
named size on the meta device, and profiles shape-only as it profiles for real.
(The tests on gloo ranks: tests/ranks/test_llm_ranks.py.)"""
import pytest
import torch

from snn_explorer.estimator.profile.profiling import measure_profile
from snn_explorer.zoo.llm import LLM_CONFIGS, MultiStepLIF, build_llm, token_batch


def test_tiny_spiking_llm_forward_backward_with_spikes_firing():
    torch.manual_seed(0)
    model = build_llm("spiking-llm-tiny")
    x = token_batch(model.config, 4, 2, 8)
    rates = {}
    for name, module in model.named_modules():
        if isinstance(module, MultiStepLIF):
            module.register_forward_hook(lambda m, a, out, name=name: rates.__setitem__(name, out.float().mean().item()))
    out = model(x)
    assert out.shape == (4, 2, 8, 64) and out.std() > 0
    assert len(rates) == 2 * 5 and all(0 < r < 1 for r in rates.values()), rates  # every neuron fires, not always
    out.square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    assert model.head.weight is model.embed.weight  # tied


@pytest.mark.parametrize("name", list(LLM_CONFIGS))
def test_named_sizes_build_on_meta_with_their_parameter_counts(name):
    model = build_llm(name, device="meta")
    assert next(model.parameters()).device.type == "meta"
    assert sum(p.numel() for p in model.parameters()) == model.config.param_count()


def test_llama_3_1_8b_has_its_published_parameter_count():
    assert round(LLM_CONFIGS["llama3.1-8b"].param_count() / 1e9, 2) == 8.03  # Meta's model card: 8.03 B


def test_tiny_llm_shape_only_profile_equals_the_real_one():
    torch.manual_seed(0)
    model = build_llm("spiking-llm-tiny")
    x = token_batch(model.config, 3, 4, 8)
    real = measure_profile(model, x)
    fake = measure_profile(model, x, shape_only=True)
    assert real.step_counts[0][0][0] > 0 and sum(m.state(2, 2) for m in real.modules.values()) > 0
    assert real.modules == fake.modules and real.step_counts == fake.step_counts
