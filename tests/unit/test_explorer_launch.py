"""The Launch tab driven in-process, without ranks: save / load a plan, export a job, the message for a model
without labels. (Launch, stop, a rank's error and the tab's code on 2 gloo ranks:
tests/ranks/test_explorer_launch_ranks.py.)"""
from __future__ import annotations

import copy
import json
import os
import sys

import cloudpickle
import pytest
import torch
from launch_helpers import clean_launch, gone  # noqa: F401  (fixture)
from torch import nn

from snn_explorer.explorer import Explorer
from snn_explorer.zoo import build, reset_state

os.environ.setdefault("MPLBACKEND", "Agg")
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture()
def ui():
    ex = Explorer.from_zoo(build("mlp"))
    ex.ui.world_size.value = 2  # dp=2
    return ex.ui


def _share_loss(model, inputs, labels, dp_rank: int, share: int) -> float:
    """Single-process cross-entropy of an untrained copy on one dp rank's share of the batch."""
    model = copy.deepcopy(model)
    reset_state(model)
    x, y = inputs[:, dp_rank * share:(dp_rank + 1) * share], labels[dp_rank * share:(dp_rank + 1) * share]
    with torch.no_grad():
        out = model(x)
    assert out.std() > 0, "the outputs are constant: the comparison would prove nothing"
    return nn.CrossEntropyLoss()(out.mean(0), y).item()


def test_without_labels_the_launch_says_what_is_missing():
    zoo = build("mlp")
    ex = Explorer(zoo.model, example_input=zoo.example_input)
    ex.ui.launcher.launch_button.click()
    assert ex.ui.launcher.thread is None
    assert "labels is None" in ex.ui.launcher.status.value and "train_fn" in ex.ui.launcher.status.value


def test_save_and_load_a_plan_as_json(ui, tmp_path):
    panel = ui.launcher
    ui.tp.value = 2
    saved_plan = ui.current
    panel.plan_file.value = str(tmp_path / "plan.json")
    assert panel.save() == str(tmp_path / "plan.json")
    assert json.load(open(tmp_path / "plan.json")) == saved_plan.to_dict()
    ui.tp.value = 1
    assert ui.current != saved_plan and ui.ex.plans == []
    panel.load_button.click()
    assert ui.ex.plans == [saved_plan] and panel.plan.value == saved_plan
    assert "pinned as #1" in panel.files.value


def test_loading_refuses_what_is_not_a_plan(ui, tmp_path):
    panel = ui.launcher
    cases = {"code.json": '{"__reduce__": "os.system"}', "broken.json": "{not json",
             "list.json": "[1, 2]"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        panel.plan_file.value = str(tmp_path / name)
        assert panel.load() is None
        assert "cannot load a plan" in panel.files.value, name
    panel.plan_file.value = str(tmp_path / "missing.json")
    assert panel.load() is None and "No such file" in panel.files.value
    assert ui.ex.plans == []


@pytest.mark.timeout(200)
def test_export_button_writes_a_job_that_runs(ui, tmp_path, clean_launch):
    panel = ui.launcher
    panel.job_dir.value = str(tmp_path / "job")
    panel.steps.value = 2
    job = panel.export()
    assert job is not None and "python run.py" in panel.files.value  # one node: run.py starts the ranks itself
    assert json.load(open(job.plan_file)) == panel.plan.value.to_dict()
