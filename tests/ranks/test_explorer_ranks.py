"""explorer/: Explorer.launch hands the plan to launch_plan, on real gloo ranks. (The Explorer object's
tables, plans, estimates, charts and reprs, no widgets, no ranks: tests/unit/test_explorer.py.)"""
import os

os.environ.setdefault("MPLBACKEND", "Agg")

import pytest
import torch

from snn_explorer import LaunchOptions
from snn_explorer.explorer import Explorer
from snn_explorer.zoo import build


@pytest.fixture(scope="module")
def ex():
    explorer = Explorer.from_zoo("mlp")
    explorer.enumerate(world_size=4)
    return explorer


def _step(runtime, step, batch, state, inputs, labels):
    share = runtime.plan.per_rank_batch
    start = runtime.dp_rank * share
    loss, _ = runtime.forward_loss(torch.nn.CrossEntropyLoss(), inputs[:, start:start + share],
                                   labels[start:start + share])
    state["optimizer"].zero_grad()
    loss.backward()
    state["optimizer"].step()
    return loss.item()


def test_launch_hands_the_plan_to_launch_plan():
    zoo = build("mlp")
    ex = Explorer.from_zoo(zoo)
    plan = ex.add_plan(topology={"dp": 2})
    result = ex.launch(plan, _step, steps=1, options=LaunchOptions(comm_backend="gloo", progress=False, timeout=120),
                       train_kwargs={"inputs": zoo.example_input, "labels": zoo.labels})
    assert sorted(result.losses) == [0, 1] and all(len(v) == 1 for v in result.losses.values())
