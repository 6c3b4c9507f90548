"""The test tiers (tests/tiers.py): markers from the folder, the guard on rank starts in tests/unit, the stop
for a test file left in tests/ itself. The end-to-end checks run pytest on a small tree with this conftest."""
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tiers import RankStartInUnitTier, starts_ranks, tier_of

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


def test_commands_that_start_ranks_are_told_from_those_that_do_not(tmp_path):
    job = tmp_path / "command.sh"
    job.write_text("#!/usr/bin/env bash\nset -e\ntorchrun --nnodes 1 --nproc-per-node 2 run.py\n")
    plain = tmp_path / "plain.sh"
    plain.write_text("#!/usr/bin/env bash\necho torchrun-free\n")
    (tmp_path / "run.py").write_text("from snn_explorer.launcher import launch\nlaunch(print, 1, nprocs=2)\n")
    (tmp_path / "other.py").write_text("import torch\nprint(torch.ones(2))\n")
    agent = [sys.executable, "-m", "snn_explorer.ranks.elastic_agent", "/tmp/run-dir"]
    assert "snn_explorer.ranks.elastic_agent" in starts_ranks(agent)
    assert starts_ranks(["/usr/bin/torchrun", "--nproc-per-node", "2", "x.py"])
    assert starts_ranks([sys.executable, "-m", "torch.distributed.run", "x.py"])
    assert str(job) in starts_ranks(["bash", str(job)])
    assert starts_ranks([sys.executable, "run.py"], cwd=tmp_path)  # relative to the command's cwd
    assert starts_ranks("torchrun --standalone x.py".split())
    # nothing that starts ranks: another module, a script without a launcher, code that only names one
    assert starts_ranks([sys.executable, "-m", "pytest", "-q"]) == ""
    assert starts_ranks(["bash", str(plain)]) == ""
    assert starts_ranks([sys.executable, "-c", "import snn_explorer.ranks"]) == ""
    assert starts_ranks([sys.executable, "run.py"]) == ""  # no run.py where this command runs
    assert starts_ranks([sys.executable, "other.py"], cwd=tmp_path) == ""


def test_the_tier_is_the_folder_under_tests():
    assert tier_of(TESTS / "unit" / "test_x.py") == "unit"
    assert tier_of(TESTS / "ranks" / "sub" / "test_x.py") == "ranks"
    assert tier_of(TESTS / "system" / "test_x.py") == "system"
    assert tier_of(TESTS / "sweeps" / "test_x.py") == "sweeps"
    assert tier_of(TESTS / "test_x.py") is None
    assert tier_of(TESTS / "unit") is None  # the folder itself is no test file in it
    assert tier_of(ROOT / "notebooks" / "01_quickstart.ipynb") is None


def _tree(tmp_path: Path, files: dict) -> Path:
    """A copy of tests/conftest.py and tests/tiers.py under tmp_path/tests with the given test files."""
    tests = tmp_path / "tests"
    tests.mkdir()
    for helper in ("conftest.py", "tiers.py"):
        shutil.copy(TESTS / helper, tests / helper)
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    for name, text in files.items():
        (tests / name).parent.mkdir(parents=True, exist_ok=True)
        (tests / name).write_text(textwrap.dedent(text))
    return tmp_path


def _pytest(root: Path, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "pytest", "-rA", *args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=240)


_STARTS_RANKS = """
    from snn_explorer.ranks import LaunchError, run
    from tiers import TIERS as TIER_NAMES

    def one():
        return 1

    def test_starts_ranks():
        run(one, nprocs=2, backend="gloo", timeout=60)

    def test_starts_ranks_and_swallows_the_error():
        try:
            run(one, nprocs=2, backend="gloo", timeout=60)
        except (Exception, LaunchError):
            pass

    def test_in_one_process(request):
        assert [m.name for m in request.node.iter_markers() if m.name in TIER_NAMES] == ["unit"]
"""


def test_a_unit_test_that_starts_ranks_fails_at_once_naming_itself_and_its_tier(tmp_path):
    root = _tree(tmp_path, {
        "unit/test_starter.py": _STARTS_RANKS,
        "sweeps/test_sweep.py": """
            from tiers import TIERS

            from snn_explorer.ranks import run

            def test_sweep_starts_ranks():
                run(print, nprocs=2, backend="gloo", timeout=60)

            def test_sweep_marked(request):
                assert [m.name for m in request.node.iter_markers() if m.name in TIERS] == ["sweeps"]
        """,
        "ranks/test_marked.py": """
            from tiers import TIERS

            def test_marked(request):
                assert [m.name for m in request.node.iter_markers() if m.name in TIERS] == ["ranks"]
        """,
        "system/test_marked_system.py": """
            def test_marked_system(request):
                assert request.node.get_closest_marker("system") is not None
        """,
    })
    done = _pytest(root, "tests/unit", "tests/sweeps", "tests/ranks", "tests/system")
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    for name in ("test_starts_ranks", "test_starts_ranks_and_swallows_the_error"):
        assert f"FAILED tests/unit/test_starter.py::{name}" in out, out
        assert f"tests/unit/test_starter.py::{name} starts ranks" in out, out
    assert "FAILED tests/sweeps/test_sweep.py::test_sweep_starts_ranks" in out, out
    assert "move it to tests/ranks" in out and "snn_explorer.ranks.elastic_agent" in out, out
    for name in ("unit/test_starter.py::test_in_one_process", "ranks/test_marked.py::test_marked",
                 "system/test_marked_system.py::test_marked_system", "sweeps/test_sweep.py::test_sweep_marked"):
        assert f"PASSED tests/{name}" in out, out
    assert "3 failed, 4 passed" in out, out  # the passing ones checked their markers: each its folder's


def test_a_test_file_in_tests_itself_stops_the_run_and_is_named(tmp_path):
    root = _tree(tmp_path, {"unit/test_fine.py": "def test_fine():\n    pass\n",
                            "test_new.py": "def test_new():\n    pass\n"})
    done = _pytest(root, "tests/unit")
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "test files in tests/ itself have no tier: test_new.py" in out, out
    assert "tests/unit (one process, no ranks), tests/sweeps (the same, minutes per test), tests/ranks" in out, out


def test_the_guard_error_passes_except_exception():
    assert not issubclass(RankStartInUnitTier, Exception)
    with pytest.raises(RankStartInUnitTier):
        try:
            raise RankStartInUnitTier("x")
        except Exception:
            pass
