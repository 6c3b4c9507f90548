"""Atomic checkpoints under faults, in one process: a full disk (ENOSPC injected where DCP syncs a shard)
leaves the previous checkpoint loadable, names what failed, and leaves no directory that passes for a
checkpoint. (A rank that raises mid-save and a rank SIGKILLed inside the save, on real gloo ranks:
tests/ranks/test_checkpoint_faults.py.)"""
import os

import pytest
from test_checkpoint_faults import _shard_fsync_fails

import snn_explorer as se
from snn_explorer.core.checkpoints import CheckpointError, latest_checkpoint, step_path
from snn_explorer.zoo import build

pytestmark = pytest.mark.timeout(600)


def _mode_none_runtime():
    zoo = build("mlp", "tiny")
    plan = se.plan(analysis=se.analyze(zoo.model), objective="speed", topology={"dp": 1}, mode="none",
                   batch_size=zoo.batch_size)
    runtime = se.apply(model=zoo.model, plan=plan, device_type="cpu")
    return runtime, runtime.build_optimizer(lr=1e-2)


def test_a_full_disk_in_one_process_keeps_the_previous_checkpoint(tmp_path):
    runtime, optimizer = _mode_none_runtime()
    first = runtime.save_checkpoint(step_path(tmp_path, 1), optimizer=optimizer, step=1)
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    real = _shard_fsync_fails()
    try:
        with pytest.raises(CheckpointError, match=r"saving checkpoint .*step-000002 failed \(rank 0: OSError: "
                                                  r"\[Errno 28\] No space left on device"):
            runtime.save_checkpoint(step_path(tmp_path, 2), optimizer=optimizer, step=2)
        with pytest.raises(CheckpointError, match="No space left on device"):  # replacing the same step
            runtime.save_checkpoint(first, optimizer=optimizer, step=1, overwrite=True)
    finally:
        os.fsync = real
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]  # no partial left, no step 2
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    assert latest_checkpoint(tmp_path) == first and runtime.load_checkpoint(first, optimizer=optimizer).step == 1
