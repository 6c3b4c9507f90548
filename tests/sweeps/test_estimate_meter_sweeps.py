"""Sweeps of test_estimate_meter.py (tests/unit): the same checks over many plans or models, minutes of CPU each."""
import json
import os
import subprocess
import sys

from snn_explorer.zoo import build


def _estimate_tables() -> dict:
    """Each plan's per-rank table of the zoo vgg and spikformer at 4 ranks, by model name and plan."""
    import snn_explorer as se
    from snn_explorer.estimator import enumerate_plans, estimate
    out = {}
    for name in ("vgg", "spikformer"):
        zoo = build(name)
        for p in enumerate_plans(se.analyze(zoo.model, model_family=zoo.family), world_size=4,
                                 batch_size=zoo.batch_size):
            e = estimate(zoo.model, p, example_input=zoo.example_input, labels=zoo.labels)
            out[name + repr(p)] = e.per_rank.values.tolist()
    return out


_DUMP = """
import json, sys
sys.path.insert(0, sys.argv[1])
from test_estimate_meter_sweeps import _estimate_tables
print(json.dumps(_estimate_tables()))
"""


def test_estimates_identical_in_fresh_processes():
    """Saved-activation attribution once depended on which addresses the allocator reused: the tables of a
    fresh interpreter (its own allocator, nothing allocated before) equal those of this test process (whose
    allocator holds what every earlier test left)."""
    run = subprocess.Popen([sys.executable, "-c", _DUMP, os.path.dirname(os.path.abspath(__file__))],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # the fresh process runs beside this one's own estimates
        here = json.loads(json.dumps(_estimate_tables()))  # through JSON as the fresh process's table comes
        out, err = run.communicate(timeout=300)
    finally:  # a timeout or a failure here leaves no process behind
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, err[-2000:]
    fresh = json.loads(out)
    assert len(here) >= 5 and any(row[5] > 0 for t in here.values() for row in t)
    assert fresh == here
