"""Run a test body on N real ``gloo`` ranks, each in its own spawned process.

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
* The parent (the pytest process) hosts a ``torch.distributed.TCPStore`` bound
  to ``127.0.0.1:0``; the OS picks the port, so there is no "pick a free port,
  close it, hope nobody grabs it" race.  The store lives in the parent for the
  whole run, so it survives whichever rank finishes first (the same idea as
  torchrun's agent store).
* ``nprocs`` processes are started with the ``spawn`` start method.  Each child
  sets ``OMP_NUM_THREADS=1`` (before importing torch), ``RANK``,
  ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and whatever
  is in ``env``, calls ``torch.set_num_threads(1)``, connects to the store as a
  client and calls ``dist.init_process_group("gloo", store=..., rank=...,
  world_size=..., timeout=timedelta(seconds=timeout))``.  Note that
  ``MASTER_PORT`` points at a store that is *already served* by the harness:
  code under test that builds its own ``TCPStore`` there must connect with
  ``is_master=False``.
* ``fn``, ``args`` and ``kwargs`` are shipped with cloudpickle.  If ``fn``
  comes from a module under this ``tests/`` directory, that module is pickled
  *by value* (as are lambdas, closures and ``__main__`` functions anywhere),
  so the child does not need to import the test module.  Library code (``snn_explorer``, torch, ...) is
  pickled by reference and imported in the child (``sys.path`` is inherited).
* Each child sends back its cloudpickled return value (or the exception type,
  message and formatted traceback) over its own pipe, then
  ``dist.destroy_process_group()`` runs in a ``finally``.  (An error is sent
  *before* the teardown, and failures are listed by the time they happened, so
  the root cause comes before the peers' "Connection closed by peer" errors.)
  File names of by-value code are preserved, so remote tracebacks show source
  lines (cloudpickle 3 would otherwise rename them to ``<dynamic-code>``).
* Failure handling:

  - any rank raises -> :class:`RankFailure` with, per failed rank, the rank,
    exception type, message and full remote traceback.  The remaining ranks
    get ``FAILURE_GRACE_S`` seconds to report (often their own gloo error) and
    are then killed; nobody waits for ``timeout``.
  - a rank exits without reporting (``os._exit``, killed, segfault) ->
    :class:`RankFailure` with its exit code / signal.
  - not all ranks done after ``timeout`` seconds (measured from the start of
    the call, so process start-up counts) -> the Python stacks of the
    unfinished ranks are dumped (``faulthandler`` on ``SIGUSR1``), all ranks
    are killed and :class:`RankTimeout` names the unfinished ranks and shows
    their stacks.

  Every outcome ends with all children joined (killed if needed).  Children
  also watch their parent and ``os._exit`` if it disappears.

Child stdout/stderr go straight to the parent's file descriptors (pytest's
fd-level capture shows them for failing tests).  Both exception classes derive
from ``AssertionError`` so pytest reports them as plain test failures.
"""

from __future__ import annotations

import collections
import datetime
import functools
import io
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import types

import cloudpickle

__all__ = ["run_on_ranks", "on_ranks", "RankFailure", "RankTimeout", "RankError"]

#: seconds the other ranks get to report after the first rank failed/died
FAILURE_GRACE_S = 2.0
#: seconds a rank may take to exit after it has sent its result
EXIT_GRACE_S = 5.0
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


# --------------------------------------------------------------------------- child


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(70)


def _child_main(rank, world_size, conn, payload, timeout, store_port, env, stack_file, parent_pid):
    # Environment first: nothing has imported torch yet in this interpreter.
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store_port),
    )
    for key, value in (env or {}).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = str(value)

    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    if stack_file is not None:
        import faulthandler

        stack_fh = open(stack_file, "w")  # kept open for the process lifetime
        faulthandler.register(signal.SIGUSR1, file=stack_fh, all_threads=True)

    dist = None
    message = None
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        fn, args, kwargs = cloudpickle.loads(payload)
        td = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore(
            "127.0.0.1", store_port, world_size, is_master=False, timeout=td
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=td
        )
        result = fn(*args, **kwargs)
        message = ("ok", _dumps(result))
    except BaseException as exc:  # noqa: BLE001 - report everything, incl. SystemExit
        failed_at = time.time()  # orders failures: the root cause comes first
        etype = type(exc)
        name = etype.__qualname__
        if etype.__module__ not in ("builtins", "__main__"):
            name = f"{etype.__module__}.{name}"
        message = ("error", name, str(exc), traceback.format_exc(), failed_at)
        # Report before tearing down gloo: destroying our pairs makes the peers
        # fail too, and their secondary errors should not look like the cause.
        _send(conn, message)
        message = None
    finally:
        if message is not None:  # success path: result (or its pickling error)
            _send(conn, message)
        if dist is not None:
            try:
                if dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - teardown must not mask the result
                traceback.print_exc()
        conn.close()


