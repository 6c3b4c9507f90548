"""Messages that say why: a forward looping over time refused for pp, snntorch neurons without module state."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from snn_explorer import PlanOptions, analyze, plan
from snn_explorer.explorer import Explorer, analysis_table
from snn_explorer.zoo import build

os.environ.setdefault("MPLBACKEND", "Agg")


class RangeLoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return torch.stack([self.b(self.a(x[t])) for t in range(x.shape[0])])


class Branching(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        return self.b(h) if h.sum() > 0 else self.b(-h)


def _pp_error(model) -> str:
    with pytest.raises(ValueError) as info:
        plan(analysis=analyze(model), objective="speed", topology={"pp": 2}, mode="pp", batch_size=4, options=PlanOptions(pp_layout="1|1"))
    return str(info.value)


@pytest.mark.parametrize("model", [build("mlp").model, RangeLoop()], ids=["for x_t in x", "range(T)"])
def test_a_forward_looping_over_time_is_refused_for_pp_saying_the_loop_is_why(model):
    message = _pp_error(model)
    assert "torch.fx cannot trace its forward" in message
    assert "the forward loops over the time steps of its input" in message
    assert "move the time loop into the layers" in message and "choose a mode without pp" in message


def test_other_trace_failures_get_no_time_loop_story():
    message = _pp_error(Branching())
    assert "torch.fx cannot trace its forward" in message and "time steps" not in message
    assert "nn.Sequential" in message


def test_the_ui_shows_the_time_loop_reason_when_pp_is_chosen():
    ui = Explorer.from_zoo(build("mlp")).ui
    ui.mode.value = "pp"
    ui.pp.value = 2
    assert ui.current is None and "loops over the time steps" in ui.message.value


def test_snntorch_neurons_with_explicit_membranes_are_explained_not_just_zero_stateful():
    ex = Explorer.from_zoo(build("mlp_tutorial"))
    assert ex.analysis.memory_module_names == () and len(ex.analysis.explicit_state_names) == 2
    assert "0 stateful + 2 snntorch neurons whose membrane forward passes (init_hidden=False" in repr(ex)
    table = analysis_table(ex.analysis).set_index("path")
    for name in ex.analysis.explicit_state_names:
        assert not table.loc[name, "stateful"] and "init_hidden=False" in table.loc[name, "note"]
    plain = Explorer.from_zoo(build("mlp"))
    assert "snntorch neurons whose membrane" not in repr(plain)


def test_the_analysis_says_the_time_loop_is_why_a_model_has_no_pipeline_units():
    analysis = analyze(build("mlp").model)
    assert analysis.pipeline_units == () and "loops over the time steps" in analysis.pipeline_problem
    assert analyze(build("mlp_all_steps").model).pipeline_problem == ""
