"""Closure: every plan() result applies. Exhaustive over objectives, named factorisations of 1-8 ranks,
model families, explicit modes and the experimental TP gates; a representative subset is applied on
real gloo ranks (the gated TP paths are applied on ranks in test_families).
(The tests in one process: tests/unit/test_closure.py.)"""
import itertools

import pytest
import torch
from distributed_harness import run_on_ranks
from torch import nn

import snn_explorer as se
from snn_explorer.zoo import build

NAMES = ("dp", "tp", "x")
FAMILY_MODELS = {"generic": "mlp", "cifar10dvs_vgg": "vgg", "spikformer": "spikformer"}


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
                for objective in se.SNN_DISTRIBUTED_PREFERENCES:
                    for mode in (None,) + se.MODES:
                        yield world, topology, family, objective, mode


def _apply_all(world):
    """Apply every distinct (family, mode, mesh) plan for ``world`` ranks and take one training step."""
    seen, done = set(), []
    analyses = {family: se.analyze(build(name, batch_size=2 * world).model, model_family=family)
                for family, name in FAMILY_MODELS.items()}  # planning needs only the analysis of each model
    for _, topology, family, objective, mode in all_cases([world]):
        try:
            plan = se.plan(analysis=analyses[family], objective=objective,
                           topology=topology, neuron_backend="torch", batch_size=2 * world, mode=mode)
        except (ValueError, NotImplementedError):
            continue
        key = (family, plan.mode, plan.mesh_dim_names, plan.mesh_shape, plan.optimizer_strategy)
        if key in seen:
            continue
        seen.add(key)
        zoo = build(FAMILY_MODELS[family], batch_size=2 * world)  # a fresh model for each plan applied
        runtime = se.apply(model=zoo.model, plan=plan, device_type="cpu")
        share, start = plan.per_rank_batch, runtime.dp_rank * plan.per_rank_batch
        optimizer = runtime.build_optimizer(lr=1e-3)
        loss, _ = runtime.forward_loss(nn.CrossEntropyLoss(), zoo.example_input[:, start:start + share],
                                       zoo.labels[start:start + share])
        loss.backward()
        optimizer.step()
        assert torch.isfinite(loss)
        done.append(key)
    return done


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4])
def test_representative_plans_apply_on_real_ranks(world):
    done = run_on_ranks(_apply_all, world, world, timeout=480)[0]
    modes = {key[1] for key in done}
    assert {"dp", "fsdp2", "tp"} <= modes, done
    if world == 4:
        assert "fsdp2_tp" in modes
    assert {key[0] for key in done} == set(FAMILY_MODELS)


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


def _fsdp2_step_on_containers():
    losses = {}
    for kind in CONTAINER_KINDS:
        torch.manual_seed(0)
        model = Staged(kind)
        reference = nn.functional.mse_loss(model(torch.ones(4, 8)), torch.zeros(4, 4)).item()
        plan = se.plan(analysis=se.analyze(model), objective="memory", topology={"dp": 2}, backend="torch",
                       batch_size=4, mode="fsdp2")
        runtime = se.apply(model=model, plan=plan, device_type="cpu")
        loss = nn.functional.mse_loss(runtime.model(torch.ones(2, 8)), torch.zeros(2, 4))
        loss.backward()
        losses[kind] = (loss.item(), reference)
    return losses


def test_fsdp2_applies_to_containers_of_any_length_on_real_ranks():
    for losses in run_on_ranks(_fsdp2_step_on_containers, 2, timeout=120):
        assert set(losses) == set(CONTAINER_KINDS)
        for kind, (loss, reference) in losses.items():
            assert loss == pytest.approx(reference, rel=1e-6), kind
