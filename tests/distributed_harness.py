"""Run a test body on N real ``gloo`` ranks: a thin test-facing layer over ``snn_explorer.ranks``.

Usage::

    import torch
    import torch.distributed as dist
    from distributed_harness import run_on_ranks, on_ranks

    def test_all_reduce():
        def body(scale):
            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t)
            return t.item() * scale

        assert run_on_ranks(body, 2, 10.0) == [30.0, 30.0]

    @on_ranks(2, timeout=30)          # the test body itself runs on every rank
    def test_barrier():
        dist.barrier()

How it works
------------
* Runs reuse one warm :class:`snn_explorer.ranks.RankPool` per rank count in this test process
  (started on first use, closed at exit): start-up is paid once per worker, and each run is still
  a fresh launch's (fresh rank processes, process group, RNG state). ``fresh_launch=True``, or an
  ``env``, starts a launch of its own instead: for tests whose subject is the launch itself (its
  environment, faults, start-up, teardown, timeouts).
* The ranks are the package's own rank runner (:func:`snn_explorer.ranks.run`): an agent process
  runs torch elastic on loopback-only stores and forks the ranks from an interpreter that has
  already imported torch; each rank joins a gloo group with ``timeout`` as its timeout.
  ``OMP_NUM_THREADS=1``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
  ``MASTER_ADDR`` and ``MASTER_PORT`` are set (the last two point at elastic's store, already
  served: a ``TCPStore`` built there must connect with ``is_master=False``), then ``env``
  (``None`` removes a key).
* ``fn``, ``args`` and ``kwargs`` travel with cloudpickle. If ``fn`` comes from a module under
  this ``tests/`` directory, that module is pickled *by value* (as are lambdas, closures and
  ``__main__`` functions anywhere), so ranks need not import the test module. File names of
  by-value code are kept, so remote tracebacks show source lines.
* Failures:

  - a rank raises -> :class:`RankFailure` with, per failed rank, the exception type, message and
    full remote traceback, root cause first (errors that only report a vanished peer last); the
    other ranks are ended a few seconds later, nobody waits for ``timeout``.
  - a rank exits without a result (``os._exit``, ``sys.exit``, killed) -> :class:`RankFailure`
    with its exit code / signal.
  - not all ranks done ``timeout`` seconds after the call (start-up counts) -> the Python stacks
    of the unfinished ranks are dumped (``faulthandler`` on ``SIGUSR1``), every rank is ended and
    :class:`RankTimeout` names the unfinished ranks and shows their stacks.

  Every outcome ends with the whole process tree gone.

The ranks' stdout/stderr are captured and written to this process's stdout/stderr afterwards
(prefixed by rank), so pytest shows them for a failing test. Both exception classes derive from
``AssertionError`` so pytest reports them as plain test failures.
"""

from __future__ import annotations

import atexit
import functools
import os
import signal
import sys
import tempfile
import time

import cloudpickle

from snn_explorer.ranks import LaunchError, RankPool, run
from snn_explorer.ranks.errors import cause_order

__all__ = ["run_on_ranks", "on_ranks", "RankFailure", "RankTimeout", "RankError", "warm_pool", "warm_pool_pids"]

#: The warm pools of this test process, by rank count (gloo).
_POOLS: dict = {}
#: Where the pools' folders go: the temporary directory as this module found it (a test may point
#: TMPDIR at a folder of its own that must end empty).
_POOL_TMP = tempfile.gettempdir()

#: cap on the dumped stack text shown per rank in RankTimeout
_MAX_STACK_CHARS = 6000

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


class RankError(AssertionError):
    """Base class: something went wrong on one or more ranks.

    ``failures`` maps rank -> human-readable description, ``results`` maps
    rank -> return value for the ranks that did finish.
    """

    def __init__(self, message: str, failures: dict, results: dict):
        super().__init__(message)
        self.failures = failures
        self.results = results


class RankFailure(RankError):
    """At least one rank raised or exited without reporting a result."""


class RankTimeout(RankError):
    """Not all ranks finished within the timeout.  ``unfinished`` lists them."""

    def __init__(self, message: str, failures: dict, results: dict, unfinished: list):
        super().__init__(message, failures, results)
        self.unfinished = unfinished


def _by_value_module(fn):
    """The test module ``fn`` comes from, if it lives under tests/ (it then travels by value)."""
    name = getattr(fn, "__module__", None) or ""
    module = sys.modules.get(name)
    if module is None or name == "__main__":
        return None
    path = getattr(module, "__file__", None)
    return module if path and os.path.abspath(path).startswith(_TESTS_DIR + os.sep) else None


def _describe_exit(exitcode) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name} (exit code {exitcode})"
        except ValueError:
            return f"killed by signal {-exitcode} (exit code {exitcode})"
    return f"exit code {exitcode}"


