"""A rank fails while its peers hang (one in a collective waiting for a peer that never joins it,
one stuck outside any collective): the peers are ended within seconds, not waited on until the
heartbeat or process-group timeout, and the error names the rank that failed, each peer ended
because of it, and where each peer was waiting (its Python stack). Real gloo ranks."""
from __future__ import annotations

import signal
import sys
import time

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from launch_helpers import clean_launch  # noqa: F401  (fixture)

from snn_explorer.launcher import LaunchError, launch
from snn_explorer.ranks.engine import FAILURE_GRACE_S

cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: Far beyond what the test allows (as is gloo's default timeout, 30 min): the peers must not wait for it.
HEARTBEAT_TIMEOUT_S = 600


def _fail_while_peers_hang(ignore_sigterm: bool):
    pair = dist.new_group([0, 1])
    rank = dist.get_rank()
    if ignore_sigterm and rank != 2:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only the launcher's SIGKILL ends it
    dist.barrier()
    if rank == 2:
        time.sleep(0.5)  # the peers are in their waits
        raise ValueError("rank 2 lost its data")
    if rank == 1:
        time.sleep(3600)  # stuck outside any collective, so rank 0's all_reduce never completes
    t = torch.ones(1)
    dist.all_reduce(t, group=pair)
    return t.item()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ignore_sigterm", [False, True], ids=["peers-end-on-sigterm", "peers-ignore-sigterm"])
def test_peers_hanging_after_a_failure_are_ended_and_named_with_where_they_waited(clean_launch, ignore_sigterm):
    started = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_fail_while_peers_hang, ignore_sigterm, nprocs=3, progress=False, timeout=HEARTBEAT_TIMEOUT_S)
    elapsed = time.monotonic() - started
    err = info.value
    assert elapsed < 60 + (FAILURE_GRACE_S if ignore_sigterm else 0), elapsed  # start-up included, on 2 busy cores
    assert err.root_cause.rank == 2 and err.root_cause.type == "ValueError"
    assert err.root_cause.message == "rank 2 lost its data" and not err.root_cause.collateral
    peers = {r: err.failures[r] for r in (0, 1)}
    assert all(f.collateral for f in peers.values()), peers
    assert all("after rank 2 failed" in f.message for f in peers.values()), [f.message for f in peers.values()]
    assert "in all_reduce (distributed_c10d.py:" in peers[0].describe() and "_fail_while_peers_hang" in peers[0].stack
    assert "time.sleep" not in peers[0].stack and "from _fail_while_peers_hang (test_launch_abort.py:" in peers[0].describe()
    assert "it was in _fail_while_peers_hang (test_launch_abort.py:" in peers[1].describe()
    text = str(err).splitlines()
    assert text[0].startswith("launch failed on rank(s) [0, 1, 2] of 3; first: rank 2 ValueError: rank 2 lost its data")
    assert text[1].startswith("  rank 2 (exit code 1): ValueError") and "[ended by the launcher]" in text[2]
    if ignore_sigterm:  # the agent's SIGTERM did nothing: the launcher ended them after its grace
        assert all(f.exitcode is None and f.type == "Ended" for f in peers.values()), peers
    else:
        assert all(f.exitcode == -signal.SIGTERM for f in peers.values()), peers


def _hang_outside_collectives_on_rank_one():
    if dist.get_rank() == 1:
        time.sleep(3600)  # rank 0 waits for it in the all_reduce below: both go silent
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


@pytest.mark.timeout(120)
def test_a_silent_group_names_the_rank_that_hangs_outside_collectives_first(clean_launch):
    with pytest.raises(LaunchError) as info:
        launch(_hang_outside_collectives_on_rank_one, nprocs=2, progress=False, timeout=4)
    err = info.value
    assert err.timed_out and sorted(err.failures) == [0, 1]
    assert err.root_cause.rank == 1 and not err.root_cause.collateral
    assert err.failures[0].collateral and "waiting for a peer" in err.failures[0].message
    first_line = str(err).splitlines()[0]
    assert "; first: rank 1 in _hang_outside_collectives_on_rank_one (test_launch_abort.py:" in first_line
    assert "rank 0 in all_reduce (distributed_c10d.py:" in first_line
