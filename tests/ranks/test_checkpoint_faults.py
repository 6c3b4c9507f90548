"""Atomic checkpoints under faults: a full disk (ENOSPC injected where DCP syncs a shard), a rank
that raises mid-save and a rank SIGKILLed inside the save each leave the previous checkpoint
loadable, name what failed (and on which rank), and leave no directory that passes for a
checkpoint. Real gloo ranks (one 2-rank group for the save faults, launch_plan for the kill).
(The tests in one process: tests/unit/test_checkpoint_faults_unit.py.)"""
import errno
import os
import signal

import pytest
import torch
from distributed_harness import run_on_ranks
from launch_helpers import live_children
from torch import nn

import snn_explorer as se
from snn_explorer.core.checkpoints import CheckpointError, latest_checkpoint, read_manifest
from snn_explorer.launcher import LaunchOptions, split_keywords
from snn_explorer.ranks import LaunchError
from snn_explorer.zoo import build

pytestmark = pytest.mark.timeout(600)


def _shard_fsync_fails(error_number=errno.ENOSPC, action=None):
    """Replace os.fsync so that syncing a ``.distcp`` shard fails (or runs ``action``); other files sync."""
    real = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".distcp"):
            if action is not None:
                action()
            raise OSError(error_number, os.strerror(error_number))
        return real(fd)

    os.fsync = fsync
    return real


def _fail_mid_write():
    raise RuntimeError("rank 1 failed while writing its shard")


def _save_faults(root):
    """On 2 ranks: a good save, then rank 1's disk full, then rank 1 raising mid-write; after each the
    first checkpoint still loads on both ranks."""
    import torch.distributed as dist

    import snn_explorer as se
    from snn_explorer.core.checkpoints import CheckpointError, latest_checkpoint, step_path
    from snn_explorer.zoo import build

    zoo = build("mlp", "tiny")
    plan = se.plan(analysis=se.analyze(zoo.model), objective="speed", topology={"dp": 2}, mode="fsdp2",
                   batch_size=zoo.batch_size)
    runtime = se.apply(model=zoo.model, plan=plan, device_type="cpu")
    optimizer = runtime.build_optimizer(lr=1e-2)
    good = runtime.save_checkpoint(step_path(root, 1), optimizer=optimizer, step=1)
    want = {k: v.clone() for k, v in runtime.full_parameters().items()}
    errors = {}
    for fault, action in (("full disk", None), ("rank raises", _fail_mid_write)):
        real = _shard_fsync_fails(action=action) if dist.get_rank() == 1 else os.fsync
        try:
            runtime.save_checkpoint(step_path(root, 2), optimizer=optimizer, step=2)
            errors[fault] = None
        except CheckpointError as exc:
            errors[fault] = str(exc)
        finally:
            os.fsync = real
        with torch.no_grad():
            for p in runtime.model.parameters():
                p.to_local().add_(1.0)  # moved away, so that the load below must restore them
        loaded = runtime.load_checkpoint(latest_checkpoint(root), optimizer=optimizer)
        errors[f"{fault} restored"] = (loaded.step, all(torch.equal(v, want[k])
                                                        for k, v in runtime.full_parameters().items()))
    errors["left"] = sorted(p.name for p in os.scandir(root)) if dist.get_rank() == 0 else None
    return errors, str(good)


def test_a_rank_failing_mid_save_is_named_on_every_rank_and_the_previous_checkpoint_loads(tmp_path):
    results = run_on_ranks(_save_faults, 2, str(tmp_path), timeout=180)
    for rank, (errors, _) in enumerate(results):
        assert "rank 1: OSError: [Errno 28] No space left on device" in errors["full disk"], (rank, errors)
        assert "rank 1: RuntimeError: rank 1 failed while writing its shard" in errors["rank raises"], (rank, errors)
        assert "rank 0" not in errors["full disk"]
        assert errors["full disk restored"] == errors["rank raises restored"] == (1, True)
    assert results[0][0]["left"] == ["step-000001"]


def _step_then_kill_in_save(runtime, step, batch, state, inputs, labels, marker):
    """A training step; at step index 3 (the save of step 4 follows) rank 0 arms a SIGKILL inside
    DCP's write of its shard, once (``marker``). Rank 0: it is the rank that would clear a failed
    write, so the unfinished directory stays behind."""
    share, start = runtime.plan.per_rank_batch, runtime.dp_rank * runtime.plan.per_rank_batch
    loss, _ = runtime.forward_loss(nn.CrossEntropyLoss(), inputs[:, start:start + share], labels[start:start + share])
    state["optimizer"].zero_grad()
    loss.backward()
    state["optimizer"].step()
    if marker and step == 3 and runtime.dp_rank == 0 and not os.path.exists(marker):
        open(marker, "w").close()
        _shard_fsync_fails(action=lambda: os.kill(os.getpid(), signal.SIGKILL))
    return loss


def test_a_rank_killed_inside_a_save_leaves_the_previous_checkpoint_and_resumes(tmp_path):
    zoo = build("mlp")
    model = zoo.model.double()
    plan = se.plan(analysis=se.analyze(model), objective="speed", topology={"dp": 2}, mode="dp",
                   batch_size=zoo.batch_size)
    data = {"inputs": zoo.example_input.double(), "labels": zoo.labels}
    kw = dict(steps=6, progress=False, optimizer={"lr": 1e-2}, timeout=300)
    whole = se.launch_plan(model, plan, _step_then_kill_in_save, train_kwargs={**data, "marker": None},
                           **split_keywords(LaunchOptions, kw))
    assert len(set(whole.losses[0])) == 6
    ckpt = tmp_path / "ckpt"
    faulty = dict(train_kwargs={**data, "marker": str(tmp_path / "killed")}, checkpoint_dir=ckpt, checkpoint_every=2)
    with pytest.raises(LaunchError, match="rank 0 SIGKILL") as failed:
        se.launch_plan(model, plan, _step_then_kill_in_save, **split_keywords(LaunchOptions, {**faulty, **kw}))
    assert "rank 1" in str(failed.value)  # the peer left waiting is reported too, after the cause
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == [".step-000004.partial", "step-000002"], names  # the write of step 4 never completed
    with pytest.raises(CheckpointError, match="no manifest.json"):
        read_manifest(ckpt / ".step-000004.partial")  # a partial folder is not taken for a checkpoint
    assert latest_checkpoint(ckpt).name == "step-000002" and read_manifest(ckpt / "step-000002")["step"] == 2
    resumed = se.launch_plan(model, plan, _step_then_kill_in_save, **split_keywords(LaunchOptions, {**faulty, **kw}))
    assert resumed.losses[0] == pytest.approx(whole.losses[0][2:], abs=1e-12)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000002", "step-000004", "step-000006"]
    assert not live_children(), "no rank or agent outlives the launches"
