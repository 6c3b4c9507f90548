"""Leave the caller's process as it was found: its RNG, its environment, its temporary directory,
its number of threads.

Running a model to measure it draws random numbers (dropout) and can import ``torch._dynamo``,
which sets ``TORCHINDUCTOR_CACHE_DIR`` in ``os.environ`` and creates ``torchinductor_<user>`` in the
temporary directory. :func:`as_found` undoes all three; the ranks ``measure`` starts run with a
temporary directory of their own (``snn_explorer.ranks`` sets ``TMPDIR`` to its run directory).

:func:`one_thread` runs the estimator's own model runs on one intra-op thread, as each rank runs:
they are small (a few samples and time steps), and on a busy machine torch's threads wait for each
other at every operator (benchmarks/results/calibration.md has the figures), which made a first estimate many
times slower. Sizes, operator counts and so every
number of an estimate do not depend on it.

:func:`collected` runs timed steps after a garbage collection and with the collector paused
(:func:`~snn_explorer.core.common.young_objects.collector_paused` only pauses it, as ``timeit`` does), so that a collection of what earlier work left behind (a 0.2 s pause, seen in
the one timed step it fell in after four plans measured on the same ranks) is not timed as a step.
"""
from __future__ import annotations

import contextlib
import gc
import getpass
import os
import re
import tempfile
from typing import Iterator

import torch

from ...core.common import collector_paused

#: Variables torch sets in ``os.environ`` as a side effect of importing its compiler stack.
TORCH_SET_ENV = ("TORCHINDUCTOR_CACHE_DIR",)


def _default_cache_dir() -> str:
    """Where torch puts its compiler cache when ``TORCHINDUCTOR_CACHE_DIR`` is unset."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError, ImportError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def _remove_empty_tree(path: str) -> None:
    """Remove ``path`` if it holds nothing but empty directories (never a file)."""
    if not os.path.isdir(path) or os.path.islink(path):
        return
    for root, dirs, files in os.walk(path, topdown=False):
        if files:
            return
        for d in dirs:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(root, d))
    with contextlib.suppress(OSError):
        os.rmdir(path)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the body with ``torch.set_num_threads(1)``, then restore the caller's thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def collected() -> Iterator[None]:
    """Collect garbage, then run the body with the garbage collector paused (restored after)."""
    gc.collect()
    with collector_paused():
        yield


@contextlib.contextmanager
def as_found() -> Iterator[None]:
    """Run the body, then restore the CPU RNG, the variables torch sets and the temporary directory."""
    env = {key: os.environ.get(key) for key in TORCH_SET_ENV}
    cache = _default_cache_dir()
    cache_existed = os.path.exists(cache)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if not cache_existed:
            _remove_empty_tree(cache)

