"""The ``rank_pool`` session fixture: this test process's warm 2-rank gloo pool (a conftest imports it).

The pool is the one :func:`distributed_harness.run_on_ranks` uses, so the start-up is paid once per
test process (one per xdist worker); the harness closes it at exit.
"""
from __future__ import annotations

import pytest
from distributed_harness import warm_pool


@pytest.fixture(scope="session")
def rank_pool():
    """The warm :class:`snn_explorer.ranks.RankPool` of 2 gloo ranks (``rank_pool.run(fn, ...)``)."""
    return warm_pool(2)
