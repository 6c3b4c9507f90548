"""Closure: every plan() result applies. Exhaustive over objectives, named factorisations of 1-8 ranks,
model families, explicit modes and the experimental TP gates; a representative subset is applied on
real gloo ranks (the gated TP paths are applied on ranks in test_families).
(The tests on gloo ranks: tests/ranks/test_closure_ranks.py.)"""
import itertools
import re

import pytest
import torch
from torch import nn

import snn_explorer as se
from snn_explorer.core.common import MODES
from snn_explorer.core.planning import SNN_DISTRIBUTED_PREFERENCES, topology_problem

NAMES = ("dp", "tp", "x")
FAMILY_MODELS = {"generic": "mlp", "cifar10dvs_vgg": "vgg", "spikformer": "spikformer"}
BATCH = 840  # divisible by every dp size up to 8


def factorisations(world):
    """Every assignment of ``world`` to 1-3 named dims (size-1 dims included), in every order."""
    out = []
    for k in (1, 2, 3):
        for names in itertools.permutations(NAMES, k):
            for sizes in itertools.product(range(1, world + 1), repeat=k):
                if torch.tensor(sizes).prod().item() == world:
                    out.append(dict(zip(names, sizes)))
    return out


def all_cases(worlds=range(1, 9)):
    for world in worlds:
        for topology in factorisations(world):
            for family in FAMILY_MODELS:
                for objective in SNN_DISTRIBUTED_PREFERENCES:
                    for mode in (None,) + MODES:
                        yield world, topology, family, objective, mode


def _check_refusal(message: str, mode, topology) -> None:
    """A refusal names the mode (or every mode tried) and the exact reason for each."""
    if mode is None:
        head = f"no mode fits topology {dict(topology.dims)} for this model: "
        assert message.startswith(head), message
        names = "|".join(sorted(map(re.escape, MODES), key=len, reverse=True))
        parts = re.split(f"; (?=(?:{names}): )", message[len(head):])
        reasons = dict(part.split(": ", 1) for part in parts)
        assert reasons and set(reasons) <= set(MODES), message
        for name, reason in reasons.items():  # its topology problem, or a TP fact naming the size
            problem = topology_problem(name, topology)
            assert reason == problem if problem else (f"tp={topology.size('tp')}" in reason
                                                      or "no Linear" in reason), (name, message)
        return
    head = f"mode={mode!r} cannot be applied: "
    assert message.startswith(head), message
    reason, problem = message[len(head):], topology_problem(mode, topology)
    if problem:
        assert reason == problem, message
    else:  # the topology fits: the model does not, and the reason says which layer / size
        assert f"tp={topology.size('tp')}" in reason or "no Linear" in reason, message


def _analysed_once(analyze):
    """``analyze`` computing each (model, arguments) once: preflight analyses the model of every plan it checks,
    and these models do not change (the analysis is a frozen dataclass). Keyed on the model object (held, so its
    identity is not reused) and the arguments' own values (equal values, not equal reprs); arguments that cannot
    be a key are analysed every time."""
    seen = {}

    def once(model, **kwargs):
        key = (model, tuple(sorted(kwargs.items())))
        try:
            hash(key)
        except TypeError:
            return analyze(model, **kwargs)
        if key not in seen:
            seen[key] = analyze(model, **kwargs)
        return seen[key]

    return once


class Block(nn.Module):
    """A residual block with a neuron: what transformer / ResNet stages hold."""

    def __init__(self, width=8):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Staged(nn.Module):
    """``stages``: containers of the kinds and lengths real models use, run item by item."""

    def __init__(self, kind):
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.stages = {
            "list0": lambda: nn.ModuleList(),
            "list1": lambda: nn.ModuleList([Block()]),
            "list3": lambda: nn.ModuleList([Block(), Block(), Block()]),
            "nested": lambda: nn.ModuleList([nn.ModuleList([Block()]), nn.ModuleList([Block(), Block()])]),
            "dict1": lambda: nn.ModuleDict({"a": Block()}),
            "seq1": lambda: nn.Sequential(Block()),
            "linears": lambda: nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)]),
        }[kind]()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = self.stem(x)
        for item in _items(self.stages):
            x = item(x)
        return self.head(x)


def _items(container):
    if isinstance(container, nn.Sequential):  # a Sequential runs as a whole
        yield container
        return
    children = container.values() if isinstance(container, nn.ModuleDict) else container.children()
    for child in children:
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            yield from _items(child)
        else:
            yield child


CONTAINER_KINDS = ("list0", "list1", "list3", "nested", "dict1", "seq1", "linears")


def test_fsdp_units_are_modules_that_run():
    for kind in CONTAINER_KINDS:
        model = Staged(kind)
        units = se.analyze(model).fsdp_unit_names
        assert units[0] == "stem" and units[-1] == "head", (kind, units)
        for path in units:
            assert not isinstance(model.get_submodule(path), (nn.ModuleList, nn.ModuleDict)), (kind, path)
        params = {id(p) for u in units for p in model.get_submodule(u).parameters()}
        assert params == {id(p) for p in model.parameters()}, f"{kind}: every parameter sits in a unit"
    assert se.analyze(Staged("nested")).fsdp_unit_names == (
        "stem", "stages.0.0", "stages.1.0", "stages.1.1", "head")


def test_a_container_named_as_fsdp_unit_is_refused_with_its_path():
    model = Staged("list1")
    plan = se.plan(analysis=se.analyze(model), objective="memory", topology={"dp": 2}, backend="torch",
                   batch_size=4, mode="fsdp2")
    bad = se.SNNDistributedPlan.from_dict({**plan.to_dict(), "fsdp_units": ["stem", "stages", "head"]})
    with pytest.raises(ValueError, match=r"plan.fsdp_units names \['stages \(ModuleList\)'\], container"):
        se.preflight(model, bad)
