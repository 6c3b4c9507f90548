"""The pipeline units found by the root-only torch.fx trace equal those of the full trace.

``forward_chain`` traces a root's forward with ``compat.RootOnlyFxTracer`` (torch.fx's setup walk of
every module skipped) and falls back to the full ``torch.fx`` trace for a refusal's words; the
reference here is the full trace alone, opened with ``get_submodule`` as ``pipeline_units`` did.
"""
import pytest
import torch
from torch import nn

from snn_explorer.compat import RootOnlyFxTracer
from snn_explorer.core.model import TIME_LOOP_HINT, TIME_LOOP_SIGNS, one_walk, pipeline_units, resolve_family, structure
from snn_explorer.core.model.families import _from_name
from snn_explorer.zoo import ZOO_NAMES, SpikingMLP, build
from snn_explorer.zoo.llm import build_llm


def _full_chain(model: nn.Module) -> tuple:
    if structure.is_plain_sequential(model):
        return tuple(name for name, _ in model.named_children()), ""
    return structure._chain_traced_by(model, structure._ChildrenAreLeaves())


def _reference_units(model: nn.Module) -> tuple:
    """pipeline_units as computed before: the full trace, each unit looked up with get_submodule."""
    chain, problem = _full_chain(model)
    if problem:
        return (), problem + (TIME_LOOP_HINT if any(sign in problem for sign in TIME_LOOP_SIGNS) else "")
    units = []
    for name in chain:
        module = model.get_submodule(name)
        if structure.is_plain_sequential(module) and len(module):
            units.extend(f"{name}.{n}" for n in _reference_units(module)[0])
        else:
            units.append(name)
    return tuple(units), ""


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(x + self.a(x))


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = torch.full((4,), 2.0)  # a plain tensor attribute: torch.fx gets it by its path

    def forward(self, x):
        return self.lin(x)


class _GrandchildConstant(nn.Module):
    """A forward reading a tensor held two levels down: refused, naming its path."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(_Inner())
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x) * self.a[0].scale)


class _Indexed(nn.Module):
    """A forward calling grandchildren by index, after a child method that changes a grandchild."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        self.body[1].inplace = True  # restored after the trace
        return self.head(self.body[1](self.body[0](x)))


class _SharedPath(nn.Module):
    """A Sequential whose first layer is also the root's own child: its path in the walk is 'x'."""

    def __init__(self):
        super().__init__()
        self.x = nn.Linear(4, 4)
        self.s = nn.Sequential(self.x, nn.ReLU())

    def forward(self, inp):
        return self.s(inp)


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x, y):
        return self.a(x)


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        return self.a(self.a(x))


def _models():
    for name in ZOO_NAMES:
        yield name, build(name).model
    yield "llm tied", build_llm("spiking-llm-tiny")
    yield "llm untied", build_llm("spiking-llm-tiny", tied_embeddings=False, n_layers=3)
    yield "deep mlp", SpikingMLP(in_features=8, hidden=(8,) * 40, num_classes=4, stepping="all_steps")
    yield "per-step mlp", SpikingMLP(in_features=8, hidden=(8,) * 3, num_classes=4)
    for cls in (_Residual, _GrandchildConstant, _Indexed, _SharedPath, _TwoInputs, _Twice):
        yield cls.__name__, cls()


MODELS = dict(_models())


@pytest.mark.parametrize("name", MODELS)
def test_root_only_trace_finds_the_full_traces_units_and_refusals(name):
    model = MODELS[name]
    before = [(n, type(m), dict(m.__dict__)) for n, m in model.named_modules()]
    expected = _reference_units(model)
    assert pipeline_units(model) == expected, name
    with one_walk():  # as analyze calls it: the module table of one walk
        assert pipeline_units(model) == expected, name
    assert [(n, type(m), dict(m.__dict__)) for n, m in model.named_modules()] == before, name


def test_the_cases_are_not_trivial():
    """Chains of several units, dotted and opened ones, and refusals of each kind are compared."""
    found = {name: _reference_units(model) for name, model in MODELS.items()}
    assert len(found["deep mlp"][0]) == 81 and found["deep mlp"][0][0] == "net.0"
    assert found["llm untied"][0] == ("embed", "blocks.0", "blocks.1", "blocks.2", "norm", "head")
    assert found["_Indexed"][0] == ("body.0", "body.1", "head")
    assert found["_SharedPath"][0] == ("s.0", "s.1")
    assert "loops over the time steps" in found["per-step mlp"][1]
    assert "get_attr 'a.0.scale'" in found["_GrandchildConstant"][1]
    assert "call_function 'add'" in found["_Residual"][1]
    assert "more than one input" in found["_TwoInputs"][1]
    assert "calls 'a' twice" in found["_Twice"][1]


def test_a_refusal_of_the_root_only_trace_is_worded_by_the_full_one():
    """The root-only trace names a tensor held below the root as a constant; the refusal shown names its path."""
    model = MODELS["_GrandchildConstant"]
    paths = {m: n for n, m in model.named_modules()}
    assert "_tensor_constant0" in structure._chain_traced_by(model, RootOnlyFxTracer(paths))[1]
    assert "'a.0.scale'" in structure.forward_chain(model)[1]


class VGGHead(nn.Linear):
    """A class whose name infers the VGG family."""


def test_the_family_is_inferred_from_the_first_module_class_that_names_one():
    """Each class name is matched once; the answer is the first module's (in module order) whose class
    names a family besides the generic one, as a match of every module's class name gives."""
    model = nn.Sequential(SpikingMLP(in_features=4, hidden=(4,) * 5, num_classes=2), VGGHead(2, 2),
                          build("spikformer").model)
    every = [_from_name(type(m).__name__) for m in model.modules()]
    expected = next(f for f in every if f not in (None, "generic"))
    assert expected == "cifar10dvs_vgg" and "spikformer" in every
    assert resolve_family(model, None)[0] == expected
    assert resolve_family(build("mlp").model, None) == ("generic", None)
