"""launch() on real gloo ranks: results, logs, progress, security of the run dir, and every fault."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import cloudpickle
import psutil
import pytest
import torch
import torch.distributed as dist
from launch_helpers import clean_launch, gone, is_reused_helper, live_children  # noqa: F401  (fixture)

from snn_explorer.launcher import LaunchError, launch, report
from snn_explorer.ranks.channel import DIR_ENV

# Rank functions defined here travel by value, so ranks need not import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _inspect_rank(scale):
    """Everything a rank can check about its own launch, returned for the parent to assert."""
    rank = dist.get_rank()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    run_dir = os.environ[DIR_ENV]
    me = psutil.Process()
    listening = {c.laddr.ip for p in (me, me.parent()) for c in p.net_connections("inet") if c.status == "LISTEN"}
    report(step=1, total=2, loss=0.5 + rank, message="half way")
    report(step=2, total=2, loss=torch.tensor(0.25))
    print(f"stdout of rank {rank}")
    print(f"stderr of rank {rank}", file=sys.stderr)
    return {"rank": rank, "value": rank * scale, "sum": total.item(), "world": dist.get_world_size(),
            "dir_mode": os.stat(run_dir).st_mode & 0o777,
            "payload": os.path.exists(os.path.join(run_dir, "payload.pkl")),
            "run_dir": run_dir, "listening": sorted(listening), "backend": dist.get_backend()}


@pytest.mark.timeout(90)
def test_results_logs_progress_and_private_run_dir(clean_launch, capfd, tmp_path):
    offset = 7
    snapshots = []
    result = launch(lambda scale: (_inspect_rank(scale), offset), 3, nprocs=4, progress=snapshots.append,
                    log_dir=str(tmp_path / "logs"))
    infos = [v[0] for v in result.values]
    assert [i["rank"] for i in infos] == [0, 1, 2, 3]
    assert [i["value"] for i in infos] == [0, 3, 6, 9] and all(v[1] == offset for v in result.values)
    assert all(i["sum"] == 6.0 and i["world"] == 4 and i["backend"] == "gloo" for i in infos)
    # rendezvous store (agent) and gloo (ranks) listen on loopback only; run dir is private and removed
    assert all(i["listening"] == ["127.0.0.1"] for i in infos), [i["listening"] for i in infos]
    assert all(i["dir_mode"] == 0o700 and i["payload"] for i in infos)
    assert not os.path.exists(infos[0]["run_dir"])
    # logs: captured per rank, on the result and in log_dir, not sprayed into the caller's output
    assert result.stdout[2] == "stdout of rank 2\n" and "stderr of rank 2" in result.stderr[2]
    assert open(result.log_files[3][0]).read() == "stdout of rank 3\n"
    out, err = capfd.readouterr()
    assert "stdout of rank" not in out + err and "stderr of rank" not in out + err
    # progress reports: on the result, and seen live by the callback
    assert result.reports[1][0] == {"step": 1, "total": 2, "loss": 1.5, "message": "half way", "metrics": {}}
    assert result.reports[1][1]["loss"] == 0.25
    assert any(s["step"] == 2 for snap in snapshots for s in snap)
    assert snapshots[-1][0]["status"] in ("running", "done")
    assert set(result.timings) == {0, 1, 2, 3} and all(t is not None and t >= 0 for t in result.timings.values())


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("bad value 42")
    dist.barrier()


@pytest.mark.timeout(60)
def test_rank_raises(clean_launch):
    with pytest.raises(LaunchError) as info:
        launch(_raise_on_rank_one, nprocs=2, progress=False)
    err = info.value
    raised = time.time()
    failure = err.failures[1]
    assert failure.type == "ValueError" and failure.message == "bad value 42" and failure.exitcode == 1
    assert "_raise_on_rank_one" in failure.traceback and 'raise ValueError("bad value 42")' in failure.traceback
    assert err.root_cause.rank == 1
    assert raised - failure.time < 10
    text = str(err)
    assert "rank 1" in text and "ValueError: bad value 42" in text and "remote traceback of rank 1" in text


def _die(how):
    if dist.get_rank() == 1:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(3) if how == "sys.exit" else os._exit(4)
    dist.barrier()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how, code, kind", [("kill", -9, "SIGKILL"), ("sys.exit", 3, "SystemExit")])
def test_rank_killed_or_exits_nonzero(clean_launch, how, code, kind):
    started = time.time()
    with pytest.raises(LaunchError) as info:
        launch(_die, how, nprocs=2, progress=False)
    failure = info.value.failures[1]
    assert (failure.exitcode, failure.type) == (code, kind)
    assert info.value.root_cause.rank == 1
    assert f"rank 1 (exit code {code})" in str(info.value)
    assert time.time() - started < 30


def _hang_on_rank_one():
    if dist.get_rank() == 1:
        time.sleep(600)
    return "done"


@pytest.mark.timeout(60)
def test_hung_rank_ends_at_timeout(clean_launch):
    started = time.time()
    with pytest.raises(LaunchError) as info:
        launch(_hang_on_rank_one, nprocs=2, progress=False, timeout=4)
    err = info.value
    assert 1 in err.unfinished and 1 in err.failures  # rank 0 returned at once (unless the machine is swamped)
    assert err.failures[1].exitcode is None and err.failures[1].type == "Timeout"
    assert "_hang_on_rank_one" in err.failures[1].traceback  # the hung rank's Python stack
    assert f"rank(s) {sorted(err.unfinished)} had not finished" in str(err) and "Timeout" in str(err)
    assert time.time() - started < 40


@pytest.mark.timeout(60)
def test_keyboard_interrupt_while_waiting_ends_every_rank(clean_launch):
    pids = []

    def interrupt_once_running(snapshot):
        if not pids and all(s["pid"] for s in snapshot):
            pids.extend(s["pid"] for s in snapshot)
            agent = next(c for c in live_children() if c.ppid() == os.getpid())  # not a warm pool's agent
            pids.append(agent.pid)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        launch(_hang_on_rank_one, nprocs=2, progress=interrupt_once_running)
    assert len(pids) == 3 and all(gone(p) for p in pids)


SIGINT_SCRIPT = textwrap.dedent("""
    import json, signal, sys, time
    from snn_explorer.launcher import launch

    # A shell that starts the suite in the background hands SIGINT down ignored; Ctrl-C in a terminal
    # or notebook raises KeyboardInterrupt, so that is what this script sets up.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def hang():
        time.sleep(600)

    def note_pids(snapshot):
        if all(s["pid"] for s in snapshot):
            open(sys.argv[1], "w").write(json.dumps([s["pid"] for s in snapshot]))

    launch(hang, nprocs=2, progress=note_pids)
