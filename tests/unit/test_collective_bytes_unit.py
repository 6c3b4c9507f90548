"""The cases whose collective counts and bytes tests/ranks/test_collective_bytes.py checks on real gloo
ranks against torch's own view (CommDebugMode, DDP's comm hook) cover every mode and resharding choice."""
import functools

import snn_explorer as se
from snn_explorer.estimator import enumerate_plans
from snn_explorer.zoo import build

MODELS = ("mlp", "vgg", "spikformer")


def _plans(name, world):
    zoo = _zoo(name)
    analysis = se.analyze(zoo.model, model_family=zoo.family)
    n = zoo.example_input.shape[1]
    speed = enumerate_plans(analysis, world_size=world, batch_size=n, objective="speed")
    memory = enumerate_plans(analysis, world_size=world, batch_size=n, objective="memory")
    plans = [p for p in speed if (world == 2 and not p.uses_pp) or p.mode == "fsdp2_tp"]
    plans += [p for p in memory if p.mode in ("fsdp2", "fsdp2_tp") and (world == 2) == (p.mode == "fsdp2")]
    return plans


_CASES, _RESULTS = {}, {}


def _cases(world):
    """(model name, plan): on 2 ranks every zoo model in dp, ZeRO, FSDP2 (both resharding levels)
    and TP; on 4 ranks the MLP in FSDP2 x TP (both levels)."""
    if world not in _CASES:
        _CASES[world] = [(m, p) for m in (MODELS if world == 2 else ("mlp",)) for p in _plans(m, world)]
    return _CASES[world]


@functools.lru_cache(maxsize=None)
def _zoo(name):
    """One model object per name in this process, so its estimates share one cached profile."""
    return build(name)


def test_cases_cover_every_mode_and_resharding():
    covered = {(m, p.mode, p.optimizer_strategy, p.memopt_level if "fsdp" in p.mode else 0)
               for world in (2, 4) for m, p in _cases(world)}
    for m in MODELS:
        assert {(m, "dp", "none", 0), (m, "dp", "zero", 0), (m, "fsdp2", "none", 0), (m, "fsdp2", "none", 1),
                (m, "tp", "none", 0)} <= covered, m
    assert {("mlp", "fsdp2_tp", "none", 0), ("mlp", "fsdp2_tp", "none", 1)} <= covered
