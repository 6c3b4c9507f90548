"""Sweeps of test_closure.py (tests/unit): the same checks over many plans or models, minutes of CPU each."""
import dataclasses
import itertools

from test_closure import (
    BATCH,
    FAMILY_MODELS,
    _analysed_once,
    _check_refusal,
    all_cases,
)

import snn_explorer as se
from snn_explorer.core import distribute
from snn_explorer.core.planning import topology_problem
from snn_explorer.zoo import build


def test_every_plan_applies_or_raises_clearly(monkeypatch):
    models = {f: build(name).model for f, name in FAMILY_MODELS.items()}
    monkeypatch.setattr(distribute, "analyze", _analysed_once(distribute.analyze))  # the models stay alive here
    analyses = {f: se.analyze(m, model_family=f) for f, m in models.items()}
    counts = {"planned": 0, "refused": 0}
    checked = set()  # plans of one model equal but for their objective and words pass apply's checks alike
    gated = se.DistributedFeatureSet(allow_experimental_conv_tp=True, allow_experimental_spikformer_tp=True)
    for (world, topology, family, objective, mode), features in itertools.product(all_cases(), (None, gated)):
        try:
            plan = se.plan(analysis=analyses[family], objective=objective, topology=topology, neuron_backend="torch",
                           batch_size=BATCH, mode=mode, features=features)
        except (ValueError, NotImplementedError) as exc:
            _check_refusal(str(exc), mode, se.SNNDistributedTopology(topology))
            counts["refused"] += 1
            continue
        assert plan.world_size == world and topology_problem(plan.mode, plan.topology) is None
        assert mode is None or plan.mode == mode
        what = (family, dataclasses.replace(plan, objective="speed", rationale=(), notes=()))  # what apply reads
        if what not in checked:
            se.preflight(models[family], plan)  # everything apply checks before touching a process group
            checked.add(what)
        assert se.SNNDistributedPlan.from_dict(plan.to_dict()) == plan
        counts["planned"] += 1
    print(counts)
    assert counts["planned"] > 1000 and counts["refused"] > 1000, counts
