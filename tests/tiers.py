"""The test tiers: a test's tier is the folder it sits in, and its marker follows from it.

    tests/unit/    marker unit    one process, no ranks (what plain `pytest` runs: testpaths in pyproject.toml)
    tests/sweeps/  marker sweeps  one process, no ranks: the same checks over many plans or models (minutes each)
    tests/ranks/   marker ranks   starts real gloo ranks, or launches (torchrun, an exported job's script)
    tests/system/  marker system  the README, notebooks, browser, fresh clone, set-up script, torch-next

tests/conftest.py uses the hooks below. A test file in tests/ itself has no tier: the run stops and names it.
In tests/unit and tests/sweeps, a test that starts ranks (a subprocess that runs snn_explorer.ranks' agent, torchrun,
or a script that does) fails at once with :class:`RankStartInUnitTier`, naming itself and where it belongs.
"""
import os
import subprocess

import pytest

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
TIERS = ("unit", "sweeps", "ranks", "system")
#: the tiers whose tests run in one process and must start no ranks
IN_PROCESS = ("unit", "sweeps")
#: `python -m` modules and programs that start ranks: the rank runner's agent (and anything else under
#: snn_explorer.ranks run as a program), torch's launchers
_RANK_MODULES = ("snn_explorer.ranks", "torch.distributed.run", "torch.distributed.launch")
_RANK_PROGRAMS = ("torchrun",)
_GUARD = {"test": None, "started": []}


class RankStartInUnitTier(BaseException):
    """Raised where a test in tests/unit or tests/sweeps starts ranks. A BaseException, so that no ``except
    Exception`` (a launcher's own error handling, ``pytest.raises(Exception)``) can swallow it."""


def tier_of(path) -> str:
    """The tier of a test file: the folder under tests/ it sits in; None for any other place."""
    rel = os.path.relpath(os.path.abspath(str(path)), _TESTS_DIR)
    top = rel.split(os.sep)[0]
    return top if top in TIERS and os.sep in rel else None


def _script_text(arg: str, cwd) -> str:
    """The start of a script file a command runs (``bash command.sh``, ``python run.py``), '' for anything else."""
    path = os.path.join(os.fsdecode(cwd or os.getcwd()), arg)
    if not arg.endswith((".sh", ".py", ".sbatch")) or not os.path.isfile(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read(65536)


def starts_ranks(args, cwd=None) -> str:
    """What in a subprocess command starts ranks: ``-m`` one of _RANK_MODULES, one of _RANK_PROGRAMS, or a
    script (.sh, .py, .sbatch) that names either or the launcher (snn_explorer.launcher: launch, launch_plan,
    an exported job's run.py); '' where nothing does. Code given with ``-c`` is not read."""
    argv = [os.fsdecode(a) if isinstance(a, (bytes, os.PathLike)) else str(a)
            for a in ([args] if isinstance(args, (str, bytes, os.PathLike)) else args)]
    shown = " ".join(argv)[:200]
    for flag, arg in zip(["", *argv], argv):
        if flag == "-m" and arg.startswith(_RANK_MODULES) or os.path.basename(arg) in _RANK_PROGRAMS:
            return f"the command {shown!r}"
        text = "" if flag == "-c" else _script_text(arg, cwd)
        if any(m in text for m in (*_RANK_MODULES, "snn_explorer.launcher")) or \
                any(p in text.split() for p in _RANK_PROGRAMS):
            return f"the script {arg} the command {shown!r} runs"
    return ""


_POPEN_INIT = subprocess.Popen.__init__


def _guarded_popen_init(self, args, *more, **kwargs):
    test = _GUARD["test"]
    if test is not None:
        what = starts_ranks(args, kwargs.get("cwd"))
        if what:
            message = (f"{test} starts ranks ({what}), but tests in tests/unit and tests/sweeps run in one process: "
                       f"move it to tests/ranks, or check the shapes / shardings / collectives it needs on the fake process "
                       f"group (snn_explorer.compat_fake.fake_process_group) instead")
            _GUARD["started"].append(message)
            raise RankStartInUnitTier(message)
    _POPEN_INIT(self, args, *more, **kwargs)


subprocess.Popen.__init__ = _guarded_popen_init


def pytest_configure(config):
    misplaced = sorted(name for name in os.listdir(_TESTS_DIR) if name.startswith("test_") and name.endswith(".py"))
    if misplaced:
        raise pytest.UsageError(
            f"test files in tests/ itself have no tier: {', '.join(misplaced)}; move each with git mv to "
            f"tests/unit (one process, no ranks), tests/sweeps (the same, minutes per test), tests/ranks (starts "
            f"gloo ranks or launches: distributed_harness, launch, launch_plan, measure, torchrun) or tests/system (the README, notebooks, "
            f"browser, fresh clone, set-up script, torch-next)")


#: The rank tier's longest files (setup and calls together), longest first, as measured on 3 xdist workers
#: (benchmarks/results/test_tiers.md). They run first, so that under ``--dist loadfile`` no worker starts a
#: long file while the others run out of work (longest-processing-time-first scheduling); the rest keep their order.
LONGEST_FIRST = ("test_estimate_accuracy.py", "test_launch_multinode.py", "test_spike_compression_ranks.py",
                 "test_launch_hardening.py", "test_launch_faults.py", "test_rank_pool.py", "test_teardown.py",
                 "test_pipeline.py", "test_checkpoint.py", "test_precision_estimate.py", "test_memory_levers_ranks.py",
                 "test_closure_ranks.py", "test_families.py", "test_checkpoint_resume.py",
                 "test_op_checkpointing_ranks.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = tier_of(item.path)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)) if tier_of(item.path) == "ranks" else len(first))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Arms the guard for the setup, call and teardown of an in-process test (module fixtures start in its setup)."""
    _GUARD.update(test=item.nodeid if tier_of(item.path) in IN_PROCESS else None, started=[])
    try:
        yield
    finally:
        _GUARD["test"] = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """An in-process test that started ranks fails, even where the code under test caught the guard's error."""
    outcome = yield
    report = outcome.get_result()
    if _GUARD["started"]:
        report.outcome = "failed"
        report.longrepr = _GUARD["started"][0]
        _GUARD["started"] = []
