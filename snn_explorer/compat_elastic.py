"""The private torch elastic and cloudpickle names the rank runner relies on, and the one patch it makes.

Checked at import like :mod:`.compat`: a release that moved or changed one raises
:class:`~snn_explorer.compat.TorchCompatError` naming it. ``ranks/`` uses these instead of reaching
into torch elastic itself.
"""
from __future__ import annotations

from typing import Any, Callable

from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

from .compat import TorchCompatError, _require


def _code_reduce_shape(reduce: Any) -> Any:
    """cloudpickle's code reducer must still return ``(constructor, args)`` that rebuild the code."""
    code = _code_reduce_shape.__code__
    try:
        ctor, args = reduce(code)
        ok = isinstance(ctor(*args), type(code))
    except Exception:  # noqa: BLE001 - any failure means the shape changed
        ok = False
    if not ok:
        import cloudpickle  # lazy: compat is imported by everything; only pickling a code object needs it

        raise TorchCompatError(f"snn_explorer needs cloudpickle.cloudpickle._code_reduce(code) -> (constructor, args), "
                               f"but cloudpickle {cloudpickle.__version__} changed it")
    return reduce


#: torch elastic's per-poll look at its worker processes (``self._pc.processes``); the rank runner
#: wraps it to learn every worker's exit code as soon as it exits (elastic reports one failure only).
ELASTIC_POLL = _require("torch.distributed.elastic.multiprocessing.api", "MultiprocessContext._poll", params=("self",))
#: The rendezvous handler's factory of the store it shares with the workers (MASTER_ADDR/PORT); the
#: rank runner replaces it on its handler with one that listens on 127.0.0.1 only.
ELASTIC_STORE_SERVER = _require("torch.distributed.elastic.rendezvous.dynamic_rendezvous",
                                "DynamicRendezvousHandler._create_tcp_store_server",
                                params=("master_addr", "master_port"))
#: cloudpickle's reducer of code objects; the payload pickler wraps it to keep real file names.
CODE_REDUCE = _code_reduce_shape(_require("cloudpickle.cloudpickle", "_code_reduce", params=("obj",)))


def record_every_poll(record: Callable[[list], None]) -> None:
    """Wrap elastic's per-poll look at its workers (:data:`ELASTIC_POLL`, patched on
    ``MultiprocessContext``) so that ``record(processes)`` runs before and after each poll, and inside
    the poll just before elastic ends a worker: elastic reports one failure only, and ends the other
    workers inside the poll that sees it (``ProcessContext.join`` calls each live worker's
    ``terminate``), so a worker that fails between two polls is recorded while its peers still run."""
    poll = ELASTIC_POLL

    def recording_poll(context):
        processes = list(getattr(getattr(context, "_pc", None), "processes", ()))
        for proc in processes:
            _record_before_terminate(proc, processes, record)
        record(processes)
        result = poll(context)
        record(processes)
        return result
    MultiprocessContext._poll = recording_poll


def _record_before_terminate(proc: Any, processes: list, record: Callable[[list], None]) -> None:
    """Make ``proc.terminate()`` run ``record(processes)`` first (once per process object)."""
    if getattr(proc, "_snn_records_first", False):
        return
    terminate = proc.terminate

    def recording_terminate():
        record(processes)
        terminate()
    proc.terminate = recording_terminate
    proc._snn_records_first = True


def serve_store_with(handler: Any, factory: Callable[[str, int], Any]) -> None:
    """Make the rendezvous ``handler`` open the store it shares with the workers by ``factory(master_addr,
    master_port)`` instead of :data:`ELASTIC_STORE_SERVER`."""
    setattr(handler, ELASTIC_STORE_SERVER.__name__, factory)
