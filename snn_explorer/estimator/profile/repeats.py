"""Repeated blocks measured once: a deep model's profile runs on a copy cut to a few repeats.

A deep model is mostly one block repeated: the children of an ``nn.Sequential`` or ``nn.ModuleList``
that are structurally identical (same classes, configuration attributes, parameter and buffer
shapes, dtypes and ``requires_grad``; no parameter shared between them). Every block after the
first sees the same input signature (shape, dtype, ``requires_grad``) as the one before, so what
it does is the same: the bytes it saves for backward, its neuron state, its calls and sizes, its
operators. :func:`cut` runs the container with only the first ``k`` repeats (the rest of the
model as it is); :func:`compose_point` checks that the runs cut at ``CUT = (2, 3)`` repeats agree
(every module outside the third block the same, the third block's records those of the second,
the second and third blocks taking the same input signature) and builds the full model's records
from them: each later block's per-module records are the third's renamed, operator counts add
``(count - 3)`` times the third block's (the difference of the two runs), and the order in which
gradients become ready has each later block's parameters where the third's were. Anything that
does not agree raises :class:`NotRepeating` and the model runs in full. Only quantities that add up
over blocks are composed; a step's peak and FSDP2's event log are not (they are measured on the
whole model).
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ..instruments.storage import state_tensor_ids

#: A run of repeated blocks is used only from this many repeats (below, cutting saves little).
MIN_REPEATS = 6
#: The repeats the two cut runs keep: the first block is not composed (its input is the model's).
CUT = (2, 3)
#: The longest block, in children of the container, searched for.
MAX_PERIOD = 8
#: The per-module records of a profile run (dicts by module path) that :func:`compose_point` composes.
PER_MODULE = ("saved", "state", "calls", "ins", "outs", "rg", "isz")
_SIMPLE = (int, float, str, bool, type(None))


class NotRepeating(ValueError):
    """The cut runs do not show the repeats behaving alike: the model is profiled in full."""


#: What a run cut to a few of the repeated blocks may raise, after which the model is run in full: the cut runs
#: disagree (NotRepeating, a ValueError), or the forward needs all its blocks (it indexes them: IndexError,
#: KeyError; it checks their count or shapes: RuntimeError, ValueError, TypeError, AttributeError).
CUT_FAILURES = (RuntimeError, ValueError, IndexError, KeyError, TypeError, AttributeError)


@dataclass(frozen=True)
class Repeats:
    """``count`` blocks of ``period`` children each, from child ``start`` of the container at ``path``."""

    path: str
    keys: Tuple[str, ...]  # the container's child keys, in order
    start: int
    period: int
    count: int

    def block_keys(self, j: int) -> Tuple[str, ...]:
        first = self.start + j * self.period
        return self.keys[first:first + self.period]

    def kept_keys(self, k: int) -> Tuple[str, ...]:
        """The container's child keys with only the first ``k`` repeats."""
        return self.keys[:self.start + k * self.period] + self.keys[self.start + self.count * self.period:]

    def _child(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def locate(self, name: str) -> Optional[Tuple[int, int, str]]:
        """``(block, child in block, rest of the path)`` of a module or parameter path inside a repeat, else None."""
        prefix = f"{self.path}." if self.path else ""
        if not name.startswith(prefix) or not name[len(prefix):]:
            return None
        key, _, rest = name[len(prefix):].partition(".")
        positions = self.__dict__.get("_positions")
        if positions is None:  # built once (a frozen dataclass: set in its __dict__)
            positions = self.__dict__["_positions"] = {k: i for i, k in enumerate(self.keys)}
        index = positions.get(key)
        if index is None or not self.start <= index < self.start + self.count * self.period:
            return None
        block, child = divmod(index - self.start, self.period)
        return block, child, rest

    def name_in(self, block: int, child: int, rest: str) -> str:
        path = self._child(self.block_keys(block)[child])
        return f"{path}.{rest}" if rest else path


def _config(value, depth: int = 0):
    """A comparable summary of a module's configuration value (tensors are compared by shape elsewhere)."""
    if isinstance(value, _SIMPLE):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_config(v, depth + 1) for v in value)
    if isinstance(value, (torch.Tensor, nn.Module)) or depth > 1 or not hasattr(value, "__dict__"):
        return type(value).__qualname__
    return (type(value).__qualname__,) + tuple(sorted((k, _config(v, depth + 1)) for k, v in vars(value).items()
                                                      if not k.startswith("_")))


