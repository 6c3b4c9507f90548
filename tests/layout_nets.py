"""One spiking network written three ways, for the data-layout tests (tests/unit/test_layouts.py in one
process, tests/ranks/test_layouts_ranks.py on gloo ranks): time-major ``[T, N, F]``, batch-major ``[N, T, F]``
and called per step on ``[N, F]``, with one set of weights."""
import torch
from torch import nn

from snn_explorer.core.model import BATCH_MAJOR, PER_STEP, TIME_MAJOR, DataLayout, reset_all

F_IN, HIDDEN, CLASSES, T, N = 6, 16, 4, 3, 4


def _lif(step_mode: str) -> nn.Module:
    from spikingjelly.activation_based import neuron, surrogate

    return neuron.LIFNode(tau=2.0, v_threshold=0.5, surrogate_function=surrogate.ATan(), detach_reset=True,
                          step_mode=step_mode)


class TimeMajorNet(nn.Module):
    """``[T, N, F]`` -> ``[T, N, C]``: spikingjelly multi-step LIF neurons, input neurons first."""

    def __init__(self, step_mode: str = "m"):
        super().__init__()
        self.net = nn.Sequential(_lif(step_mode), nn.Linear(F_IN, HIDDEN), _lif(step_mode), nn.Linear(HIDDEN, CLASSES))

    def forward(self, x):
        return self.net(x)


class BatchMajorNet(TimeMajorNet):
    """``[N, T, F]`` -> ``[N, T, C]`` (as a DataLoader stacks samples), the same network inside."""

    def forward(self, x):
        return self.net(x.transpose(0, 1)).transpose(0, 1)


class PerStepNet(TimeMajorNet):
    """``[N, F]`` -> ``[N, C]`` per call, neuron state carried from call to call (single-step neurons)."""

    def __init__(self):
        super().__init__("s")


def nets():
    """The three models with one set of weights, and the layout each takes."""
    torch.manual_seed(0)
    reference = TimeMajorNet().double()
    with torch.no_grad():  # weights wide enough that the hidden neurons fire too
        for layer in (reference.net[1], reference.net[3]):
            layer.weight.normal_(0.0, 1.5)
            layer.bias.fill_(0.3)
    out = {}
    for cls, layout in ((TimeMajorNet, TIME_MAJOR), (BatchMajorNet, BATCH_MAJOR), (PerStepNet, PER_STEP)):
        model = cls().double()
        model.load_state_dict(reference.state_dict())
        out[layout.name] = (model, layout)
    return out


def data(n: int = N, t: int = T):
    """Time-major inputs ``[T, N, F]`` (strong enough to make the input neurons fire) and labels."""
    g = torch.Generator().manual_seed(3)
    return torch.rand(t, n, F_IN, generator=g, dtype=torch.float64) * 1.6, torch.arange(n) % CLASSES


def as_layout(x: torch.Tensor, layout: DataLayout) -> torch.Tensor:
    """The time-major batch ``x`` as ``layout`` takes it (written out here, not by the code under test)."""
    return x.transpose(0, 1).contiguous() if layout.input == "batch_major" else x


def firing_and_outputs(model, layout, x):
    """Spike rate of every LIF neuron and the time-major outputs of one run of ``model``."""
    rates = {}
    def record(name):
        return lambda _m, _i, out: rates.setdefault(name, []).append(float(out.detach().mean()))
    hooks = [m.register_forward_hook(record(name)) for name, m in model.named_modules() if hasattr(m, "v_threshold")]
    reset_all(model)
    xs = as_layout(x, layout)
    out = torch.stack([model(step) for step in xs]) if layout.per_step else model(xs)
    for h in hooks:
        h.remove()
    return {k: sum(v) / len(v) for k, v in rates.items()}, (out.transpose(0, 1) if layout.output == "batch_major"
                                                             else out)