def _echo(logs: dict) -> None:
    """The ranks' captured output, on this process's streams (pytest shows it for failing tests)."""
    for rank in sorted(logs):
        text = logs[rank]
        if text:
            sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.rstrip("\n").split("\n")))


def _timeout_error(err: LaunchError, nprocs: int, timeout: float, elapsed: float) -> RankTimeout:
    unfinished = sorted(err.unfinished)
    lines = [f"{len(unfinished)} of {nprocs} ranks did not finish within timeout={timeout:g}s "
             f"(elapsed {elapsed:.1f}s); unfinished ranks: {unfinished}; finished ranks: {sorted(err.results)}. "
             f"All ranks were killed."]
    for r in unfinished:
        stack = err.failures[r].traceback.strip() if r in err.failures else ""
        if len(stack) > _MAX_STACK_CHARS:
            stack = "...\n" + stack[-_MAX_STACK_CHARS:]
        if stack:
            lines.append(f"--- Python stacks of rank {r} at the timeout:\n{stack}")
    failures = {r: f"rank {r} did not finish within {timeout:g}s" for r in unfinished}
    return RankTimeout("\n".join(lines), failures, err.results, unfinished)


def _failure_error(err: LaunchError, nprocs: int, elapsed: float) -> RankFailure:
    ordered = cause_order(err.failures.values())
    first = ordered[0].rank if ordered else None
    failures = {}
    for f in ordered:
        if f.traceback:
            text = (f"rank {f.rank} raised {f.type}: {f.message}\n"
                    f"Remote traceback (rank {f.rank}):\n{f.traceback.rstrip()}")
        elif f.collateral or f.type == "NoResult":
            text = f"rank {f.rank} killed after rank {first} failed"
        else:
            text = f"rank {f.rank} exited without reporting a result: {_describe_exit(f.exitcode)}"
        failures[f.rank] = text
    lines = [f"{len(failures)} of {nprocs} ranks failed (first: rank {first}); elapsed {elapsed:.1f}s; "
             f"succeeded ranks: {sorted(err.results)}"]
    lines += [f"--- {text}" for text in failures.values()]
    if not failures:  # the agent itself failed
        lines.append(str(err))
    return RankFailure("\n".join(lines), failures, err.results)


def warm_pool(nprocs: int) -> RankPool:
    """This test process's warm gloo pool of ``nprocs`` ranks (made on first use, closed at exit)."""
    pool = _POOLS.get(nprocs)
    if pool is None or pool.closed:
        pool = _POOLS[nprocs] = RankPool(nprocs, "gloo", env={"OMP_NUM_THREADS": "1"}, tmp_dir=_POOL_TMP)
    return pool


def warm_pool_pids() -> set:
    """The processes of this test process's warm pools (not leftovers of a test)."""
    return {pid for pool in _POOLS.values() for pid in pool.pids()}


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()


def run_on_ranks(fn, nprocs: int, *args, timeout: float = 60.0, env: dict | None = None, fresh_launch: bool = False,
                 **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` gloo ranks.

    Returns the return values in rank order.  Raises :class:`RankFailure` if a
    rank raised or died, :class:`RankTimeout` if not all ranks finished within
    ``timeout`` seconds (which also becomes the gloo/store timeout).  ``env``
    entries are set in the ranks' environment (``None`` removes a key).  It runs
    on this process's warm pool of ``nprocs`` ranks unless ``fresh_launch`` or
    ``env`` is given (then a launch of its own starts the ranks).
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    pool = None if fresh_launch or env is not None else warm_pool(nprocs)
    module = _by_value_module(fn)
    if module is not None:
        cloudpickle.register_pickle_by_value(module)
    t0 = time.monotonic()
    try:
        result = run(fn, args, kwargs, nprocs=nprocs, backend="gloo", timeout=None, time_limit=timeout,
                     pg_timeout=timeout, env=None if pool else {"OMP_NUM_THREADS": "1", **(env or {})},
                     progress=False, pool=pool)
    except LaunchError as err:
        _echo(err.logs)
        elapsed = time.monotonic() - t0
        raise (_timeout_error(err, nprocs, timeout, elapsed) if err.timed_out
               else _failure_error(err, nprocs, elapsed)) from None
    finally:
        if module is not None:
            cloudpickle.unregister_pickle_by_value(module)
    _echo({r: result.log(r) for r in range(nprocs)})
    return result.values


def on_ranks(nprocs: int, *, timeout: float = 60.0, env: dict | None = None, fresh_launch: bool = False):
    """Decorator: the decorated (argument-less) test runs on ``nprocs`` ranks (``fresh_launch``,
    ``env``: see :func:`run_on_ranks`).

    The wrapper returns ``None`` (pytest warns about tests returning values);
    use :func:`run_on_ranks` directly to get the per-rank results.
    """

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper():
            run_on_ranks(fn, nprocs, timeout=timeout, env=env, fresh_launch=fresh_launch)

        del wrapper.__wrapped__  # pytest must see the wrapper's (empty) signature
        return wrapper

    return decorate