def signature(module: nn.Module, state: frozenset = frozenset()) -> tuple:
    """What makes two blocks behave alike on the same input: per submodule its class, configuration
    attributes, and its parameters' and buffers' shapes, dtypes and ``requires_grad``; neuron state (the
    ids in ``state``: what the last run left, reset before each) left out."""
    out = []
    for name, m in module.named_modules():
        config = tuple(sorted((k, _config(v)) for k, v in vars(m).items()
                              if not k.startswith("_") and not isinstance(v, torch.Tensor)))
        tensors = tuple((n, tuple(t.shape), t.dtype, t.requires_grad)
                        for n, t in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False))
                        if id(t) not in state)
        out.append((name, type(m), config, tensors))
    return tuple(out)


def _longest_run(ids: List[int]) -> Tuple[int, int, int]:
    """``(start, period, count)`` of the run of repeated blocks covering the most children of ``ids``."""
    best = (0, 1, 1)
    for period in range(1, min(MAX_PERIOD, len(ids) // 2) + 1):
        i = 0
        while i + 2 * period <= len(ids):
            j = i
            while j + 2 * period <= len(ids) and ids[j:j + period] == ids[j + period:j + 2 * period]:
                j += period
            count = (j - i) // period + 1
            if count * period > best[1] * best[2]:
                best = (i, period, count)
            i = j + period if count > 1 else i + 1
    return best


#: :func:`find_repeats` per live model object (the profile's private copies, which nothing changes)
_FOUND: "weakref.WeakKeyDictionary[nn.Module, Optional[Repeats]]" = weakref.WeakKeyDictionary()


def find_repeats(model: nn.Module) -> Optional[Repeats]:
    """:func:`search_repeats`, once per model object (:func:`cut` checks that its container's children are still
    those found)."""
    if model not in _FOUND:
        _FOUND[model] = search_repeats(model)
    return _FOUND[model]


def search_repeats(model: nn.Module) -> Optional[Repeats]:
    """The container of ``model`` with the most modules in repeated blocks (:data:`MIN_REPEATS` or more), or None."""
    best, best_size, state = None, 0, frozenset(state_tensor_ids(model))
    for path, container in model.named_modules():
        if not isinstance(container, (nn.Sequential, nn.ModuleList)) or len(container) < MIN_REPEATS:
            continue
        keys = tuple(container._modules)
        by_signature: Dict[tuple, int] = {}
        ids = [by_signature.setdefault(signature(container._modules[k], state), len(by_signature)) for k in keys]
        start, period, count = _longest_run(ids)
        size = count * sum(1 for k in keys[start:start + period] for _ in container._modules[k].modules())
        if count >= MIN_REPEATS and size > best_size and _unshared(container, keys[start:start + count * period]):
            best, best_size = Repeats(path, keys, start, period, count), size
    return best


def _unshared(container: nn.Module, keys: Tuple[str, ...]) -> bool:
    """Whether no parameter or buffer is held by two of these children (tied weights are not repeats)."""
    seen = set()
    for key in keys:
        child = container._modules[key]
        ids = {id(t) for t in list(child.parameters()) + list(child.buffers())}
        if seen & ids:
            return False
        seen |= ids
    return True


@contextlib.contextmanager
def cut(model: nn.Module, repeats: Repeats, k: int) -> Iterator[nn.Module]:
    """``model`` with its repeats cut to the first ``k`` in the block (restored after)."""
    container = model.get_submodule(repeats.path)
    full = container.__dict__["_modules"]
    if tuple(full) != repeats.keys:
        raise NotRepeating(f"the container {repeats.path!r} changed since its repeats were found")
    container.__dict__["_modules"] = {key: full[key] for key in repeats.kept_keys(k)}
    try:
        yield model
    finally:
        container.__dict__["_modules"] = full


def _tensor_signature(args) -> tuple:
    return tuple((tuple(a.shape), a.dtype, a.requires_grad) if isinstance(a, torch.Tensor) else type(a).__qualname__
                 for a in args)


@contextlib.contextmanager
def block_inputs(model: nn.Module, repeats: Repeats, blocks: Tuple[int, ...]) -> Iterator[Dict[int, list]]:
    """The input signatures (shape, dtype, ``requires_grad`` per argument) of every call of each of ``blocks``."""
    seen: Dict[int, list] = {j: [] for j in blocks}
    container = model.get_submodule(repeats.path)
    hooks = [container._modules[repeats.block_keys(j)[0]].register_forward_pre_hook(
        lambda module, args, j=j: seen[j].append(_tensor_signature(args))) for j in blocks]
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


def _split(records: dict, repeats: Repeats, block: int) -> Tuple[dict, dict]:
    """``records`` (by path) as (those of ``block`` by (child, rest), the others by path)."""
    inside, outside = {}, {}
    for name, value in records.items():
        where = repeats.locate(name)
        if where is not None and where[0] == block:
            inside[where[1:]] = value
        else:
            outside[name] = value
    return inside, outside


def _compose_records(short: dict, longer: dict, repeats: Repeats) -> dict:
    """Per-module records of the whole model from those of the runs with 2 and 3 repeats."""
    last = CUT[1] - 1
    block, rest = _split(longer, repeats, last)
    previous, _ = _split(longer, repeats, last - 1)
    if rest != short or block != previous:
        raise NotRepeating("a repeat's records differ from the one before it, or the rest of the model changed")
    out = dict(longer)
    for j in range(CUT[1], repeats.count):
        out.update((repeats.name_in(j, child, path), value) for (child, path), value in block.items())
    return out


def _compose_order(order: tuple, repeats: Repeats) -> tuple:
    """The order gradients become ready in the whole model, from the run with 3 repeats: the parameters of
    each later block where the third block's are (after them, or before them, as the third follows the second)."""
    last = CUT[1] - 1
    where = [repeats.locate(name) for name in order]
    at = [i for i, w in enumerate(where) if w is not None and w[0] == last]
    before = [i for i, w in enumerate(where) if w is not None and w[0] == last - 1]
    if not at and not before:  # the repeats give no gradients
        return order
    if not at or at != list(range(at[0], at[0] + len(at))) or [where[i][1:] for i in at] != [where[i][1:] for i in before]:
        raise NotRepeating("the gradients of a repeat do not become ready together, in the order of the one before")
    segment = [where[i][1:] for i in at]
    later = range(CUT[1], repeats.count)
    blocks = list(later) if before and before[0] < at[0] else list(reversed(later))
    added = [repeats.name_in(j, child, rest) for j in blocks for child, rest in segment]
    if before and before[0] < at[0]:
        return order[:at[-1] + 1] + tuple(added) + order[at[-1] + 1:]
    return order[:at[0]] + tuple(added) + order[at[0]:]


def extend_counts(short: list, longer: list, times: int) -> list:
    """Per-phase operator counts of ``longer`` (a run with one repeat more than ``short``) plus ``times`` repeats
    more, each adding the difference of the two runs (integers held exactly in floats)."""
    return [[b + times * (b - a) for a, b in zip(phase_a, phase_b)] for phase_a, phase_b in zip(short, longer)]


def _compose_counts(short: list, longer: list, repeats: Repeats) -> list:
    """Operator counts (forward, backward) of the whole model from the runs with 2 and 3 repeats."""
    return extend_counts(short, longer, repeats.count - CUT[1])


def compose_point(short: dict, longer: dict, repeats: Repeats, inputs: Dict[int, list], names: Tuple[str, ...]) -> dict:
    """One profile run's records (:func:`~.profile_runs.run_point`) of the whole model, from the runs cut to
    :data:`CUT` repeats; ``inputs`` the input signatures of the second and third blocks in the longer run and
    ``names`` the whole model's parameter names in order. :class:`NotRepeating` where they do not agree."""
    last = CUT[1] - 1
    if inputs[last] != inputs[last - 1] or not inputs[last] or short["input"] != longer["input"]:
        raise NotRepeating("the repeats do not all take the same input")
    point = dict(longer)
    for key in PER_MODULE:
        point[key] = _compose_records(short[key], longer[key], repeats)
    point["order"] = _compose_order(longer["order"], repeats)
    if longer["counts"] is not None:
        point["counts"] = _compose_counts(short["counts"], longer["counts"], repeats)
    point["with_grad"] = names_as_run(names, longer["with_grad"], repeats, CUT[1])
    return point


def _as_run(name: str, repeats: Repeats, kept: int = CUT[1]) -> str:
    """The name in the run with ``kept`` repeats of what ``name`` is in the whole model (later blocks as the last kept)."""
    where = repeats.locate(name)
    if where is None or where[0] < kept:
        return name
    return repeats.name_in(kept - 1, *where[1:])


def names_as_run(names: Tuple[str, ...], kept_names: Tuple[str, ...], repeats: Repeats, kept: int) -> tuple:
    """Those of the whole model's ``names`` whose counterpart in the run with ``kept`` repeats is in ``kept_names``."""
    found = set(kept_names)
    return tuple(n for n in names if _as_run(n, repeats, kept) in found)
