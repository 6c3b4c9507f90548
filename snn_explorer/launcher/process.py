"""The agent subprocess: started in its own session, ended together with everything it spawned."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Mapping, Optional

from . import channel

AGENT_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agent.py")


class AgentProcess:
    """``python agent.py RUN_DIR`` as a session leader, so its process group is the whole tree."""

    def __init__(self, run_dir: str, env: Mapping[str, str]):
        self._log = open(channel.path(run_dir, "agent.log"), "wb")
        self.popen = subprocess.Popen([sys.executable, AGENT_SCRIPT, run_dir], env=dict(env), cwd=os.getcwd(),
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
        """SIGTERM the whole tree, SIGKILL what is left after ``grace`` seconds, reap the agent."""
        if grace > 0 and self.popen.poll() is None and self._signal_group(signal.SIGTERM):
            deadline = time.monotonic() + grace
            while self.popen.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        self._signal_group(signal.SIGKILL)  # stragglers, even after a clean exit
        self.popen.wait()
        self._log.close()
