"""What the command line names: a model (``module:factory`` / ``zoo:NAME``), a topology, an example batch."""
from __future__ import annotations

import argparse
import importlib
import inspect
import math
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..core import SNNDistributedTopology
from ..core.common import MAX_WORLD_SIZE, dp_tp_splits, positive_int
from ..zoo import ZOO_NAMES, build


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are CliErrors too (one line, exit 2)."""

    def error(self, message: str):
        raise CliError(f"{message} (see '{self.prog} --help')")


def positive(name: str, value, **kw) -> int:
    try:
        return positive_int(name, value, **kw)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def call_factory(factory, spec: str):
    """``factory()``, with its failure (or its required arguments) as a CliError."""
    try:
        required = [n for n, p in inspect.signature(factory).parameters.items()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    except (TypeError, ValueError):
        required = []
    if required:
        raise CliError(f"model factory {spec!r} needs the argument(s) {required}; give a factory that "
                       "takes no arguments (or defaults for all of them)")
    try:
        return factory()
    except Exception as exc:  # noqa: BLE001 - the user's code: reported in one line
        raise CliError(f"model factory {spec!r} raised {type(exc).__name__}: {exc}") from None


def resolve(spec: str, what: str) -> Any:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"{what} {spec!r} must look like 'module:attribute' (e.g. 'mypkg.models:make_net'"
                       + (" or 'zoo:mlp')" if what == "model" else ")"))
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CliError(f"cannot import module {module_name!r} of {what} {spec!r}: {exc}") from None
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise CliError(f"module {module_name!r} has no attribute {attr!r} ({what} {spec!r})")
        target = getattr(target, part)
    return target


def load_model(spec: str) -> Tuple[Any, Optional[str], Optional[int]]:
    """``(model, family or None, example batch size or None)`` for ``module:factory`` / ``zoo:NAME``."""
    model, family, batch, _ = load_model_and_batch(spec)
    return model, family, batch


def load_model_and_batch(spec: str) -> Tuple[Any, Optional[str], Optional[int], Optional[tuple]]:
    """:func:`load_model` plus ``(example_input, labels)`` when the factory's object carries them
    (a zoo model, or any object with ``.model`` and ``.example_input``), else None."""
    if spec.startswith("zoo:"):
        name = spec[4:]
        if name not in ZOO_NAMES:
            raise CliError(f"unknown zoo model {name!r} in {spec!r}; expected one of {ZOO_NAMES}")
        obj = build(name)
    else:
        obj = resolve(spec, "model")
        if callable(obj) and not isinstance(obj, nn.Module):
            obj = call_factory(obj, spec)
    if isinstance(obj, nn.Module):
        return obj, None, None, None
    if isinstance(getattr(obj, "model", None), nn.Module):
        example = getattr(obj, "example_input", None)
        batch = (example, getattr(obj, "labels", None)) if example is not None else None
        return obj.model, getattr(obj, "family", None), getattr(obj, "batch_size", None), batch
    raise CliError(f"model {spec!r} gave a {type(obj).__name__}, not a torch.nn.Module (or an object with .model)")


def parse_topology(text: str) -> SNNDistributedTopology:
    """``"dp=2,tp=2"`` -> a validated topology."""
    dims: Dict[str, int] = {}
    for item in text.split(","):
        name, sep, size = item.strip().partition("=")
        if not sep or not name.strip():
            raise CliError(f"bad topology {text!r}: {item.strip()!r} is not NAME=SIZE; expected e.g. 'dp=2,tp=2'")
        if name.strip() in dims:
            raise CliError(f"bad topology {text!r}: dim {name.strip()!r} is given twice; name each dim once")
        try:
            dims[name.strip()] = int(size)
        except ValueError:
            raise CliError(f"bad topology {text!r}: size {size!r} of dim {name.strip()!r} is not an integer") from None
    try:
        return SNNDistributedTopology(dims)
    except (TypeError, ValueError) as exc:
        raise CliError(f"bad topology {text!r}: {exc}") from None


def topologies(args) -> List[SNNDistributedTopology]:
    """The topology given, or every dp x tp factorisation of the world size."""
    if args.topology:
        return [parse_topology(args.topology)]
    n = args.world_size
    if n < 1 or n > MAX_WORLD_SIZE:
        raise CliError(f"bad world size {n}: must be between 1 and {MAX_WORLD_SIZE}")
    return [SNNDistributedTopology(dims) for dims in dp_tp_splits(n)]


def _available_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


#: The largest share of the available memory an example input may take: the estimate runs the
#: model on it, and a forward keeps several tensors of the input's size.
INPUT_SHARE = 0.25


def check_input_size(text: str, shape: tuple) -> None:
    """Refuse an example input that this machine cannot hold (with room for the model's forward)."""
    size = math.prod(shape) * 4  # float32
    available = _available_bytes()
    if available is not None and size > INPUT_SHARE * available:
        raise CliError(f"bad --input-shape {text!r}: the example input alone is {size / 2 ** 30:.3g} GiB (float32), "
                       f"more than {INPUT_SHARE:.0%} of this machine's available memory ({available / 2 ** 30:.3g} GiB); "
                       "the estimates scale with T and N, so give a smaller shape")


def example_batch(args, carried: Optional[tuple], batch: int):
    """``(example_input, labels)``: the model's own, else random inputs of ``--input-shape``, else None."""
    if args.input_shape:
        try:
            shape = tuple(int(v) for v in args.input_shape.split(","))
        except ValueError:
            raise CliError(f"bad --input-shape {args.input_shape!r}: expected integers T,N,F... "
                           "(e.g. 8,16,784)") from None
        if len(shape) < 3 or min(shape) < 1:
            raise CliError(f"bad --input-shape {args.input_shape!r}: expected T,N and at least one feature "
                           "size, all positive (e.g. 8,16,784)")
        check_input_size(args.input_shape, shape)
        return torch.rand(shape, generator=torch.Generator().manual_seed(0)), None
    return carried


