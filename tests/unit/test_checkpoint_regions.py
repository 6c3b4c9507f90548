"""The checkpointed regions the estimator reads (``region_starts``) are the ones ``apply_activation_checkpointing``
makes: both ask ``planned_blocks``. Checked by running the checkpointed model and recording, for each call of
torch's ``checkpoint``, the modules that ran inside it."""
from unittest import mock

import pytest
import torch
from torch import nn

import snn_explorer as se
from snn_explorer.core.model import detached_copy
from snn_explorer.core.parallelize import checkpointing
from snn_explorer.core.planning import split_options
from snn_explorer.zoo import build
from snn_explorer.zoo.llm import build_llm, token_batch

GATES = se.DistributedFeatureSet(allow_activation_checkpointing=True)


def _regions_run(model: nn.Module, plan, units, example) -> list:
    """The sets of module paths each checkpointed region ran (apply's regions, observed)."""
    names = {m: n for n, m in model.named_modules()}
    checkpointing.apply_activation_checkpointing(model, plan, units)
    regions, current = [], []
    real = checkpointing.checkpoint

    def recording(body, *args, **kwargs):
        current.append(set())
        try:
            return real(body, *args, **kwargs)
        finally:
            regions.append(current.pop())

    def seen(module, _args):
        if current:
            current[-1].add(names[module])

    handle = nn.modules.module.register_module_forward_pre_hook(seen)
    try:
        with mock.patch.object(checkpointing, "checkpoint", recording), torch.no_grad():
            model(example)
    finally:
        handle.remove()
    return regions


def _expected(model: nn.Module, starts) -> list:
    """The module paths each ``(path, children)`` of ``region_starts`` covers: the module and its ``children - 1``
    next siblings, with everything inside them."""
    out = []
    for path, children in starts:
        parent, _, name = path.rpartition(".")
        siblings = list(model.get_submodule(parent)._modules)
        run = siblings[siblings.index(name):siblings.index(name) + children]
        heads = [f"{parent}.{n}" if parent else n for n in run]
        out.append({p for p, _ in model.named_modules() if any(p == h or p.startswith(h + ".") for h in heads)})
    return out


def _case(case: str):
    """(model copy, example input, batch size, plan levers) of one case."""
    if case == "llm ops":
        torch.manual_seed(0)
        model = build_llm("spiking-llm-tiny", dim=32, n_heads=2, ffn_dim=64, n_layers=3, vocab_size=64,
                          tied_embeddings=False)
        return model, token_batch(model.config, 2, 2, 8), 2, dict(activation_checkpointing="ops")
    zoo = build(case.split()[0])
    levers = dict(activation_checkpointing="blocks")
    if case.endswith("every 2"):
        levers["checkpoint_every"] = 2
    if case.endswith("named"):
        levers["checkpoint_blocks"] = se.analyze(zoo.model).fsdp_unit_names[1::3]
    return detached_copy(zoo.model), zoo.example_input, zoo.batch_size, levers


@pytest.mark.parametrize("case", ["vgg every 1", "vgg every 2", "vgg named", "mlp every 2", "llm ops"])
def test_region_starts_are_the_regions_apply_makes(case):
    model, example, batch, levers = _case(case)
    analysis = se.analyze(model)
    units = analysis.fsdp_unit_names
    plan = se.plan(analysis=analysis, objective="speed", topology={"dp": 2}, mode="fsdp2", batch_size=batch,
                   features=GATES, **split_options(levers))
    starts = checkpointing.region_starts(model, plan, units)
    assert len(starts) >= 2, starts  # non-trivial: several regions
    runs = _regions_run(model, plan, units, example)
    distinct = list(dict.fromkeys(frozenset(r) for r in runs))  # a per-step model runs each region T times
    # a checkpointed module's own pre-hook runs before its (wrapped) forward enters checkpoint: added here
    assert [got | {path} for got, (path, _) in zip(distinct, starts)] == _expected(model, starts), case
    assert len(distinct) == len(starts)