def _send(conn, message) -> None:
    try:
        conn.send(message)
    except (BrokenPipeError, EOFError):
        pass  # parent is gone or gave up on us


# --------------------------------------------------------------------------- parent


def _should_pickle_module_by_value(module_name: str | None) -> object | None:
    module = sys.modules.get(module_name or "")
    if module is None or module_name == "__main__":
        return None  # cloudpickle already does it by value (or cannot import it)
    path = getattr(module, "__file__", None)
    if path and os.path.abspath(path).startswith(_TESTS_DIR + os.sep):
        return module
    return None


_cp_code_reduce = getattr(getattr(cloudpickle, "cloudpickle", None), "_code_reduce", None)


def _code_reduce_keeping_filename(code):
    """cloudpickle >= 3 replaces ``co_filename`` of by-value code with
    "<dynamic-code>", which strips file names and source lines from remote
    tracebacks.  Put the real file name back (falls back to cloudpickle's
    behaviour if its private reducer changes shape)."""
    rv = _cp_code_reduce(code)
    try:
        ctor, args = rv[0], rv[1]
        idx = next(i for i, a in enumerate(args) if isinstance(a, str) and a == "<dynamic-code>")
        args = args[:idx] + (code.co_filename,) + args[idx + 1:]
        return (ctor, args) + tuple(rv[2:])
    except Exception:  # noqa: BLE001
        return rv


class _Pickler(cloudpickle.Pickler):
    if _cp_code_reduce is not None:
        dispatch_table = collections.ChainMap(
            {types.CodeType: _code_reduce_keeping_filename}, cloudpickle.Pickler.dispatch_table
        )


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
    return buf.getvalue()


def _dumps_payload(fn, args, kwargs) -> bytes:
    module = _should_pickle_module_by_value(getattr(fn, "__module__", None))
    if module is not None:
        cloudpickle.register_pickle_by_value(module)
    try:
        return _dumps((fn, args, kwargs))
    finally:
        if module is not None:
            cloudpickle.unregister_pickle_by_value(module)


_PEER_ERROR_MARKERS = ("by peer", "remote worker", "Connection refused", "Broken pipe")


def _is_peer_error(text: str) -> bool:
    first_line = text.split("\n", 1)[0]
    return " raised " in first_line and any(m in first_line for m in _PEER_ERROR_MARKERS)


def _describe_exit(exitcode) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name} (exit code {exitcode})"
        except ValueError:
            return f"killed by signal {-exitcode} (exit code {exitcode})"
    return f"exit code {exitcode}"


def _kill_all(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 1.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5.0)


