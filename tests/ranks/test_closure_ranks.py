"""Closure: every plan() result applies. Exhaustive over objectives, named factorisations of 1-8 ranks,
model families, explicit modes and the experimental TP gates; a representative subset is applied on
real gloo ranks (the gated TP paths are applied on ranks in test_families).
(The tests in one process: tests/unit/test_closure.py.)"""

import pytest
import torch
from distributed_harness import run_on_ranks
from test_closure import CONTAINER_KINDS, FAMILY_MODELS, Staged, all_cases
from torch import nn

import snn_explorer as se
from snn_explorer.zoo import build


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
