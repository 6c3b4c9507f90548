"""The rank runner under attack (issue 19): ports, early exits, escaped grandchildren, a killed
caller, and measure() on it — each on real gloo ranks."""
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
from launch_helpers import clean_launch, gone  # noqa: F401  (fixture)
from test_launch_plan import tp_step  # travels by value, as that module registered itself

from snn_explorer import analyze, plan
from snn_explorer.estimator import measure, measure_many
from snn_explorer.launcher import LaunchError, export_job, launch
from snn_explorer.zoo import build

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _listening(root: psutil.Process) -> set:
    """(process name, address) of every listening inet socket of ``root`` and its descendants."""
    out = set()
    for proc in [root] + root.children(recursive=True):
        try:
            out |= {c.laddr.ip for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


class ListenWatch:
    """A progress callback that records the listening addresses of this process's whole tree."""

    def __init__(self):
        self.seen, self.polls = set(), 0

    def __call__(self, snapshot):
        if all(s["pid"] for s in snapshot):
            self.seen |= _listening(psutil.Process())
            self.polls += 1


def _collective():
    t = torch.ones(1)
    dist.all_reduce(t)
    time.sleep(0.3)  # time for the watcher to look while the group is up
    return t.item()


@pytest.mark.timeout(90)
def test_launch_listens_on_loopback_only(clean_launch):
    watch = ListenWatch()
    assert launch(_collective, nprocs=2, progress=watch).values == [2.0, 2.0]
    assert watch.polls and watch.seen == {"127.0.0.1"}, watch.seen


@pytest.mark.timeout(150)
def test_measure_listens_on_loopback_and_works_with_a_frozen_parameter(clean_launch):
    zoo = build("mlp")
    model = zoo.model
    frozen = next(model.parameters())
    frozen.requires_grad_(False)
    analysis = analyze(model, model_family=zoo.family)
    dp, fsdp2 = (plan(analysis=analysis, objective="speed", topology={"dp": 2}, backend="torch",
                      batch_size=zoo.batch_size, mode=mode) for mode in ("dp", "fsdp2"))
    watch = ListenWatch()
    measured = measure_many(model, [dp, fsdp2], example_input=zoo.example_input, labels=zoo.labels, steps=2,
                            progress=watch)
    assert watch.polls and watch.seen == {"127.0.0.1"}, watch.seen
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    everything = sum(p.numel() * p.element_size() for p in model.parameters())
    assert trainable < everything
    assert list(measured[0].per_rank["grads_bytes"]) == [trainable, trainable]  # no gradient for the frozen one
    assert list(measured[0].per_rank["params_bytes"]) == [everything, everything]
    assert sum(measured[1].per_rank["grads_bytes"]) < sum(measured[1].per_rank["params_bytes"])  # FSDP2 shards
    with pytest.raises(ValueError, match="steps=0"):
        measure(model, dp, example_input=zoo.example_input, steps=0)
    with pytest.raises(ValueError, match="steps=-4"):
        measure(model, dp, example_input=zoo.example_input, steps=-4)


@pytest.mark.timeout(150)
def test_exported_job_runs_locally_through_the_rank_runner_on_loopback(tmp_path):
    zoo = build("mlp")
    tp = plan(analysis=analyze(zoo.model, model_family=zoo.family), objective="memory", topology={"tp": 2},
              backend="torch", batch_size=zoo.batch_size, mode="tp")
    job = export_job(tp, tp_step, tmp_path / "job", model=zoo.model, steps=2, optimizer={"lr": 1e-2},
                     train_kwargs={"inputs": zoo.example_input, "labels": zoo.labels})
    (tmp_path / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "TORCHELASTIC_RUN_ID")}
    proc = subprocess.Popen([sys.executable, "run.py"], cwd=job.path, env={**env, "TMPDIR": str(tmp_path / "tmp")},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen, ranks_seen = set(), 0
    while proc.poll() is None:
        root = psutil.Process(proc.pid)
        try:
            seen |= _listening(root)
            ranks_seen = max(ranks_seen, len(root.children(recursive=True)))
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.2)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert ranks_seen >= 3 and seen == {"127.0.0.1"}, (ranks_seen, seen)  # agent + 2 ranks
    losses = [[m["loss"] for m in json.load(open(os.path.join(job.path, "results", f"rank{r}.json")))]
              for r in (0, 1)]
    assert losses[0] == losses[1] and len(losses[0]) == 2 and losses[0][1] < losses[0][0]
    assert not os.listdir(tmp_path / "tmp")


