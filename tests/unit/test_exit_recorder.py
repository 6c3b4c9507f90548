"""The agent's exit recorder names the failure that made elastic end the other workers, however the
failure falls between elastic's polls (a worker that fails just after the recorder looked is ended in
the same poll that sees its failure, or was ended before it started); a rank that exits before its first
event counts as never started."""
from __future__ import annotations

import json
import multiprocessing
import signal
import sys
import time
from types import SimpleNamespace

from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

from snn_explorer import compat_elastic
from snn_explorer.ranks import channel
from snn_explorer.ranks.elastic_agent import ExitRecorder
from snn_explorer.ranks.errors import LaunchError
from snn_explorer.ranks.outcome import failures
from snn_explorer.ranks.progress import Tracker


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


def _one_poll(run_dir, monkeypatch, targets, started) -> ExitRecorder:
    """Fork a worker per target (the ranks in ``started`` have written their start event), install the recorder and
    run one poll of elastic's, as it ends the others after a failure; every worker is gone when it returns."""
    channel.make_layout(run_dir)
    for rank in started:
        channel.emit(run_dir, rank, "start")  # started workers: the recorder asks them for stacks
    monkeypatch.setattr(MultiprocessContext, "_poll", MultiprocessContext._poll)  # restored after the test
    monkeypatch.setattr(compat_elastic, "ELASTIC_POLL", _poll_as_elastic_does)
    recorder = ExitRecorder(run_dir)
    recorder.install()
    fork = multiprocessing.get_context("fork")
    processes = [fork.Process(target=target) for target in targets]
    for proc in processes:
        proc.start()
    try:
        MultiprocessContext._poll(SimpleNamespace(_pc=SimpleNamespace(processes=processes)))
    finally:
        for proc in processes:
            proc.kill()
            proc.join()
    return recorder


def test_workers_ended_in_the_poll_that_sees_a_failure_are_named_as_ended_after_it(tmp_path, monkeypatch):
    run_dir = str(tmp_path)
    targets = (_wait_ignoring_stack_requests, _wait_ignoring_stack_requests, _fail_soon)
    recorder = _one_poll(run_dir, monkeypatch, targets, started=(0, 1, 2))
    events = _exit_events(run_dir)
    assert [e["code"] for e in events[2]] == [1] and events[2][0]["after"] is None  # the worker's own failure
    for rank in (0, 1):  # ended by elastic's SIGTERM because rank 2 failed, and said so
        assert [(e["code"], e["after"]) for e in events[rank]] == [(-signal.SIGTERM, 2)], events[rank]
    assert recorder.first_failure == 2 and recorder.alive_at_failure == {0, 1}


def _not_started_yet():
    """A fork that has not reached the rank's own signal set-up: elastic's inherited SIGTERM handler ends it with
    code 1 (it raises, and the fork's wrapper exits 1)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    time.sleep(60)


def test_a_worker_ended_before_it_started_is_named_as_ended_after_the_failure(tmp_path, monkeypatch):
    run_dir = str(tmp_path)
    targets = (_wait_ignoring_stack_requests, _not_started_yet, _fail_soon)
    recorder = _one_poll(run_dir, monkeypatch, targets, started=(0, 2))  # worker 1 has written nothing yet
    events = _exit_events(run_dir)
    assert [(e["code"], e["after"]) for e in events[1]] == [(1, 2)], events[1]  # code 1, not a signal: still named
    assert [(e["code"], e["after"]) for e in events[0]] == [(-signal.SIGTERM, 2)], events[0]
    assert recorder.alive_at_failure == {0} and recorder.unstarted_at_failure == {1}


def test_a_launch_whose_ranks_failed_joining_or_before_starting_counts_as_before_user_code(tmp_path):
    """Rank 0 failed joining the process group (its error file); rank 1 exited with code 1 before its first event
    (no ``after`` known): no rank ran the function, so the launch may be tried again."""
    run_dir = str(tmp_path)
    channel.make_layout(run_dir)
    channel.emit(run_dir, 0, "start", pid=1)
    channel.emit(run_dir, 0, "phase", phase="init")
    channel.write_json(channel.path(run_dir, "errors", "0.json"), {"type": "RuntimeError", "message": "no address",
                                                                    "traceback": "tb", "phase": "init", "time": 1.0})
    channel.emit(run_dir, 0, "exit", code=1)
    channel.emit(run_dir, 1, "exit", code=1)
    tracker = Tracker(2, started=0.0)
    for event in channel.EventReader(run_dir).poll():
        tracker.apply(event)
    fails = failures(run_dir, {}, {}, {}, tracker)
    assert {r: f.phase for r, f in fails.items()} == {0: "init", 1: "spawn"}
    assert LaunchError("failed", fails, function_ran=tracker.function_ran()).before_user_code


def test_ranks_ended_after_a_failure_name_it_when_the_agents_note_did_not_arrive(tmp_path):
    """Ranks 0 and 1 were killed by SIGTERM (the agent's status) after rank 2 raised (its error file), and no exit
    event of theirs was read (the launch ended first): each still says after which rank's failure it ended."""
    run_dir = str(tmp_path)
    channel.make_layout(run_dir)
    for rank in range(3):
        channel.emit(run_dir, rank, "start", pid=1)
    channel.write_json(channel.path(run_dir, "errors", "2.json"), {"type": "ValueError", "message": "lost its data",
                                                                    "traceback": "tb", "phase": "run", "time": 1.0})
    tracker = Tracker(3, started=0.0)
    for event in channel.EventReader(run_dir).poll():
        tracker.apply(event)
    status = {"failures": {"0": {"exitcode": -signal.SIGTERM}, "1": {"exitcode": -signal.SIGTERM},
                           "2": {"exitcode": 1}}}
    fails = failures(run_dir, status, {}, {}, tracker)
    assert fails[2].message == "lost its data" and not fails[2].collateral
    for rank in (0, 1):
        assert fails[rank].collateral and fails[rank].message == "ended after rank 2 failed (killed by SIGTERM)"
