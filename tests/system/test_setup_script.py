"""scripts/setup.sh run against a stand-in .venv/bin/python that records each call: the quickstart
path installs the notebook extra (JupyterLab) and spikingjelly without its dependency list."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the project's venv is 3.11
    tomllib = None

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORDER = '#!/bin/bash\nprintf "%s\\n" "$*" >> "$(dirname "$0")/calls.txt"\n'


def _pip_calls(tmp_path, *args) -> list:
    (tmp_path / "scripts").mkdir()
    shutil.copy(os.path.join(ROOT, "scripts", "setup.sh"), tmp_path / "scripts" / "setup.sh")
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path / "pyproject.toml")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(RECORDER)
    os.chmod(bin_dir / "python", 0o755)
    done = subprocess.run(["bash", "scripts/setup.sh", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return [line for line in (bin_dir / "calls.txt").read_text().splitlines() if line.startswith("-m pip install")]


def test_the_quickstart_setup_installs_jupyterlab_and_spikingjelly_without_replacing_torch(tmp_path):
    calls = _pip_calls(tmp_path)
    assert "-m pip install -q torch==2.13.0" in calls
    assert "-m pip install -q -e .[notebook]" in calls
    assert "-m pip install -q --no-deps spikingjelly==2.0.0" in calls
    assert calls.index("-m pip install -q torch==2.13.0") < calls.index("-m pip install -q -e .[notebook]")
    spikingjelly = [c for c in calls if "spikingjelly" in c]
    assert all("--no-deps" in c for c in spikingjelly), spikingjelly
    assert "-m pip install -q loguru tqdm h5py" in calls


@pytest.mark.skipif(tomllib is None, reason="tomllib needs Python 3.11")
def test_the_notebook_extra_holds_jupyterlab():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        extras = tomllib.load(fh)["project"]["optional-dependencies"]
    assert any(req.startswith("jupyterlab") for req in extras["notebook"])
    assert any(req.startswith("voila") for req in extras["notebook"])  # a notebook as a dashboard for a class
    assert not any("spikingjelly" in req for group in extras.values() for req in group)
