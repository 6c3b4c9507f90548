"""The launcher's pieces without spawning ranks: validation, events, displays, errors, export files."""
from __future__ import annotations

import io
import json
import os
import re
import threading

import pytest
from launch_helpers import live_children

from snn_explorer import analyze, plan
from snn_explorer.launcher import (
    ExportOptions,
    LaunchError,
    LaunchOptions,
    RankFailure,
    export_job,
    launch,
    launch_plan,
    resolve_backend,
)
from snn_explorer.ranks import channel
from snn_explorer.ranks.display import CallbackDisplay, NullDisplay, TextDisplay, choose_display
from snn_explorer.ranks.progress import Tracker, report
from snn_explorer.zoo import build


@pytest.fixture(scope="module")
def mlp_plan():
    zoo = build("mlp")
    analysis = analyze(zoo.model, model_family=zoo.family)
    return zoo, plan(analysis=analysis, objective="memory", topology={"dp": 2, "tp": 2}, backend="torch",
                     batch_size=8)


@pytest.mark.parametrize("kwargs, match", [
    ({"nprocs": 0}, "nprocs=0"), ({"nprocs": True}, "nprocs=True"), ({"nprocs": 2, "backend": "mpi"}, "backend='mpi'"),
    ({"nprocs": 2, "timeout": -1}, "timeout=-1"), ({"nprocs": 2, "timeout": float("nan")}, "timeout=nan"),
    ({"nprocs": 2, "timeout": float("inf")}, "timeout=inf"), ({"nprocs": 2, "timeout": -0.5}, "timeout=-0.5"),
])
def test_bad_arguments_fail_before_any_process(kwargs, match):
    with pytest.raises(ValueError, match=match):
        launch(print, **kwargs)
    assert not live_children()


def test_nccl_without_a_gpu_per_rank_fails_before_any_process():
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=rf"backend='nccl' needs one CUDA device per rank: 64 rank\(s\), {gpus} visible"):
        launch(print, nprocs=64, backend="nccl", progress=False)
    assert not live_children()


def test_unwritable_log_dir_fails_before_any_process(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="log_dir=.*a-file/logs.* is not a directory this process can write"):
        launch(print, nprocs=2, progress=False, log_dir=str(blocker / "logs"))
    assert not live_children()


def test_rank_exit_is_a_failure_unless_the_value_was_stored():
    tracker = Tracker(3, started=0.0)
    tracker.apply({"kind": "end", "rank": 0, "time": 1.0, "seconds": 0.5})
    tracker.apply({"kind": "exit", "rank": 0, "time": 1.5, "code": 0})  # the normal end after storing
    tracker.apply({"kind": "exit", "rank": 1, "time": 2.0, "code": 0})
    tracker.apply({"kind": "exit", "rank": 2, "time": 2.0, "code": 1, "how": "SystemExit", "text": "bye"})
    tracker.apply({"kind": "exit", "rank": 2, "time": 2.1, "code": 1})  # the agent saw it too
    assert [s.status for s in tracker.ranks.values()] == ["done", "failed", "failed"]
    assert tracker.ranks[1].message == "exited with code 0 before returning a value"
    assert tracker.ranks[2].message == "exited with code 1 before returning a value: bye"
    assert tracker.ranks[2].exit_how == "SystemExit" and tracker.unfinished() == [1, 2]


def test_unpicklable_payload_fails_before_any_process(tmp_path):
    lock = threading.Lock()
    with pytest.raises(TypeError, match="lock"):
        launch(lambda: lock, nprocs=2, progress=False)
    assert not live_children()


def test_auto_backend_is_gloo_without_enough_gpus():
    import torch

    assert resolve_backend("gloo", 2) == "gloo"
    if torch.cuda.device_count() < 64:
        assert resolve_backend("auto", 64) == "gloo"


def test_event_reader_skips_partial_lines(tmp_path):
    run = str(tmp_path)
    channel.make_layout(run)
    channel.emit(run, 0, "start", pid=1)
    with open(channel.path(run, "events", "1.jsonl"), "a") as fh:
        fh.write('{"kind": "start", "rank": 1')
    reader = channel.EventReader(run)
    assert [e["rank"] for e in reader.poll()] == [0]
    with open(channel.path(run, "events", "1.jsonl"), "a") as fh:
        fh.write(', "time": 1.0, "pid": 2}\n')
    assert [(e["rank"], e["pid"]) for e in reader.poll()] == [(1, 2)]
    assert list(reader.poll()) == []


