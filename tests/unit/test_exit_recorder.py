"""The agent's exit recorder names the failure that made elastic end the other workers, however the
failure falls between elastic's polls (a worker that fails just after the recorder looked is ended in
the same poll that sees its failure)."""
from __future__ import annotations

import json
import multiprocessing
import signal
import time
from types import SimpleNamespace

from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

from snn_explorer import compat_elastic
from snn_explorer.ranks import channel
from snn_explorer.ranks.elastic_agent import ExitRecorder


def _wait_ignoring_stack_requests():
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the recorder asks live peers for their stacks
    time.sleep(60)


def _fail_soon():
    time.sleep(0.3)
    raise SystemExit(1)


def _poll_as_elastic_does(context):
    """What elastic's poll does when a worker failed: wait for it, end the others (``terminate``), join them."""
    processes = context._pc.processes
    processes[2].join()
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    for proc in processes:
        proc.join()


def _exit_events(run_dir):
    out = {}
    for rank in range(3):
        with open(channel.path(run_dir, "events", f"{rank}.jsonl")) as fh:
            out[rank] = [e for e in map(json.loads, fh) if e["kind"] == "exit"]
    return out


def test_workers_ended_in_the_poll_that_sees_a_failure_are_named_as_ended_after_it(tmp_path, monkeypatch):
    run_dir = str(tmp_path)
    channel.make_layout(run_dir)
    for rank in range(3):
        channel.emit(run_dir, rank, "start")  # started workers: the recorder asks them for stacks
    monkeypatch.setattr(MultiprocessContext, "_poll", MultiprocessContext._poll)  # restored after the test
    monkeypatch.setattr(compat_elastic, "ELASTIC_POLL", _poll_as_elastic_does)
    recorder = ExitRecorder(run_dir)
    recorder.install()
    fork = multiprocessing.get_context("fork")
    processes = [fork.Process(target=_wait_ignoring_stack_requests) for _ in range(2)] + [fork.Process(target=_fail_soon)]
    for proc in processes:
        proc.start()
    try:
        MultiprocessContext._poll(SimpleNamespace(_pc=SimpleNamespace(processes=processes)))
    finally:
        for proc in processes:
            proc.kill()
            proc.join()
    events = _exit_events(run_dir)
    assert [e["code"] for e in events[2]] == [1] and events[2][0]["after"] is None  # the worker's own failure
    for rank in (0, 1):  # ended by elastic's SIGTERM because rank 2 failed, and said so
        assert [(e["code"], e["after"]) for e in events[rank]] == [(-signal.SIGTERM, 2)], events[rank]
    assert recorder.first_failure == 2 and recorder.alive_at_failure == {0, 1}
