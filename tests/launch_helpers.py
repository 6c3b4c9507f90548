"""Shared fixtures for the launcher tests: an isolated temp dir and a leak check."""
from __future__ import annotations

import os
import tempfile

import psutil
import pytest


@pytest.fixture
def clean_launch(tmp_path, monkeypatch):
    """Route temp files to a private dir; after the test, no child process and no temp file remain."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    yield tmp
    children = live_children()
    assert not children, f"child processes left behind: {children}"
    assert not os.listdir(tmp), f"temporary files left behind: {os.listdir(tmp)}"


def is_reused_helper(proc: psutil.Process) -> bool:
    """multiprocessing's resource tracker: started once by whatever used spawn in this process
    (another test, say) and reused for its lifetime. Not a leak; a zombie is gone too."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE or "resource_tracker" in " ".join(proc.cmdline())
    except psutil.NoSuchProcess:
        return True


def live_children() -> list:
    """This process's descendants, less the reused resource tracker, zombies and the warm rank
    pools the harness keeps for the whole test process."""
    from distributed_harness import warm_pool_pids

    pools = warm_pool_pids()
    return [c for c in psutil.Process().children(recursive=True) if not is_reused_helper(c) and c.pid not in pools]


def gone(pid: int) -> bool:
    """True if ``pid`` has exited (a zombie counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
