"""The cases whose collective counts and bytes tests/ranks/test_collective_bytes.py checks on real gloo
ranks against torch's own view (CommDebugMode, DDP's comm hook) cover every mode and resharding choice."""

from test_collective_bytes import MODELS, _cases

_CASES, _RESULTS = {}, {}


def test_cases_cover_every_mode_and_resharding():
    covered = {(m, p.mode, p.optimizer_strategy, p.memopt_level if "fsdp" in p.mode else 0)
               for world in (2, 4) for m, p in _cases(world)}
    for m in MODELS:
        assert {(m, "dp", "none", 0), (m, "dp", "zero", 0), (m, "fsdp2", "none", 0), (m, "fsdp2", "none", 1),
                (m, "tp", "none", 0)} <= covered, m
    assert {("mlp", "fsdp2_tp", "none", 0), ("mlp", "fsdp2_tp", "none", 1)} <= covered
