"""launch_plan with checkpoint_dir / checkpoint_every: a rank SIGKILLed mid-step, the launch repeated,
training resumed from the last complete checkpoint equals an uninterrupted run."""
import os
import signal

import pytest
import torch
from torch import nn

import snn_explorer as se
from snn_explorer.core.checkpoint import latest_checkpoint, read_manifest
from snn_explorer.ranks import LaunchError
from snn_explorer.zoo import build

STEPS = 6


def _step(runtime, step, batch, state, inputs, labels, kill_marker=None):
    share, start = runtime.plan.per_rank_batch, runtime.dp_rank * runtime.plan.per_rank_batch
    loss, _ = runtime.forward_loss(nn.CrossEntropyLoss(), inputs[:, start:start + share], labels[start:start + share])
    if kill_marker and step == 4 and runtime.dp_rank == 1 and not os.path.exists(kill_marker):
        open(kill_marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)  # in the middle of step 5 of 6, after the forward
    state["optimizer"].zero_grad()
    loss.backward()
    state["optimizer"].step()
    return loss


def test_a_killed_rank_resumes_from_the_last_complete_checkpoint(tmp_path):
    zoo = build("mlp")
    model = zoo.model.double()
    plan = se.plan(analysis=se.analyze(model), objective="speed", topology={"dp": 2}, mode="fsdp2",
                   batch_size=zoo.batch_size)
    data = {"inputs": zoo.example_input.double(), "labels": zoo.labels}
    kw = dict(steps=STEPS, progress=False, optimizer={"lr": 1e-2}, timeout=300)
    whole = se.launch_plan(model, plan, _step, train_kwargs=data, **kw).losses[0]
    assert len(set(whole)) == STEPS  # training moves the loss
    ckpt, marker = tmp_path / "ckpt", str(tmp_path / "killed")
    faulty = dict(train_kwargs={**data, "kill_marker": marker}, checkpoint_dir=ckpt, checkpoint_every=2, **kw)
    with pytest.raises(LaunchError, match="rank 1"):
        se.launch_plan(model, plan, _step, **faulty)
    assert latest_checkpoint(ckpt).name == "step-000004" and read_manifest(latest_checkpoint(ckpt))["step"] == 4
    assert not [p.name for p in ckpt.iterdir() if p.name.endswith(".partial")] or \
        latest_checkpoint(ckpt).name == "step-000004"  # an unfinished write is never the latest
    resumed = se.launch_plan(model, plan, _step, **faulty).losses[0]
    assert len(resumed) == STEPS - 4
    assert resumed == pytest.approx(whole[4:], abs=1e-12)
    assert latest_checkpoint(ckpt).name == f"step-{STEPS:06d}"