def test_report_outside_a_launch_prints_one_line(capsys, monkeypatch):
    monkeypatch.delenv(channel.DIR_ENV, raising=False)
    monkeypatch.setenv("RANK", "3")
    report(step=2, total=5, loss=0.125, message="warming up", acc=0.5)
    assert capsys.readouterr().out == "[rank 3] step 2/5 loss=0.125 acc=0.5 warming up\n"


def test_tracker_heartbeats_and_displays():
    tracker = Tracker(2, started=100.0)
    tracker.apply({"kind": "start", "rank": 0, "time": 101.0, "pid": 11})
    tracker.apply({"kind": "report", "rank": 0, "time": 105.0, "step": 3, "total": 10, "loss": 0.5,
                   "message": None, "metrics": {}})
    tracker.apply({"kind": "end", "rank": 1, "time": 102.0, "seconds": 1.0})
    assert tracker.unfinished() == [0]
    assert tracker.silent(now=110.0, timeout=10) == [] and tracker.silent(now=116.0, timeout=10) == [0]
    fresh = Tracker(1, started=0.0)  # not started yet: the start allowance applies
    assert fresh.silent(now=60.0, timeout=10) == [] and fresh.silent(now=121.0, timeout=10) == [0]
    assert tracker.line(0) == "running · step 3/10 · loss 0.5"
    stream = io.StringIO()
    text = TextDisplay(stream=stream, interval=0)
    text.update(tracker)
    text.close(tracker)
    assert "r0 [###.......] running · step 3/10 · loss 0.5 | r1 done" in stream.getvalue()
    seen = []
    CallbackDisplay(seen.append).update(tracker)
    assert seen[0][0]["step"] == 3 and seen[0][1]["status"] == "done"
    assert isinstance(choose_display(False, 2), NullDisplay) and isinstance(choose_display(print, 2), CallbackDisplay)


def test_widget_display_updates_live():
    pytest.importorskip("ipywidgets")
    from snn_explorer.ranks.display import WidgetDisplay

    tracker = Tracker(2, started=0.0)
    shown = WidgetDisplay(2)
    tracker.apply({"kind": "report", "rank": 1, "time": 1.0, "step": 2, "total": 4, "loss": 1.0,
                   "message": "hi", "metrics": {}})
    tracker.apply({"kind": "end", "rank": 0, "time": 1.0, "seconds": 0.5})
    shown.update(tracker)
    assert (shown._bars[1].value, shown._bars[1].max) == (2, 4) and "hi" in shown._texts[1].value
    assert shown._bars[0].bar_style == "success"


def test_launch_error_lists_root_cause_first():
    failures = {
        0: RankFailure(0, 1, "RuntimeError", "Connection reset by peer", "tb0", time=10.0),
        1: RankFailure(1, -9, "SIGKILL", "killed by SIGKILL"),
        2: RankFailure(2, -15, "SIGTERM", "killed by SIGTERM", collateral=True),
    }
    err = LaunchError("launch failed", failures)
    assert list(err.failures) == [0, 1, 2] and err.root_cause.rank == 1
    lines = str(err).splitlines()
    assert lines[1].startswith("  rank 1 (exit code -9)") and lines[3].endswith("[ended by the launcher]")
    assert "remote traceback of rank 0:" in str(err)


def test_launch_plan_checks_the_plan_against_the_model_first(mlp_plan):
    _, p = mlp_plan
    other = build("vgg").model
    with pytest.raises((KeyError, ValueError)):
        launch_plan(other, p, lambda *a: 0.0, steps=1, options=LaunchOptions(progress=False))
    with pytest.raises(ValueError, match="steps=0"):
        launch_plan(mlp_plan[0].model, p, lambda *a: 0.0, steps=0)
    assert not live_children()