def run_on_ranks(fn, nprocs: int, *args, timeout: float = 60.0, env: dict | None = None, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` spawned gloo ranks.

    Returns the return values in rank order.  Raises :class:`RankFailure` if a
    rank raised or died, :class:`RankTimeout` if not all ranks finished within
    ``timeout`` seconds (which also becomes the gloo/store timeout).  ``env``
    entries are set in the children's environment (``None`` removes a key).
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    import torch.distributed as dist

    payload = _dumps_payload(fn, args, kwargs)
    ctx = multiprocessing.get_context("spawn")
    t0 = time.monotonic()
    deadline = t0 + timeout

    # Kept only inside a list that is cleared in ``finally``: a frame local would be
    # kept alive (server thread + listening socket) by a raised RankError's traceback.
    store_holder = [dist.TCPStore(
        "127.0.0.1", 0, nprocs, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
    )]
    store_port = store_holder[0].port
    can_dump = hasattr(signal, "SIGUSR1")
    tmpdir = tempfile.TemporaryDirectory(prefix="dist_harness_")
    procs, conns = [], []
    results: dict = {}
    failures: dict = {}  # rank -> (unix time of the failure, description)
    first_failure_at = None
    try:
        for rank in range(nprocs):
            parent_end, child_end = ctx.Pipe(duplex=False)
            stack_file = os.path.join(tmpdir.name, f"rank{rank}.stacks") if can_dump else None
            p = ctx.Process(
                target=_child_main,
                name=f"dist-harness-rank{rank}",
                args=(rank, nprocs, child_end, payload, timeout, store_port, env,
                      stack_file, os.getpid()),
            )
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)

        pending = set(range(nprocs))  # ranks without a result / failure yet
        conn_rank = {c: r for r, c in enumerate(conns)}
        sentinel_rank = {p.sentinel: r for r, p in enumerate(procs)}

        def handle_message(rank, conn) -> None:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                conn_rank.pop(conn, None)
                return
            except Exception as exc:  # noqa: BLE001 - message could not be unpickled
                msg = ("error", type(exc).__qualname__,
                       f"could not unpickle the message in the parent: {exc}",
                       traceback.format_exc(), time.time())
            if msg[0] == "ok":
                try:
                    results[rank] = cloudpickle.loads(msg[1])
                    pending.discard(rank)
                    return
                except Exception as exc:  # noqa: BLE001
                    msg = ("error", type(exc).__qualname__,
                           f"could not unpickle the result in the parent: {exc}",
                           traceback.format_exc(), time.time())
            _, etype, emsg, tb, failed_at = msg
            record_failure(rank, failed_at, (
                f"rank {rank} raised {etype}: {emsg}\n"
                f"Remote traceback (rank {rank}):\n{tb.rstrip()}"
            ))

        def record_failure(rank, failed_at, text) -> None:
            nonlocal first_failure_at
            failures[rank] = (failed_at, text)
            pending.discard(rank)
            if first_failure_at is None:
                first_failure_at = time.monotonic()

        while pending:
            now = time.monotonic()
            limit = deadline
            if first_failure_at is not None:
                limit = min(limit, first_failure_at + FAILURE_GRACE_S)
            if now >= limit:
                break
            waitables = list(conn_rank) + [s for s, r in sentinel_rank.items()]
            ready = multiprocessing.connection.wait(waitables, timeout=limit - now)
            # Messages first, so a rank that reported and then exited is not "dead".
            for obj in ready:
                if obj in conn_rank:
                    handle_message(conn_rank[obj], obj)
            for obj in ready:
                if obj in sentinel_rank:
                    rank = sentinel_rank.pop(obj)
                    conn = conns[rank]
                    while conn in conn_rank and conn.poll():
                        handle_message(rank, conn)
                    conn_rank.pop(conn, None)
                    if rank in pending:
                        procs[rank].join(1.0)
                        record_failure(rank, time.time(), (
                            f"rank {rank} exited without reporting a result: "
                            f"{_describe_exit(procs[rank].exitcode)}"
                        ))

        unfinished = sorted(pending)
        timed_out = bool(unfinished) and not failures
        stacks = {}
        if timed_out and can_dump:
            for r in unfinished:
                if procs[r].is_alive():
                    try:
                        os.kill(procs[r].pid, signal.SIGUSR1)
                    except OSError:
                        pass
            time.sleep(0.5)
            for r in unfinished:
                try:
                    with open(os.path.join(tmpdir.name, f"rank{r}.stacks")) as fh:
                        text = fh.read().strip()
                except OSError:
                    text = ""
                if len(text) > _MAX_STACK_CHARS:
                    text = "...\n" + text[-_MAX_STACK_CHARS:]
                stacks[r] = text
        if unfinished:
            _kill_all([procs[r] for r in unfinished])
        # Ranks that reported get a moment to exit cleanly, then are killed.
        exit_deadline = time.monotonic() + EXIT_GRACE_S
        for p in procs:
            p.join(max(0.0, exit_deadline - time.monotonic()))
        _kill_all(procs)

        elapsed = time.monotonic() - t0
        if timed_out:
            lines = [
                f"{len(unfinished)} of {nprocs} ranks did not finish within "
                f"timeout={timeout:g}s (elapsed {elapsed:.1f}s); unfinished ranks: "
                f"{unfinished}; finished ranks: {sorted(results)}. All ranks were killed."
            ]
            for r in unfinished:
                if stacks.get(r):
                    lines.append(f"--- Python stacks of rank {r} at the timeout:\n{stacks[r]}")
            failures = {r: f"rank {r} did not finish within {timeout:g}s" for r in unfinished}
            raise RankTimeout("\n".join(lines), failures, results, unfinished)
        if failures:
            # Root cause first: errors that merely report a vanished peer go last,
            # otherwise order by the time each rank failed (same host clock).
            failures = {r: text for r, (_, text) in
                        sorted(failures.items(),
                               key=lambda item: (_is_peer_error(item[1][1]), item[1][0]))}
            first = next(iter(failures))
            lines = [
                f"{len(failures)} of {nprocs} ranks failed (first: rank {first}); "
                f"elapsed {elapsed:.1f}s; succeeded ranks: {sorted(results)}"
            ]
            if unfinished:
                lines[0] += (f"; ranks {unfinished} were killed {FAILURE_GRACE_S:g}s "
                             f"after the first failure")
            for r, text in failures.items():
                lines.append(f"--- {text}")
            all_failures = dict(failures)
            for r in unfinished:
                all_failures[r] = f"rank {r} killed after rank {first} failed"
            raise RankFailure("\n".join(lines), all_failures, results)
        return [results[r] for r in range(nprocs)]
    finally:
        _kill_all(procs)
        for c in conns:
            c.close()
        tmpdir.cleanup()
        store_holder.clear()


def on_ranks(nprocs: int, *, timeout: float = 60.0, env: dict | None = None):
    """Decorator: the decorated (argument-less) test runs on ``nprocs`` ranks.

    The wrapper returns ``None`` (pytest warns about tests returning values);
    use :func:`run_on_ranks` directly to get the per-rank results.
    """

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper():
            run_on_ranks(fn, nprocs, timeout=timeout, env=env)

        del wrapper.__wrapped__  # pytest must see the wrapper's (empty) signature
        return wrapper

    return decorate
