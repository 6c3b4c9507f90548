"""The private run directory shared by the launcher, its agent and the ranks (stdlib only).

Layout under one ``0700`` directory: ``payload.pkl`` (what to run), ``spec.json`` (how),
``events/<rank>.jsonl`` (heartbeats and progress reports), ``results/<rank>.pkl`` (return
values), ``errors/<rank>.json`` (a rank's exception), ``stacks/<rank>.txt`` (stack dumps on
timeout), ``status.json`` (the agent's outcome), ``logs/`` (elastic's per-rank stdout/stderr).
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, Iterator, List, Tuple

#: Environment variable naming the run directory inside the agent and the ranks.
DIR_ENV = "SNN_EXPLORER_LAUNCH_DIR"


def path(run_dir: str, *parts: str) -> str:
    return os.path.join(run_dir, *parts)


def make_layout(run_dir: str) -> None:
    for sub in ("events", "results", "errors", "stacks", "logs", "tmp"):
        os.mkdir(path(run_dir, sub), 0o700)


def write_atomic(target: str, data: bytes) -> None:
    """Write ``data`` so readers never see a partial file."""
    tmp = f"{target}.{os.getpid()}.part"
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, target)


def write_json(target: str, obj: Any) -> None:
    write_atomic(target, json.dumps(obj, default=repr).encode())


def read_json(target: str) -> Any:
    with open(target) as fh:
        return json.load(fh)


def emit(run_dir: str, rank: int, kind: str, **fields: Any) -> None:
    """Append one event (``start``, ``report``, ``end``, ``error``) to the rank's event file."""
    event = {"kind": kind, "rank": rank, "time": time.time(), **fields}
    line = json.dumps(event, default=repr) + "\n"
    fd = os.open(path(run_dir, "events", f"{rank}.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


class EventReader:
    """Reads new complete event lines from every rank's event file, incrementally."""

    def __init__(self, run_dir: str):
        self._dir = path(run_dir, "events")
        self._offsets: Dict[str, int] = {}

    def poll(self) -> Iterator[Dict[str, Any]]:
        try:
            names = sorted(os.listdir(self._dir))
        except FileNotFoundError:
            return
        for name in names:
            with open(os.path.join(self._dir, name), "rb") as fh:
                fh.seek(self._offsets.get(name, 0))
                data = fh.read()
            end = data.rfind(b"\n") + 1
            self._offsets[name] = self._offsets.get(name, 0) + end
            for line in data[:end].splitlines():
                yield json.loads(line)


def rank_files(run_dir: str, sub: str) -> List[Tuple[int, str]]:
    """``(rank, path)`` for every finished file in ``sub`` (``results``, ``errors``, ``stacks``)."""
    out = []
    for name in os.listdir(path(run_dir, sub)):
        stem, _, ext = name.partition(".")
        if stem.isdigit() and ext in ("pkl", "json", "txt"):
            out.append((int(stem), path(run_dir, sub, name)))
    return sorted(out)