def _leave_early(how, who):
    if who == "all" or dist.get_rank() == 1:
        if how == "os._exit(0)":
            os._exit(0)
        sys.exit(*{"sys.exit(0)": (0,), "sys.exit()": (), "sys.exit('bye')": ("bye",)}[how])
    dist.barrier()  # rank 0 would wait here for ever: the launch must end because rank 1 left
    return "unreachable"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how, who", [("sys.exit(0)", "one"), ("sys.exit()", "all"), ("os._exit(0)", "one"),
                                      ("os._exit(0)", "all"), ("sys.exit('bye')", "one")])
def test_rank_leaving_without_a_value_fails_at_once(clean_launch, how, who):
    started = time.time()
    with pytest.raises(LaunchError) as info:
        launch(_leave_early, how, who, nprocs=2, progress=False)  # default timeout: 900 s
    elapsed = time.time() - started
    err, code = info.value, 1 if "bye" in how else 0
    failure = err.failures[1]
    assert failure.exitcode == code and not failure.collateral and err.root_cause.exitcode == code
    expected = f"exited with code {code} before returning a value" + (": bye" if code else "")
    assert failure.message == expected
    assert f"rank {err.root_cause.rank} {expected}" in str(err)
    if who == "all":
        assert err.failures[0].message == expected
    assert elapsed < 40, elapsed


def _grandchild_in_its_own_session():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    return child.pid, os.getsid(child.pid) != os.getsid(0)


@pytest.mark.timeout(60)
def test_grandchild_in_a_new_session_ends_with_the_launch(clean_launch):
    values = launch(_grandchild_in_its_own_session, nprocs=2, progress=False).values
    assert all(own_session for _, own_session in values)
    deadline = time.time() + 5
    while not all(gone(pid) for pid, _ in values) and time.time() < deadline:
        time.sleep(0.1)
    assert all(gone(pid) for pid, _ in values), [pid for pid, _ in values if not gone(pid)]


HANG_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time
    from snn_explorer.launcher import launch

    signal.signal(signal.SIGHUP, signal.SIG_DFL)  # a caller SIGHUP kills, even when started under nohup

    def hang(note):
        open(note + f".{os.environ['RANK']}", "w").write(json.dumps([os.environ["SNN_EXPLORER_LAUNCH_DIR"],
                                                                       os.getpid()]))
        time.sleep(600)

    launch(hang, sys.argv[1], nprocs=2, progress=False)
""")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_caller_killed_by_a_signal_leaves_no_run_dir_and_no_process(clean_launch, tmp_path, sig):
    script, note = tmp_path / "hang.py", tmp_path / "note"
    script.write_text(HANG_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(note)], stderr=subprocess.PIPE, text=True)
    notes = [tmp_path / f"note.{r}" for r in (0, 1)]
    deadline = time.time() + 60
    while not all(n.exists() and n.read_text() for n in notes) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    (run_dir, _), ranks = json.loads(notes[0].read_text()), [json.loads(n.read_text())[1] for n in notes]
    assert os.path.isdir(run_dir) and set(ranks) <= set(tree)
    proc.send_signal(sig)
    proc.communicate(timeout=30)
    assert proc.returncode == -sig
    deadline = time.time() + 10
    while (os.path.exists(run_dir) or not all(gone(p) for p in tree)) and time.time() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(run_dir)
    assert all(gone(p) for p in tree)


def _signal_handlers():
    return [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)]


@pytest.mark.timeout(60)
def test_ranks_have_python_default_signal_handlers(clean_launch):
    """The ranks are forked from the agent, whose elastic handlers must not stay: a SIGTERM from
    elastic ends a rank at once, even one blocked in a collective."""
    values = launch(_signal_handlers, nprocs=2, progress=False).values
    assert values == [[signal.SIG_DFL, signal.SIG_DFL, signal.default_int_handler]] * 2
