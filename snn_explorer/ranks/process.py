"""The agent subprocess and the end of a run: every process it spawned ends with it.

The agent is a session leader, so its process group is the whole tree, and (on Linux) a child
subreaper, so a rank's orphaned descendants stay in its tree; :func:`kill_tree` also finds
descendants that started a session of their own and would escape ``killpg``.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Mapping, Optional

from . import channel

#: The directory that holds the ``snn_explorer`` package: on the agent's PYTHONPATH, so ``python -m`` finds it.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENT_MODULE = "snn_explorer.ranks.elastic_agent"
_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process adopt its orphaned descendants (Linux ``prctl``); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parents() -> Dict[int, int]:
    """pid -> parent pid of every process (from /proc; empty without it)."""
    out = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    out[int(name)] = int(fh.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    return out


def descendants(root: int) -> List[int]:
    """Every live descendant of ``root`` (any session), parents before children."""
    children: Dict[int, List[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def _signal(pids, sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_tree(root: int, extra=()) -> None:
    """SIGKILL every descendant of ``root`` and the pids in ``extra``: stopped first, until no new
    one appears, so none can fork away while the tree is being ended."""
    seen = set(extra)
    _signal(seen, signal.SIGSTOP)
    for _ in range(20):
        new = [p for p in descendants(root) if p not in seen]
        if not new:
            break
        _signal(new, signal.SIGSTOP)
        seen.update(new)
    _signal(seen, signal.SIGKILL)


def with_package_path(env: Mapping[str, str]) -> Dict[str, str]:
    """``env`` with this package's root first on ``PYTHONPATH`` (``python -m`` finds the agent with it)."""
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return env


class AgentProcess:
    """``python -m snn_explorer.ranks.elastic_agent RUN_DIR`` as a session leader, so its process group
    is the whole tree."""

    def __init__(self, run_dir: str, env: Mapping[str, str]):
        self._log = open(channel.path(run_dir, "agent.log"), "wb")
        env = with_package_path(env)
        self.popen = subprocess.Popen([sys.executable, "-m", AGENT_MODULE, run_dir], env=env, cwd=os.getcwd(),
                                      stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        self.pid = self.popen.pid

    def poll(self) -> Optional[int]:
        return self.popen.poll()

    def _signal_group(self, sig: int) -> bool:
        try:
            os.killpg(self.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def end(self, grace: float = 3.0) -> None:
        """SIGTERM the whole tree, SIGKILL what is left after ``grace`` seconds (descendants in
        other sessions too), reap the agent."""
        tree = descendants(self.pid)
        if grace > 0 and self.popen.poll() is None and self._signal_group(signal.SIGTERM):
            deadline = time.monotonic() + grace
            while self.popen.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        if self.popen.poll() is None:
            kill_tree(self.pid, [self.pid])
        else:  # the agent has ended its tree itself; pids seen before that may have escaped since
            _signal([p for p in tree if p in _parents()], signal.SIGKILL)
        self._signal_group(signal.SIGKILL)  # stragglers, even after a clean exit
        self.popen.wait()
        self._log.close()
