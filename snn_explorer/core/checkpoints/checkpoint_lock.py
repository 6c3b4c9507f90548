"""One writer per checkpoint folder: a lock file naming its holder (pid, host, start time, run id).

A run that saves into a folder takes its lock first; a second run into the same folder is
refused at its start, naming the holder (two writers would rename each other's ``.partial``
directories away mid-save). A lock left by a process that is gone (same host, pid not running)
or by an earlier attempt of the same run (a torchrun restart: the same run id) is taken over,
and :attr:`FolderLock.took_over` says whose it was. A holder on another host cannot be checked
from here: it is refused, naming the file to delete once that run is known to be gone.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Optional

from .checkpoint_integrity import CheckpointError

LOCK_NAME = ".snn-explorer.lock"


class CheckpointDirBusy(CheckpointError):
    """Another live run holds the checkpoint folder's lock."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {holder.get('pid')} on {holder.get('host')} (started {when}, run {holder.get('run')!r})"


class FolderLock:
    """The lock of checkpoint folder ``directory`` for run ``run_id``; :meth:`acquire`, :meth:`release`."""

    def __init__(self, directory, run_id: Optional[str] = None):
        self.file = Path(directory) / LOCK_NAME
        self.me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "run": run_id}
        self.took_over: Optional[str] = None
        self.held = False

    def _read(self) -> Optional[dict]:
        try:
            holder = json.loads(self.file.read_text())
            return holder if isinstance(holder, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable: a write cut short; its pid is unknown

    def _stale(self, holder: dict) -> bool:
        if self.me["run"] is not None and holder.get("run") == self.me["run"]:
            return True  # an earlier attempt of this run (torchrun restarted it)
        pid = holder.get("pid")
        if holder.get("host") != self.me["host"] or not isinstance(pid, int) or isinstance(pid, bool):
            return False
        return not _alive(pid)

    def _create(self) -> bool:
        try:
            fd = os.open(self.file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as fh:
            json.dump(self.me, fh)
        return True

    def acquire(self) -> "FolderLock":
        """Take the lock, or raise :class:`CheckpointDirBusy` naming the live holder."""
        self.file.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            if self._create():
                self.held = True
                return self
            holder = self._read()
            if holder is None:
                continue  # released between the two calls
            if not self._stale(holder):
                raise CheckpointDirBusy(
                    f"checkpoint folder {self.file.parent} is in use by {_describe(holder)}: one run writes a folder "
                    f"at a time. Wait for it, or use another checkpoint_dir (if that run is gone, delete {self.file})")
            taken = self.file.with_name(f"{LOCK_NAME}.stale-{os.getpid()}")
            try:
                os.rename(self.file, taken)  # one taker wins the rename; the others retry
            except FileNotFoundError:
                continue
            os.unlink(taken)
            self.took_over = _describe(holder)
        raise CheckpointDirBusy(f"could not take the lock {self.file}: other runs keep taking it")

    def release(self) -> None:
        """Remove the lock file if it is still this run's."""
        if self.held and (self._read() or {}).get("pid") == self.me["pid"]:
            try:
                self.file.unlink()
            except FileNotFoundError:
                pass
        self.held = False

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
