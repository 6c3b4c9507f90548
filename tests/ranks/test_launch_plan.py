"""launch_plan on 2 gloo ranks (dp with a dataset, tp without) and the exported torchrun job."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import cloudpickle
import pytest
import torch
from launch_helpers import clean_launch  # noqa: F401  (fixture)
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from snn_explorer import analyze, plan
from snn_explorer.launcher import LaunchOptions, export_job, launch_plan
from snn_explorer.zoo import build, reset_state

cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS = 3


def dp_step(runtime, step, batch, state):
    """A dataset batch is [N, T, F]; the zoo model wants time first."""
    inputs, labels = batch
    loss, _ = runtime.forward_loss(nn.CrossEntropyLoss(), inputs.transpose(0, 1), labels)
    state["optimizer"].zero_grad()
    loss.backward()
    state["optimizer"].step()
    return {"loss": loss, "samples": labels.shape[0], "draw": torch.rand(()).item()}


def tp_step(runtime, step, batch, state, inputs, labels):
    loss, _ = runtime.forward_loss(nn.CrossEntropyLoss(), inputs, labels)
    state["optimizer"].zero_grad()
    loss.backward()
    state["optimizer"].step()
    return {"loss": loss, "draw": torch.rand(()).item()}


def _reference_loss(model, inputs, labels) -> float:
    """Single-process loss of an untrained copy on [T, N, F] inputs."""
    model = copy.deepcopy(model)
    reset_state(model)
    with torch.no_grad():
        return nn.CrossEntropyLoss()(model(inputs).mean(0), labels).item()


@pytest.fixture(scope="module")
def zoo():
    return build("mlp")


@pytest.fixture(scope="module")
def tp_run(zoo):
    tp_plan = plan(analysis=analyze(zoo.model, model_family=zoo.family), objective="memory", topology={"tp": 2},
                   backend="torch", batch_size=zoo.batch_size, mode="tp")
    kwargs = {"inputs": zoo.example_input, "labels": zoo.labels}
    result = launch_plan(zoo.model, tp_plan, tp_step, steps=STEPS, optimizer={"lr": 1e-2}, train_kwargs=kwargs, options=LaunchOptions(progress=False))
    return tp_plan, kwargs, result


@pytest.mark.timeout(90)
def test_launch_plan_dp_with_dataset(clean_launch, zoo):
    dp_plan = plan(analysis=analyze(zoo.model, model_family=zoo.family), objective="speed", topology={"dp": 2},
                   backend="torch", batch_size=4, mode="dp")
    dataset = TensorDataset(zoo.example_input.transpose(0, 1).contiguous(), zoo.labels)
    result = launch_plan(zoo.model, dp_plan, dp_step, steps=STEPS, dataset=dataset, options=LaunchOptions(progress=False))
    assert sorted(result.losses) == [0, 1] and all(len(v) == STEPS for v in result.losses.values())
    assert all(m["samples"] == 2 for steps in result.values for m in steps)
    assert [r["step"] for r in result.reports[0]] == [1, 2, 3] and result.reports[0][-1]["total"] == STEPS
    for rank in (0, 1):  # step 0 of each rank equals a single-process forward on that rank's samples
        sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=0, drop_last=True)
        inputs, labels = next(iter(DataLoader(dataset, batch_size=2, sampler=sampler)))
        reference = _reference_loss(zoo.model, inputs.transpose(0, 1), labels)
        assert result.losses[rank][0] == pytest.approx(reference, rel=1e-5)
    assert result.losses[0][0] != result.losses[1][0]  # the ranks saw different samples
    draws = [[m["draw"] for m in steps] for steps in result.values]
    assert draws[0] != draws[1], "data a step draws at random must differ between dp ranks"
    assert repr(result).startswith("TrainResult(2 ranks")


@pytest.mark.timeout(90)
def test_launch_plan_tp(clean_launch, zoo, tp_run):
    _, _, result = tp_run
    losses = result.losses
    assert losses[0] == losses[1]  # tensor-parallel peers compute one model on the same batch
    assert [m["draw"] for m in result.values[0]] == [m["draw"] for m in result.values[1]], \
        "tensor-parallel peers must draw the same random data"
    assert losses[0][0] == pytest.approx(_reference_loss(zoo.model, zoo.example_input, zoo.labels), rel=1e-5)
    assert losses[0][-1] < losses[0][0]


@pytest.mark.timeout(120)
def test_exported_job_runs_under_torchrun_like_launch(zoo, tp_run, tmp_path):
    tp_plan, kwargs, launched = tp_run
    job = export_job(tp_plan, tp_step, tmp_path / "job", model=zoo.model, steps=STEPS, optimizer={"lr": 1e-2},
                     train_kwargs=kwargs)
    assert json.load(open(job.plan_file)) == tp_plan.to_dict()
    assert job.command == "python run.py --max-restarts 0"  # one node: run.py starts every rank itself
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    (tmp_path / "tmp").mkdir()  # torchrun's own temporary files
    done = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "run.py"], cwd=job.path,
                          capture_output=True, text=True, timeout=100,
                          env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        exported = json.load(open(os.path.join(job.path, "results", f"rank{rank}.json")))
        assert [m["loss"] for m in exported] == pytest.approx(launched.losses[rank], rel=1e-6)


class CountingNeuron(nn.Module):
    """A neuron snn_explorer cannot recognise by itself (defined here, so it travels by value)."""

    def __init__(self):
        super().__init__()
        self.v = None

    def reset(self):
        self.v = None

    def forward(self, x):
        self.v = x if self.v is None else self.v + x
        return (self.v > 1).to(x.dtype)


def _library_on_rank():
    from snn_explorer.core.model import snn_library

    return snn_library(CountingNeuron())


@pytest.mark.timeout(120)
def test_register_stateful_reaches_launched_and_spawned_ranks(clean_launch):
    from snn_explorer import register_stateful, unregister_stateful
    from snn_explorer.core.model import snn_library
    from snn_explorer.launcher import launch
    from snn_explorer.ranks import run

    assert snn_library(CountingNeuron()) is None  # not recognised without the registration
    register_stateful(CountingNeuron)
    try:
        launched = launch(_library_on_rank, nprocs=2, backend="gloo", progress=False, timeout=60)
        spawned = run(_library_on_rank, nprocs=2, backend="gloo", timeout=60).values  # measure()'s way
    finally:
        unregister_stateful(CountingNeuron)
    assert launched.values == ["registered", "registered"]
    assert spawned == ["registered", "registered"]