""")


@pytest.mark.timeout(90)
def test_sigint_to_the_parent_ends_every_rank(clean_launch, tmp_path):
    script, pid_file = tmp_path / "interrupt.py", tmp_path / "pids.json"
    script.write_text(SIGINT_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(pid_file)], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not pid_file.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    time.sleep(0.2)
    tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    ranks = json.loads(pid_file.read_text())
    assert set(ranks) <= set(tree) and all(gone(p) for p in tree)


ROUNDS = 20 if os.environ.get("SNN_EXPLORER_SLOW_TESTS") else 3


@pytest.mark.timeout(40 * ROUNDS)
def test_launches_in_a_row_after_faults(clean_launch):
    rounds = ROUNDS
    for i in range(rounds):
        result = launch(lambda: dist.get_rank() + i, nprocs=2, progress=False)
        assert result.values == [i, i + 1]
        assert not live_children()


@pytest.mark.timeout(90)
def test_process_group_failure_is_retried_once_then_reported(clean_launch):
    with pytest.raises(LaunchError) as info:
        launch(lambda: 1, nprocs=2, progress=False, env={"GLOO_SOCKET_IFNAME": "no-such-interface0"})
    err = info.value
    assert err.attempts == 2 and err.before_user_code
    assert all(f.phase == "init" for f in err.failures.values() if not f.collateral)
    assert "no-such-interface0" in str(err)


def _fail_in_user_code():
    raise KeyError("not retried")


@pytest.mark.timeout(60)
def test_user_code_failure_is_not_retried(clean_launch):
    with pytest.raises(LaunchError) as info:
        launch(_fail_in_user_code, nprocs=1, progress=False)
    assert info.value.attempts == 1 and info.value.failures[0].phase == "run"
