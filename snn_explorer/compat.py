"""Every private torch / cloudpickle name snn_explorer relies on, in one place.

Each name is looked up once, at import, and checked for the shape the code expects (present,
callable, taking the arguments we pass). A torch release that moved or changed one raises
:class:`TorchCompatError` naming the name, the installed torch and the tested range, instead of
failing deep inside a step. Everything else in the package uses public torch API only.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Iterable, Optional

import torch

#: The torch releases CI runs the suite (or the tests of every name below) on; pyproject.toml says the same.
TESTED_TORCH = ">=2.13,<2.15"


class TorchCompatError(ImportError):
    """A private name snn_explorer needs is missing or changed in the installed torch."""


def _require(module: str, attr: str, *, params: Iterable[str] = (), callable_: bool = True) -> Any:
    """``module.attr``, checked: present, callable when ``callable_``, accepting ``params`` by name."""
    where = f"{module}.{attr}"
    try:
        owner: Any = importlib.import_module(module)
    except ImportError as exc:
        raise _error(where, f"module {module} does not import ({exc})") from exc
    value = owner
    for part in attr.split("."):
        if not hasattr(value, part):
            raise _error(where, "it is missing")
        value = getattr(value, part)
    if callable_ and not callable(value):
        raise _error(where, f"it is a {type(value).__name__}, not callable")
    missing = _missing_params(value, params)
    if missing:
        raise _error(where, f"it no longer takes {missing}")
    return value


def _missing_params(fn: Any, params: Iterable[str]) -> Optional[list]:
    params = list(params)
    if not params:
        return None
    try:
        names = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None  # a builtin without a signature: presence is all we can check
    return [p for p in params if p not in names] or None


def _error(where: str, why: str) -> TorchCompatError:
    return TorchCompatError(f"snn_explorer needs the private torch name {where}, but in torch {torch.__version__} "
                            f"{why}; snn_explorer is tested with torch {TESTED_TORCH}")


# --- core and estimator ---------------------------------------------------------------------


# --- rank runner (torch elastic, cloudpickle) -----------------------------------------------


def _code_reduce_shape(reduce: Any) -> Any:
    """cloudpickle's code reducer must still return ``(constructor, args)`` that rebuild the code."""
    code = _code_reduce_shape.__code__
    try:
        ctor, args = reduce(code)
        ok = isinstance(ctor(*args), type(code))
    except Exception:  # noqa: BLE001 - any failure means the shape changed
        ok = False
    if not ok:
        import cloudpickle

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


class _NoHook:
    """Stands for a grad-hook handle MemTracker would remove on exit."""

    def remove(self) -> None:
        pass


def mem_tracker_skip_grad_hooks(tracker: Any, params: Iterable[Any]) -> None:
    """Tell ``MemTracker`` (its private ``_param_to_grad_hook_handles``) that ``params`` already have
    grad hooks: it registers one on every parameter of a module it enters, which fails for a frozen
    parameter (measure() on ranks; checked here, when first used, as mem_tracker imports slowly)."""
    handles = getattr(tracker, "_param_to_grad_hook_handles", None)
    if not (hasattr(handles, "get") and hasattr(handles, "__setitem__")):
        raise _error("torch.distributed._tools.mem_tracker.MemTracker._param_to_grad_hook_handles",
                     "it is missing or no longer a mapping")
    for p in params:
        handles[p] = (_NoHook(), _NoHook())
