"""One writer per checkpoint folder, and no NaN written or resumed from: launch_plan on 2 real gloo
ranks (dp) with a checkpoint every step."""
import os
import subprocess
import threading
import time

import pytest
import torch
from torch import nn

import snn_explorer as se
from snn_explorer.core.checkpoints import LOCK_NAME, CheckpointDirBusy, CheckpointError, FolderLock, latest_checkpoint
from snn_explorer.launcher import LaunchError
from snn_explorer.zoo import build


def _setup():
    zoo = build("mlp", "tiny")
    plan = se.plan(analysis=se.analyze(zoo.model), objective="speed", topology={"dp": 2}, mode="dp",
                   batch_size=zoo.batch_size)
    return zoo, plan


def nan_step(runtime, step, batch, state, inputs, labels, bad_step=None, bad_rank=1, wait_for=None):
    """A dp step; at ``bad_step`` (0-based) rank ``bad_rank``'s inputs are multiplied by NaN (its loss and
    gradients turn NaN)."""
    while wait_for and not os.path.exists(wait_for):
        time.sleep(0.05)
    share = runtime.plan.per_rank_batch
    x, y = inputs[:, runtime.dp_rank * share:][:, :share], labels[runtime.dp_rank * share:][:share]
    if step == bad_step and runtime.dp_rank == bad_rank:
        x = x * float("nan")
    state["optimizer"].zero_grad()
    loss = runtime.train_step(nn.CrossEntropyLoss(), x, y)
    state["optimizer"].step()
    return loss


def _weights(path):
    """The parameters of a checkpoint, loaded into a one-process copy of the model."""
    zoo = build("mlp", "tiny")
    plan = se.plan(analysis=se.analyze(zoo.model), objective="speed", topology={"dp": 1}, mode="none",
                   batch_size=zoo.batch_size)
    runtime = se.apply(model=zoo.model, plan=plan, device_type="cpu")
    runtime.load_checkpoint(path)
    return {n: p.detach().clone() for n, p in runtime.module.named_parameters()}


def test_a_nan_gradient_stops_before_its_update_and_checkpoint(tmp_path):
    zoo, plan = _setup()
    kw = dict(inputs=zoo.example_input, labels=zoo.labels, bad_step=2)
    # dp averages the gradients, so the NaN of rank 1's loss reaches rank 0's gradients too: both are named
    with pytest.raises(LaunchError, match=r"step 3: non-finite gradients \(NaN or Inf\) on rank\(s\) \[0, 1\]; stopped"):
        se.launch_plan(zoo.model, plan, nan_step, steps=5, train_kwargs=kw, options=se.LaunchOptions(checkpoint_dir=tmp_path, checkpoint_every=1, progress=False, timeout=120, max_restarts=2))
    assert latest_checkpoint(tmp_path).name == "step-000002"  # no restart: the numbers would come again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001", "step-000002"]  # no lock, no partial
    assert all(torch.isfinite(t).all() for t in _weights(tmp_path / "step-000002").values())


def test_skip_leaves_the_parameters_of_a_nan_step_as_they_were(tmp_path):
    zoo, plan = _setup()
    kw = dict(inputs=zoo.example_input, labels=zoo.labels, bad_step=2)
    result = se.launch_plan(zoo.model, plan, nan_step, steps=4, train_kwargs=kw, options=se.LaunchOptions(checkpoint_dir=tmp_path, checkpoint_every=1, progress=False, timeout=120, on_non_finite="skip"))
    assert [len(v) for v in result.losses.values()] == [4, 4]
    assert latest_checkpoint(tmp_path).name == "step-000004"
    w2, w3, w4 = (_weights(tmp_path / f"step-00000{i}") for i in (2, 3, 4))
    assert all(torch.equal(w2[k], w3[k]) for k in w2)  # step 3's update skipped on both ranks
    assert not all(torch.equal(w3[k], w4[k]) for k in w3)  # while step 4 trained: the comparison means something
    assert all(torch.isfinite(t).all() for t in w4.values())


def test_a_second_launch_into_a_folder_is_refused_at_once_naming_the_holder(tmp_path):
    zoo, plan = _setup()
    go = tmp_path / "go"
    kw = dict(inputs=zoo.example_input, labels=zoo.labels, wait_for=str(go))
    first = {}

    def run_first():
        try:
            first["result"] = se.launch_plan(zoo.model, plan, nan_step, steps=2, train_kwargs=kw, options=se.LaunchOptions(checkpoint_dir=tmp_path / "ckpt", checkpoint_every=1, progress=False, timeout=120))
        except Exception as exc:  # noqa: BLE001 - shown by the assert below
            first["error"] = exc
    thread = threading.Thread(target=run_first)
    thread.start()
    try:
        deadline = time.time() + 60
        while not (tmp_path / "ckpt" / LOCK_NAME).exists() and time.time() < deadline:
            time.sleep(0.05)
        started = time.perf_counter()
        with pytest.raises(CheckpointDirBusy, match=rf"in use by pid {os.getpid()} on .*one run writes a folder"):
            se.launch_plan(zoo.model, plan, nan_step, steps=2, train_kwargs=kw, options=se.LaunchOptions(checkpoint_dir=tmp_path / "ckpt", checkpoint_every=1, progress=False))
        assert time.perf_counter() - started < 5.0  # refused at its start, not mid-save
    finally:
        go.touch()
        thread.join(300)
    assert "error" not in first, first.get("error")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-000001", "step-000002"]


def test_a_stale_lock_of_a_dead_process_is_taken_over_and_said(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock = FolderLock(tmp_path)
    lock.me["pid"] = dead.pid
    lock.acquire()  # a lock file naming a process that is gone
    assert (tmp_path / LOCK_NAME).exists()
    taker = FolderLock(tmp_path).acquire()
    assert taker.took_over is not None and f"pid {dead.pid}" in taker.took_over
    with pytest.raises(CheckpointError, match=f"in use by pid {os.getpid()}"):
        FolderLock(tmp_path).acquire()  # now held by a live process
    taker.release()
    assert not (tmp_path / LOCK_NAME).exists()
    zoo, plan = _setup()
    stale = FolderLock(tmp_path / "run")
    stale.me["pid"] = dead.pid
    stale.acquire()
    with pytest.warns(RuntimeWarning, match=rf"took over the lock .* left by pid {dead.pid}"):
        se.launch_plan(zoo.model, plan, nan_step, steps=1, train_kwargs=dict(inputs=zoo.example_input, labels=zoo.labels), options=se.LaunchOptions(checkpoint_dir=tmp_path / "run", checkpoint_every=1, progress=False, timeout=120))
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-000001"]
