"""launch_plan with checkpoint_dir / checkpoint_every / max_restarts: a rank SIGKILLed mid-step, the
group restarted, training resumed from the last complete checkpoint equals an uninterrupted run."""
import os
import signal

import pytest
from launch_helpers import live_children
from torch import nn

import snn_explorer as se
from snn_explorer.core.checkpoints import latest_checkpoint, read_manifest
from snn_explorer.ranks import LaunchError
from snn_explorer.zoo import build

STEPS = 10
KILLED_STEP = 6  # the 7th of 10, after the checkpoint of step 6


def _step(runtime, step, batch, state, inputs, labels, kill_marker=None):
    share, start = runtime.plan.per_rank_batch, runtime.dp_rank * runtime.plan.per_rank_batch
    loss, _ = runtime.forward_loss(nn.CrossEntropyLoss(), inputs[:, start:start + share], labels[start:start + share])
    if kill_marker and step == KILLED_STEP and runtime.dp_rank == 1 and not os.path.exists(kill_marker):
        open(kill_marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)  # in the middle of the step, after the forward
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
    kw = dict(steps=STEPS, optimizer={"lr": 1e-2})
    run = se.LaunchOptions(progress=False, timeout=300)
    whole = se.launch_plan(model, plan, _step, train_kwargs=data, options=run, **kw).losses[0]
    assert len(set(whole)) == STEPS  # training moves the loss
    ckpt, marker = tmp_path / "ckpt", str(tmp_path / "killed")
    faulty = dict(train_kwargs={**data, "kill_marker": marker}, options=run.replace(checkpoint_dir=ckpt, checkpoint_every=2),
                  **kw)
    with pytest.raises(LaunchError, match="rank 1"):  # without restarts the fault ends the launch
        se.launch_plan(model, plan, _step, **faulty)
    assert latest_checkpoint(ckpt).name == "step-000006" and read_manifest(latest_checkpoint(ckpt))["step"] == 6
    assert not [p.name for p in ckpt.iterdir() if p.name.endswith(".partial")] or \
        latest_checkpoint(ckpt).name == "step-000006"  # an unfinished write is never the latest
    resumed = se.launch_plan(model, plan, _step, **faulty).losses[0]  # launched again by hand
    assert resumed == pytest.approx(whole[KILLED_STEP:], abs=1e-12)

    restarted_dir, marker = tmp_path / "restarted", str(tmp_path / "killed-again")
    restarted = se.launch_plan(model, plan, _step, train_kwargs={**data, "kill_marker": marker}, options=run.replace(checkpoint_dir=restarted_dir, checkpoint_every=2, max_restarts=1), **kw)
    assert os.path.exists(marker) and restarted.restarts == 1 and "rank 1" in restarted.faults[0]
    assert restarted.losses[0] == pytest.approx(whole[KILLED_STEP:], abs=1e-12)
    assert latest_checkpoint(restarted_dir).name == f"step-{STEPS:06d}"
    assert not live_children(), "no rank or agent outlives the launch"


def test_max_restarts_needs_checkpoints_to_resume_from():
    zoo = build("mlp")
    plan = se.plan(analysis=se.analyze(zoo.model), objective="speed", topology={"dp": 2}, mode="dp",
                   batch_size=zoo.batch_size)
    with pytest.raises(ValueError, match="max_restarts=2 needs checkpoint_dir and checkpoint_every"):
        se.launch_plan(zoo.model, plan, _step, options=se.LaunchOptions(max_restarts=2))
    with pytest.raises(ValueError, match=r"max_restarts=-1 must be a non-negative int"):
        se.launch_plan(zoo.model, plan, _step, options=se.LaunchOptions(max_restarts=-1))
