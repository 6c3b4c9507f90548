"""Shape-only profiling (estimator/profile/shape_only.py): the profile of FakeTensor runs equals the
real profile (bytes and FLOPs exact), is chosen for models this machine cannot hold, and refuses
models whose forward reads tensor values."""

import pytest
import torch
from models import SEWResNet
from torch import nn

from snn_explorer.core.model import TIME_MAJOR
from snn_explorer.estimator.profile import profiling
from snn_explorer.estimator.profile.profiling import measure_profile, model_profile
from snn_explorer.estimator.profile.shape_only import ShapeOnlyError
from snn_explorer.zoo import build


def _same_profile(real, fake, sizes):
    """Every fitted figure of the two profiles, and their runs at ``sizes``, are equal."""
    assert fake.shape_only and not real.shape_only
    assert next(fake.model.parameters()).device.type == "meta"
    assert real.modules == fake.modules  # saved bytes, neuron state, calls, sizes per module (fits, exact)
    assert real.step_counts == fake.step_counts  # FLOPs, bytes moved, operators per phase and size
    assert (real.input_bytes, real.grad_ready_order, real.grad_params, real.params, real.buffers) == \
        (fake.input_bytes, fake.grad_ready_order, fake.grad_params, fake.params, fake.buffers)
    for n, t in sizes:
        assert real.saved_and_state(n, t) == fake.saved_and_state(n, t)
        assert real.logged_run(n, t, None, 1)["log"].events == fake.logged_run(n, t, None, 1)["log"].events


@pytest.mark.parametrize("name", ["mlp", "mlp_all_steps"])
def test_shape_only_profile_equals_the_real_one_on_the_zoo(name):
    z = build(name)
    real = measure_profile(z.model, z.example_input, z.labels)
    fake = measure_profile(z.model, z.example_input, z.labels, shape_only=True)
    # non-trivial: the model saves activations, keeps neuron state and does FLOPs
    assert sum(m.saved(2, 2) for m in real.modules.values()) > 0 and real.step_counts[0][0][0] > 0
    assert sum(m.state(2, 2) for m in real.modules.values()) > 0
    _same_profile(real, fake, [(5, 7)])


def test_shape_only_profile_of_a_spikingjelly_model():
    torch.manual_seed(0)
    model, x = SEWResNet(), torch.rand(2, 3, 2, 4, 4)
    real = measure_profile(model, x)
    fake = measure_profile(model, x, shape_only=True)
    assert sum(m.state(2, 2) for m in real.modules.values()) > 0
    _same_profile(real, fake, [(3, 3)])


def test_a_model_that_would_not_fit_here_is_profiled_shape_only(monkeypatch):
    z = build("mlp")
    real = measure_profile(z.model, z.example_input, z.labels)
    monkeypatch.setattr(profiling, "_physical_memory", lambda: 64 * 1024)  # a 64 KiB machine
    chosen = measure_profile(z.model, z.example_input, z.labels)
    _same_profile(real, chosen, [(4, 6)])
    assert not profiling.run_fits(real, 4, 6)  # a real profile's runs of that size go shape-only too
    before = len(real.logs)
    real.logged_run(64, 32, None, 1)
    assert len(real.logs) == before + 1


class _BranchOnValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = _Gate()

    def forward(self, x):
        return self.gate(self.fc(x))


class _Gate(nn.Module):
    def forward(self, x):
        return x * 2 if x.sum() > 0 else x  # control flow on a tensor's value


class _KeepActive(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)[x[..., 0] > 0.5]  # the output's shape depends on the data


@pytest.mark.parametrize("model, op, where", [
    (_BranchOnValue(), r"aten\._local_scalar_dense", r"in module 'gate'"),
    (_KeepActive(), r"aten\.(nonzero|masked_select|index)", r"in module 'the model'"),
])
def test_data_dependent_models_are_refused_naming_the_operator(model, op, where):
    x = torch.rand(2, 3, 4)
    measure_profile(model, x)  # the real profile runs
    with pytest.raises(ShapeOnlyError, match=rf"cannot follow this model: operator {op}\S* {where}.*data-dependent"):
        measure_profile(model, x, shape_only=True)
    with torch.device("meta"):
        on_meta = type(model)()
    with pytest.raises(ShapeOnlyError, match=op):
        model_profile(on_meta, x, layout=TIME_MAJOR)
