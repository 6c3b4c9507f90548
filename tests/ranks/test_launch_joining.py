"""A rank stuck joining the process group ends the run early and is tried again; a rank slow to load is not stuck."""
from __future__ import annotations

import os
import sys
import time

import cloudpickle
import pytest
import torch.distributed as dist
from launch_helpers import clean_launch, live_children  # noqa: F401  (fixture)

from snn_explorer import ranks
from snn_explorer.launcher import LaunchError
from snn_explorer.ranks import engine, process, progress

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _on_rank_one(action, seconds):
    """Runs while rank 1 unpickles the payload (its "load" phase): ``"stall"`` makes its process group join sleep
    ``seconds`` (a join that never completes, as a lost connection would leave it), ``"stall after"`` sleep after
    joining (its peer gets through), ``"slow"`` sleeps here."""
    if os.environ.get("RANK") == "1":
        join = dist.init_process_group
        if action == "stall":
            def stalled(*args, **kwargs):
                time.sleep(seconds)
            dist.init_process_group = stalled
        elif action == "stall after":
            def joined_then_stalled(*args, **kwargs):
                join(*args, **kwargs)
                time.sleep(seconds)
            dist.init_process_group = joined_then_stalled
        else:
            time.sleep(seconds)
    return action


class _OnRankOne:
    def __init__(self, action, seconds):
        self.action, self.seconds = action, seconds

    def __reduce__(self):
        return _on_rank_one, (self.action, self.seconds)


def _world_size(action):
    return action, dist.get_world_size()


@pytest.mark.timeout(90)
def test_a_rank_stuck_joining_ends_the_run_and_is_tried_again(clean_launch, monkeypatch):
    monkeypatch.setattr(engine, "JOIN_TIMEOUT_S", 3.0)
    with pytest.raises(LaunchError) as info:
        ranks.run(_world_size, (_OnRankOne("stall", 600),), nprocs=2, backend="gloo", timeout=None)
    err = info.value
    assert err.timed_out and err.attempts == 2 and err.before_user_code
    assert "still joining the process group 3 s after every rank began to" in str(err)
    assert err.failures[1].phase == "init" and not err.failures[1].collateral
    assert "stalled" in err.failures[1].stack  # where rank 1 was: the join that never returns (timeout=None)
    assert not live_children()


@pytest.mark.timeout(90)
def test_a_run_whose_function_ran_is_not_tried_again(clean_launch, monkeypatch):
    monkeypatch.setattr(engine, "JOIN_TIMEOUT_S", 2.0)
    with pytest.raises(LaunchError) as info:  # rank 0 gets through the join and returns; rank 1 stays in it
        ranks.run(_world_size, (_OnRankOne("stall after", 600),), nprocs=2, backend="gloo", timeout=8)
    err = info.value
    assert err.timed_out and "no heartbeat for 8 s" in str(err) and err.results == {0: ("stall after", 2)}
    assert err.function_ran and err.attempts == 1 and not err.before_user_code
    assert err.failures[1].phase == "init"


@pytest.mark.timeout(90)
def test_a_rank_slow_to_load_is_not_taken_for_stuck(clean_launch, monkeypatch):
    monkeypatch.setattr(engine, "JOIN_TIMEOUT_S", 3.0)
    result = ranks.run(_world_size, (_OnRankOne("slow", 8),), nprocs=2, backend="gloo", timeout=None)
    assert result.values == [("slow", 2), ("slow", 2)]  # rank 0 waited in the join about 8 s for rank 1 to load


@pytest.mark.timeout(60)
def test_ranks_that_never_start_end_the_run_and_it_is_tried_again(clean_launch, monkeypatch):
    monkeypatch.setattr(process, "AGENT_MODULE", "sleeping_agent")  # tests/sleeping_agent.py: starts no rank
    monkeypatch.setattr(progress, "START_TIMEOUT_S", 2.0)
    monkeypatch.setattr(engine, "START_TIMEOUT_S", 2.0)
    with pytest.raises(LaunchError) as info:  # no heartbeat limit: the start limit holds all the same
        ranks.run(_world_size, ("never",), nprocs=2, backend="gloo", timeout=None,
                  env={"PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})  # tests/
    err = info.value
    assert err.timed_out and err.attempts == 2 and err.before_user_code
    assert "not started within 2 s" in str(err) and {f.phase for f in err.failures.values()} == {"spawn"}
    assert not live_children()
