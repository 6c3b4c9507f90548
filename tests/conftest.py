import gc
import os
import sys

import pytest

# Make helper modules in tests/ (e.g. distributed_harness) importable from the test files of every tier, and the
# test modules of each tier from the others: a file split by tier (tests/unit/test_x.py, tests/ranks/test_x_ranks.py)
# keeps its models and cases in one of the two, which the other imports (test file names are unique across tiers).
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
for _path in (os.path.join(_TESTS_DIR, "ranks"), os.path.join(_TESTS_DIR, "sweeps"), os.path.join(_TESTS_DIR, "unit"),
              _TESTS_DIR):
    if _path not in sys.path:
        sys.path.insert(0, _path)

# The tiers (tests/unit, tests/ranks, tests/system): markers from the folder, the guard that fails a unit test
# starting ranks, and the stop for a test file left in tests/ itself (tests/tiers.py).
from tiers import (  # noqa: E402, F401
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_makereport,  # noqa: E402, F401
    pytest_runtest_protocol,
)

# Under pytest-xdist (the unit tier's addopts), each worker takes its share of the cores for torch's intra-op threads,
# so that the workers together do not run more threads than there are cores.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

# estimate() without hardware= would calibrate this machine on spawned ranks (seconds, and timing
# noise on a shared machine); tests predict step time on a datasheet profile unless they pass one.
os.environ.setdefault("SNN_EXPLORER_HARDWARE", "A100-SXM-80GB")

# The library collects garbage around its memory measurements (gc.collect() in the estimator's profile runs):
# a full collection walks every object alive in this process (torch, pandas, pytest, the test modules), 0.3-0.5 s
# each here, and one estimate can run several. Before each test, what is alive is collected and then frozen
# (gc.freeze: moved to the permanent generation), so the collections during the test walk only what it creates.
# Garbage cycles among frozen objects wait for a full collection: at a module boundary once the frozen objects
# grew by a quarter since the last one (the growth at which Python's own collector runs a full collection).
_FULL_COLLECTION = {"frozen": 0, "pending": True}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    gc.collect()
    gc.freeze()
    if _FULL_COLLECTION["pending"]:
        _FULL_COLLECTION.update(frozen=gc.get_freeze_count(), pending=False)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if (getattr(nextitem, "module", None) is not getattr(item, "module", None)) \
            and gc.get_freeze_count() > 1.25 * _FULL_COLLECTION["frozen"]:
        gc.unfreeze()  # the next setup's collection is a full one
        _FULL_COLLECTION["pending"] = True
