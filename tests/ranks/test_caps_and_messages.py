"""Caps and messages: a launch of more local ranks than the machine holds is refused at once naming
the cap; the launcher's agent killed by a signal is named as the cause; every CLI input error and
every error of the user's model is one line with exit status 2 (the traceback under --debug)."""
import os
import signal
import sys
import textwrap
import time

import pytest
from launch_helpers import live_children

import snn_explorer as se
from snn_explorer.cli import main
from snn_explorer.launcher import LaunchError
from snn_explorer.ranks.engine import MAX_RANKS_ENV, RANKS_PER_CORE


def test_a_billion_ranks_are_refused_in_well_under_a_second_naming_the_cap(monkeypatch):
    monkeypatch.delenv(MAX_RANKS_ENV, raising=False)
    cores = len(os.sched_getaffinity(0))
    started = time.perf_counter()
    with pytest.raises(ValueError, match=rf"nprocs=1000000000 .* the cap is {RANKS_PER_CORE * cores} "
                                         rf"\({RANKS_PER_CORE} gloo ranks per core x {cores} usable core"):
        se.launch(print, nprocs=10 ** 9, progress=False)
    assert time.perf_counter() - started < 0.5
    assert not live_children()  # nothing started (the warm pools of other tests aside)
    monkeypatch.setenv(MAX_RANKS_ENV, "3")
    with pytest.raises(ValueError, match=rf"nprocs=4 .* the cap is 3 \(\${MAX_RANKS_ENV}=3\)"):
        se.launch(print, nprocs=4, progress=False)


def _sleep_forever():
    time.sleep(600)


@pytest.mark.timeout(120)
def test_an_agent_killed_by_a_signal_is_named_as_the_cause():
    killed = []

    def kill_agent_once_running(snapshot):
        if not killed and all(s["pid"] for s in snapshot):
            agent = next(c for c in live_children() if "elastic_agent" in " ".join(c.cmdline()))  # not a pool's
            os.kill(agent.pid, signal.SIGKILL)
            killed.append(agent.pid)

    with pytest.raises(LaunchError) as info:
        se.launch(_sleep_forever, nprocs=2, progress=kill_agent_once_running, timeout=60)
    text = str(info.value).splitlines()[0]
    assert f"the launcher's agent process (pid {killed[0]}) was killed by SIGKILL while the ranks ran" in text
    assert all(f.collateral for f in info.value.failures.values())
    assert "KeyboardInterrupt" not in text


MODEL = textwrap.dedent("""
    from torch import nn

    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(x)[:, 5]

    def make():
        return Broken()
""")


@pytest.mark.parametrize("argv, expected", [
    (["fit", "zoo:mlp", "--world-size", "2", "--memory-budget", "inf"], "bad --memory-budget inf"),
    (["compare", "zoo:mlp", "--world-size", "2", "--memory-budget", "nan"], "bad --memory-budget nan"),
    (["compare", "zoo:mlp", "--world-size", "2", "--input-shape=100000,100000,64"],
     "bad --input-shape '100000,100000,64': the example input alone is"),
    (["export", "zoo:mlp", "--topology", "dp=2", "--objective", "speed", "--train", "x:y", "--out", "OUT",
      "--job-name", "a/b"], "job_name='a/b'"),
])
def test_cli_input_errors_are_one_line_with_exit_2(argv, expected, capsys, tmp_path):
    argv = [str(tmp_path / "job") if a == "OUT" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and expected in err and "Traceback" not in err


def test_a_models_error_is_one_line_and_its_traceback_comes_with_debug(capsys, tmp_path, monkeypatch):
    (tmp_path / "broken_model.py").write_text(MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    argv = ["compare", "broken_model:make", "--world-size", "2", "--input-shape", "3,2,4"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "IndexError" in err and "broken_model.py:10, forward" in err and "--debug" in err
    assert main(argv + ["--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "return self.fc(x)[:, 5]" in err
    assert err.strip().splitlines()[-1].startswith("snn-explorer: error: IndexError")
    sys.modules.pop("broken_model", None)
