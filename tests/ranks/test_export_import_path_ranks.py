"""An exported job carries the import path of the user's own model module: command.sh runs under
torchrun (2 gloo ranks) where ``import mymodels`` alone fails.
(The tests in one process: tests/unit/test_export_import_path.py.)"""
from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys

import cloudpickle
import pytest
import torch
from test_export_import_path import MYMODELS, step
from torch import nn

from snn_explorer import analyze, plan
from snn_explorer.launcher import ExportOptions, export_job
from snn_explorer.zoo import reset_state

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture()
def mymodels(tmp_path, monkeypatch):
    folder = tmp_path / "notebook_folder"
    folder.mkdir()
    (folder / "mymodels.py").write_text(MYMODELS)
    monkeypatch.syspath_prepend(str(folder))
    import mymodels

    yield mymodels, str(folder)
    sys.modules.pop("mymodels", None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(200)
def test_the_exported_job_runs_under_torchrun_without_pythonpath_help(mymodels, tmp_path):
    module, folder = mymodels
    torch.manual_seed(0)
    model = module.MyNet(in_features=8, hidden=(16,), num_classes=4)
    inputs, labels = torch.rand(6, 8, 8) * 2, torch.randint(0, 4, (8,))
    dp = plan(analysis=analyze(model), objective="speed", topology={"dp": 2}, batch_size=8)
    job = export_job(dp, step, tmp_path / "job", model=model, steps=2, train_kwargs={"inputs": inputs, "labels": labels}, options=ExportOptions(port=_free_port()))
    assert os.path.realpath(folder) in job.python_path
    command = open(job.command_file).read()
    assert "the job imports" in command and "mymodels" in command and f"export PYTHONPATH={folder}" in command
    assert f"export PYTHONPATH={folder}" in open(job.sbatch_file).read()
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "TMPDIR": str(tmp_path / "tmp"),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    alone = subprocess.run([sys.executable, "-c", "import mymodels"], cwd=job.path, env=env, capture_output=True,
                           text=True, timeout=60)
    assert alone.returncode != 0 and "No module named 'mymodels'" in alone.stderr  # the job must bring the path
    done = subprocess.run(["bash", job.command_file], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    reference = copy.deepcopy(model)
    for rank in (0, 1):
        losses = [m["loss"] for m in json.load(open(os.path.join(job.path, "results", f"rank{rank}.json")))]
        reset_state(reference)
        with torch.no_grad():
            out = reference(inputs[:, rank * 4:(rank + 1) * 4])
        assert out.std() > 0  # the outputs vary: the loss comparison is not trivially equal
        assert len(losses) == 2 and losses[0] == pytest.approx(
            nn.CrossEntropyLoss()(out.mean(0), labels[rank * 4:(rank + 1) * 4]).item(), rel=1e-5)