def test_export_job_files(mlp_plan, tmp_path):
    zoo, p = mlp_plan
    job = export_job(p, lambda runtime, step, batch, state: 0.0, tmp_path / "job", model=zoo.model,
                     steps=5, options=ExportOptions(nnodes=2, gpus_per_node=2, partition="gpu", job_name="mlp-run"))
    assert json.load(open(job.plan_file))["mode"] == p.mode
    assert job.command.startswith("torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint ")
    assert re.search(r'--rdzv-id "\$\{SNN_RDZV_ID:-mlp-run-[0-9a-f]{8}\}" --max-restarts 0 run.py --plan plan.json',
                     job.command)  # an id of this export's own: another job of the same name does not join it
    assert '--rdzv-endpoint "${SNN_RDZV_ENDPOINT:-${MASTER_ADDR:?' in job.command and ":${MASTER_PORT:-29500}}" in job.command
    assert job.command in open(job.command_file).read() and os.access(job.command_file, os.X_OK)
    sbatch = open(job.sbatch_file).read()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=2",
                 "#SBATCH --partition=gpu", "srun torchrun --nnodes 2 --nproc-per-node 2",
                 "--rdzv-endpoint $MASTER_ADDR:$MASTER_PORT --rdzv-id $SLURM_JOB_ID",
                 "export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"):
        assert line in sbatch
    assert os.path.exists(job.payload_file) and "snn_explorer.launcher.job" in open(job.script).read()


def test_export_single_node_is_loopback_and_names_are_checked(mlp_plan, tmp_path):
    zoo, p = mlp_plan
    step = lambda runtime, step, batch, state: 0.0  # noqa: E731
    job = export_job(p, step, tmp_path / "one", model=zoo.model, options=ExportOptions(max_restarts=2))
    assert job.command == "python run.py --max-restarts 2"  # every rank from run.py: 127.0.0.1, free ports
    text = open(job.command_file).read()
    assert 'export TMPDIR="$(mktemp -d' in text and "trap 'rm -rf \"$TMPDIR\"' EXIT" in text
    script = tmp_path / "mytrain.py"
    script.write_text("print('hi')\n")
    standalone = export_job(p, str(script), tmp_path / "script")
    assert standalone.command.startswith(f"torchrun --standalone --nnodes 1 --nproc-per-node {p.world_size} ")
    for bad in ("a/b", "", "-x", ".hidden", "a b", "x" * 65, "a;rm"):
        rule = "a non-empty string" if bad == "" else "1-64 characters"  # '' fails the shell-value check first
        with pytest.raises(ValueError, match=rf"job_name={re.escape(repr(bad))} must be {rule}"):
            export_job(p, step, tmp_path / "bad", model=zoo.model, options=ExportOptions(job_name=bad))
    assert not (tmp_path / "bad").exists()  # refused before anything was written
    with pytest.raises(ValueError, match="rdzv_endpoint='nohost' must be host:port"):
        export_job(p, step, tmp_path / "bad", model=zoo.model, options=ExportOptions(nnodes=2, rdzv_endpoint="nohost"))
    given = export_job(p, step, tmp_path / "given", model=zoo.model, options=ExportOptions(nnodes=2, rdzv_endpoint="node7:31000", port=31001))
    assert '"${SNN_RDZV_ENDPOINT:-node7:31000}"' in given.command
    assert "export MASTER_PORT=${MASTER_PORT:-31001}" in open(given.sbatch_file).read()


def test_export_job_with_a_script_and_bad_shapes(mlp_plan, tmp_path):
    zoo, p = mlp_plan
    script = tmp_path / "mytrain.py"
    script.write_text("print('hi')\n")
    job = export_job(p, str(script), tmp_path / "job")
    assert open(job.script).read() == "print('hi')\n" and job.command.endswith("train.py --plan plan.json")
    assert job.payload_file is None
    with pytest.raises(ValueError, match="nnodes=3 x nproc_per_node=2 = 6 ranks"):
        export_job(p, str(script), tmp_path / "bad", options=ExportOptions(nnodes=3, nproc_per_node=2))
    with pytest.raises(ValueError, match="needs model="):
        export_job(p, lambda *a: 0, tmp_path / "bad")
    with pytest.raises(FileNotFoundError, match="nope.py"):
        export_job(p, str(tmp_path / "nope.py"), tmp_path / "bad")
