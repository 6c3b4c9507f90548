"""The snn-explorer console script: analyze, compare, export, and its error messages."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from snn_explorer.cli import main

FACTORY = '''
from snn_explorer.zoo import build

def make_net():
    return build("mlp").model

def step(runtime, step, batch, state):
    return 0.0
'''


def _module_in_cwd(tmp_path, monkeypatch, name: str, source: str):
    """Write ``name``.py into a fresh working directory (where the CLI imports factories from)."""
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    yield name
    sys.modules.pop(name, None)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    yield from _module_in_cwd(tmp_path, monkeypatch, "my_models", FACTORY)


def test_analyze_a_zoo_model(capsys):
    assert main(["analyze", "zoo:mlp"]) == 0
    out = capsys.readouterr().out
    assert "net.1" in out and "snntorch" in out and "net.0" in out


def test_analyze_json_for_a_module_factory(capsys, user_module):
    assert main(["analyze", f"{user_module}:make_net", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "analysis" and "net.0" in data["tensor_parallel_candidate_names"]


def test_compare_world_size_and_topology(capsys, user_module):
    assert main(["compare", f"{user_module}:make_net", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "dp=4" in out and "dp=2 x tp=2" in out and "tp=4" in out and "fsdp2_tp" in out
    assert main(["compare", "zoo:mlp", "--topology", "dp=2,tp=2", "--objective", "memory", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert [(p["mode"], p["objective"]) for p in plans] == [("fsdp2_tp", "memory")]


@pytest.mark.parametrize("argv, named", [
    (["analyze", "no_such_pkg.models:make"], "'no_such_pkg.models'"),
    (["analyze", "os:no_such_factory"], "'no_such_factory'"),
    (["analyze", "just_a_name"], "'just_a_name'"),
    (["analyze", "zoo:resnet"], "'resnet'"),
    (["compare", "zoo:mlp", "--topology", "dp=two"], "'dp=two'"),
    (["compare", "zoo:mlp", "--topology", "dp2"], "'dp2'"),
    (["compare", "zoo:mlp", "--topology", "dp=0"], "'dp=0'"),
    (["compare", "zoo:mlp", "--world-size", "0"], "world size 0"),
])
def test_bad_model_or_topology_names_the_value(capsys, argv, named):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("snn-explorer: error: ") and named in err


def test_export_writes_a_job(capsys, user_module, tmp_path):
    out_dir = tmp_path / "job"
    rc = main(["export", f"{user_module}:make_net", "--topology", "tp=2", "--objective", "memory",
               "--train", f"{user_module}:step", "--steps", "4", "--out", str(out_dir), "--gpus-per-node", "2"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "python run.py --max-restarts 0" in printed  # one node: run.py starts every rank on loopback
    assert sorted(os.listdir(out_dir)) == ["command.sh", "job.sbatch", "payload.pkl", "plan.json", "run.py"]
    assert json.load(open(out_dir / "plan.json"))["mode"] == "tp"
    assert "#SBATCH --gpus-per-node=2" in (out_dir / "job.sbatch").read_text()
    assert main(["export", "zoo:mlp", "--world-size", "2", "--objective", "speed", "--train", "os:nothing",
                 "--out", str(tmp_path / "x")]) == 2
    assert "'nothing'" in capsys.readouterr().err


def test_console_script_is_installed():
    exe = shutil.which("snn-explorer", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("package not reinstalled since the console script was added (pip install -e .)")
    done = subprocess.run([exe, "compare", "zoo:mlp", "--topology", "dp=x"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "bad topology 'dp=x'" in done.stderr


BAD_FACTORIES = '''
def raises():
    raise RuntimeError("no weights here")

def needs(width, depth=2):
    return None
'''


@pytest.fixture
def bad_factories(tmp_path, monkeypatch):
    yield from _module_in_cwd(tmp_path, monkeypatch, "bad_models", BAD_FACTORIES)


def _one_line_error(capsys, argv, named):
    """``main(argv)`` exits 2 with one 'snn-explorer: error:' line naming ``named`` and no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("snn-explorer: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and named in err, err


@pytest.mark.parametrize("argv, named", [
    (["compare", "zoo:mlp", "--topology", "dp=2", "--batch-size", "0"], "--batch-size=0 must be a positive int"),
    (["compare", "zoo:mlp", "--topology", "dp=2", "--batch-size", "-4"], "--batch-size=-4"),
    (["compare", "zoo:mlp", "--topology", "dp=2,dp=4"], "dim 'dp' is given twice"),
    (["compare", "zoo:mlp", "--topology", "dp=70000"], "MAX_WORLD_SIZE=65536"),
    (["compare", "zoo:mlp", "--world-size", "100000000000"], "world size 100000000000"),
    (["compare", "zoo:mlp", "--topology", "dp=2", "--mode", "ddp"], "'ddp'"),
    (["compare", "zoo:mlp"], "--world-size --topology is required"),
    (["compare", "zoo:mlp", "--world-size", "two"], "'two'"),
    (["frobnicate", "zoo:mlp"], "'frobnicate'"),
    (["export", "zoo:mlp", "--topology", "dp=2", "--objective", "speed", "--train", "os:getcwd",
      "--steps", "-5", "--out", "job"], "--steps=-5 must be a positive int"),
])
def test_usage_errors_are_one_line_exit_2(capsys, argv, named):
    _one_line_error(capsys, argv, named)


@pytest.mark.parametrize("factory, named", [
    ("raises", "model factory 'bad_models:raises' raised RuntimeError: no weights here"),
    ("needs", "model factory 'bad_models:needs' needs the argument(s) ['width']"),
])
def test_a_factory_that_fails_is_one_line(capsys, bad_factories, factory, named):
    _one_line_error(capsys, ["analyze", f"{bad_factories}:{factory}"], named)


def test_export_to_an_unwritable_out_is_one_line(capsys, user_module, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    _one_line_error(capsys, ["export", f"{user_module}:make_net", "--topology", "dp=2", "--objective", "speed",
                             "--train", f"{user_module}:step", "--out", str(blocker / "job")],
                    f"cannot write the job to --out '{blocker / 'job'}'")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    _one_line_error(capsys, ["export", f"{user_module}:make_net", "--topology", "dp=2", "--objective", "speed",
                             "--train", f"{user_module}:step", "--out", str(shared)], "writable by other users")
    _one_line_error(capsys, ["export", f"{user_module}:make_net", "--topology", "dp=2", "--objective", "speed",
                             "--train", f"{user_module}:step", "--out", str(tmp_path / "j"), "--partition", "a\nb"],
                    "contains the control character")


def test_compare_shows_the_estimates_explorer_compare_shows(capsys, user_module):
    from snn_explorer.explorer import Explorer
    from snn_explorer.zoo import build

    assert main(["compare", "zoo:mlp", "--topology", "dp=2,tp=2", "--objective", "memory"]) == 0
    out = capsys.readouterr().out
    zoo = build("mlp")
    ex = Explorer.from_zoo(zoo)
    expected = ex.compare([ex.make_plan(objective="memory", topology={"dp": 2, "tp": 2})])
    from snn_explorer.explorer.compare import format_bytes

    for row in ("peak_bytes_max", "comm_bytes_per_step", "activations_bytes"):
        line = next(ln for ln in out.splitlines() if ln.startswith(row))
        assert line.split()[1:] == format_bytes(expected.loc[row].iloc[0]).split(), line
    line = next(ln for ln in out.splitlines() if ln.startswith("collectives_per_step"))
    assert line.split()[1] == str(int(expected.loc["collectives_per_step"].iloc[0]))
    # a plain module carries no example input: the plans alone, and how to get the estimates
    assert main(["compare", f"{user_module}:make_net", "--topology", "dp=2"]) == 0
    captured = capsys.readouterr()
    assert "peak_bytes_max" not in captured.out and "--input-shape" in captured.err
    assert main(["compare", f"{user_module}:make_net", "--topology", "dp=2", "--input-shape", "8,8,64"]) == 0
    assert "peak_bytes_max" in capsys.readouterr().out
    assert main(["compare", f"{user_module}:make_net", "--topology", "dp=2", "--input-shape", "8,x"]) == 2
    assert "bad --input-shape '8,x'" in capsys.readouterr().err
