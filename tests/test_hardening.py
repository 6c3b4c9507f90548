"""Issue 19 hardening: exported jobs others cannot subvert, inputs refused early, scale, side effects."""
from __future__ import annotations

import os
import pickle
import stat
import subprocess

import pytest

from snn_explorer import analyze, plan
from snn_explorer.launcher import export_job
from snn_explorer.launcher.job import main as job_main
from snn_explorer.zoo import build


@pytest.fixture(scope="module")
def mlp():
    zoo = build("mlp")
    p = plan(analysis=analyze(zoo.model), objective="speed", topology={"dp": 2}, backend="torch", batch_size=8)
    return zoo, p


def step(runtime, step, batch, state):
    return 0.0


def _export(mlp, path, **kw):
    zoo, p = mlp
    return export_job(p, step, path, model=zoo.model, **kw)


# ---- export_job: the job directory and its files ---------------------------------------------------


def test_export_files_are_private(mlp, tmp_path):
    job = _export(mlp, tmp_path / "job")
    modes = {name: stat.S_IMODE(os.stat(os.path.join(job.path, name)).st_mode) for name in os.listdir(job.path)}
    assert modes == {"plan.json": 0o600, "payload.pkl": 0o600, "run.py": 0o700, "command.sh": 0o700,
                     "job.sbatch": 0o700}
    assert stat.S_IMODE(os.stat(job.path).st_mode) & 0o077 == 0  # a fresh directory: the owner's only


def test_export_refuses_a_directory_others_can_write(mlp, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(PermissionError, match=r"job directory .*shared.* writable by other users \(mode drwxrwxrwx\)"):
        _export(mlp, shared)
    assert os.listdir(shared) == []  # nothing written


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory that belongs to another user")
def test_export_refuses_a_directory_of_another_user(mlp, tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(PermissionError, match=r"belongs to .*not to the running user"):
        _export(mlp, theirs)


def test_export_replaces_a_planted_symlink_instead_of_writing_through_it(mlp, tmp_path):
    job_dir, victim = tmp_path / "job", tmp_path / "victim.txt"
    job_dir.mkdir(mode=0o700)
    victim.write_text("precious")
    for name in ("plan.json", "payload.pkl", "command.sh"):
        os.symlink(victim, job_dir / name)
    job = _export(mlp, job_dir)
    assert victim.read_text() == "precious"
    for name in ("plan.json", "payload.pkl", "command.sh"):
        assert not os.path.islink(job_dir / name) and os.path.getsize(job_dir / name) > 0
    assert job.plan_file == str(job_dir / "plan.json")


def test_export_refuses_a_symlinked_job_directory(mlp, tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    os.symlink(real, tmp_path / "link")
    with pytest.raises(PermissionError, match="is a symlink"):
        _export(mlp, tmp_path / "link")


class _Trap:
    """Unpickling it creates a marker file: proof that a payload was (not) loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("how", ["writable-payload", "writable-dir", "symlink"])
def test_job_refuses_a_payload_others_could_have_written(mlp, tmp_path, how):
    job = _export(mlp, tmp_path / "job")
    marker = tmp_path / "unpickled"
    bad = os.path.join(job.path, "bad.pkl")
    with open(bad, "wb") as fh:
        fh.write(pickle.dumps(_Trap(marker)))
    os.chmod(bad, 0o600)
    payload = bad
    if how == "writable-payload":
        os.chmod(bad, 0o666)
        pattern = r"payload .*bad\.pkl.* is writable by other users"
    elif how == "writable-dir":
        os.chmod(job.path, 0o777)
        pattern = r"the directory of (plan file|payload) .* writable by other users"
    else:
        payload = os.path.join(job.path, "link.pkl")
        os.symlink(bad, payload)
        pattern = r"payload .*link\.pkl.* is a symlink"
    with pytest.raises(PermissionError, match=pattern):
        job_main(job.script, ["--payload", payload])
    assert not marker.exists()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a file to another user")
def test_job_refuses_a_payload_of_another_user(mlp, tmp_path):
    job = _export(mlp, tmp_path / "job")
    os.chown(job.payload_file, 65534, 65534)
    with pytest.raises(PermissionError, match=r"payload .* belongs to .*not to the running user"):
        job_main(job.script, [])


# ---- export_job: values written into shell scripts -----------------------------------------------------


@pytest.mark.parametrize("field", ["partition", "job_name", "time_limit"])
@pytest.mark.parametrize("value", ["gpu\ntouch /tmp/pwned", "gpu\r", "a\x00b", "x\x1b[2J"])
def test_control_characters_in_script_values_are_refused(mlp, tmp_path, field, value):
    with pytest.raises(ValueError, match=rf"{field}=.* contains the control character"):
        _export(mlp, tmp_path / "job", **{field: value})
    assert not (tmp_path / "job").exists() or os.listdir(tmp_path / "job") == []


@pytest.mark.parametrize("kwargs, match", [
    ({"steps": -5}, r"steps=-5 must be a positive int"), ({"steps": 0}, r"steps=0"),
    ({"port": 0}, r"port=0 must be an int in 1\.\.65535"), ({"port": "29500; rm"}, r"port='29500; rm'"),
    ({"nnodes": True}, r"nnodes=True"), ({"gpus_per_node": -1}, r"gpus_per_node=-1"),
    ({"job_name": ""}, r"job_name='' must be a non-empty string"),
])
def test_bad_export_values_are_refused(mlp, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _export(mlp, tmp_path / "job", **kwargs)


def test_script_values_reach_torchrun_as_one_literal_word(mlp, tmp_path):
    """command.sh runs under bash with a stand-in torchrun: the job name arrives verbatim, unexpanded."""
    name = "run $(touch pwned) `touch pwned2` ; touch pwned3 'q'"
    job = _export(mlp, tmp_path / "job", job_name=name, partition="gpu; touch pwned4")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$ARGV_FILE"\n')
    os.chmod(bin_dir / "torchrun", 0o755)
    argv_file = tmp_path / "argv"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MASTER_ADDR": "10.0.0.1",
           "ARGV_FILE": str(argv_file)}
    done = subprocess.run(["bash", job.command_file], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    argv = argv_file.read_text().splitlines()
    assert argv[argv.index("--rdzv-id") + 1] == name
    assert argv[argv.index("--rdzv-endpoint") + 1] == "10.0.0.1:29500"
    assert not any(p.name.startswith("pwned") for p in list(tmp_path.iterdir()) + list((tmp_path / "job").iterdir()))
    sbatch = open(job.sbatch_file).read()
    assert "#SBATCH --partition='gpu; touch pwned4'" in sbatch
    assert "#SBATCH --job-name='run $(touch pwned)" in sbatch
    assert subprocess.run(["bash", "-n", job.sbatch_file], timeout=30).returncode == 0
