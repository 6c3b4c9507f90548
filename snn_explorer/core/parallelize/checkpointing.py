"""Activation checkpointing with neuron state restored for the recompute (``torch.utils.checkpoint``).

A checkpointed region keeps only its inputs; backward runs its forward again to rebuild what the
backward needs. A spiking neuron's forward reads its state (membrane, ...) from the module, so the
recompute must start from the state the region started from: every region takes a copy of its
neurons' state on entry, restores it before recomputing, and puts back afterwards the state the rest
of the backward (and the next forward) sees. Recomputed results then equal the original ones exactly.

Regions (see ``core.memory_levers``): ``"blocks"`` checkpoints each block -- an FSDP2 unit with the
parameter-free modules that follow it in its ``nn.Sequential`` -- or every k-th one; ``"time_chunks"``
checkpoints each call of the module the model steps once per time step, one copy of the state per chunk
of k steps (the recompute of a later step of a chunk replays the steps before it without gradients);
``"ops"`` checkpoints every repeated block (:func:`repeated_blocks`: a transformer's layers, as torchtitan
wraps ``model.layers``) with torchtitan's op policy (:mod:`.saved_ops`): the outputs of its matrix
products (but every second), attention kernels and reduce-scatters are kept, the rest recomputed.
Applied after TP and before FSDP2 / DDP, as torchtitan orders them.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from ..common.vocabulary import Checkpointing
from ..levers.block_choice import check_checkpoint_blocks
from ..model import neurons
from ..model.families import CONTAINERS
from .saved_ops import TORCHTITAN_OPS, SavedOps

__all__ = ["apply_activation_checkpointing", "checkpoint_blocks", "checkpoint_time_chunks", "block_segments",
           "checkpointed_paths", "chosen_segments", "planned_blocks", "region_starts", "repeated_blocks"]

#: A neuron's state: (module, {slot: value}) per stateful module.
State = List[Tuple[nn.Module, Dict[Tuple[str, str], object]]]


# ---- neuron state: capture and restore ---------------------------------------------------------------------
def _copy(value):
    """A tensor detached and cloned, keeping ``requires_grad`` (so the recompute saves the same tensors)."""
    if not isinstance(value, torch.Tensor):
        return value
    copied = value.detach().clone()
    return copied.requires_grad_(value.requires_grad) if copied.is_floating_point() else copied


def capture_state(stateful: Sequence[nn.Module], copy: bool = True) -> State:
    """The state of each module of ``stateful`` (copies, or the objects themselves with ``copy=False``)."""
    return [(m, {slot: _copy(v) if copy else v for slot, v in neurons.state_slots(m)}) for m in stateful]


def restore_state(state: State) -> None:
    """Put ``state`` (from :func:`capture_state`) back into its modules."""
    for module, slots in state:
        for slot, value in slots.items():
            neurons.set_state_slot(module, slot, value)


def _stateful_in(module: nn.Module) -> List[nn.Module]:
    return [m for m in module.modules() if neurons.is_stateful(m)]


def _run_from(entry: Callable[[], State], stateful: Sequence[nn.Module], run: Callable, restore: bool) -> Callable:
    """``run`` as a checkpoint body: its first call is the forward; later calls (the recompute) start from
    ``entry()`` and put back the state they found. ``restore=False`` skips that (only to show it matters)."""
    calls = [0]

    def body(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1 or not restore:
            return run(*args, **kwargs)
        found = capture_state(stateful, copy=False)
        restore_state(entry())
        try:
            return run(*args, **kwargs)
        finally:  # also when torch stops the recompute early
            restore_state(found)

    return body


# ---- blocks --------------------------------------------------------------------------------------------------
def block_segments(model: nn.Module, units: Sequence[str]) -> List[Tuple[str, Tuple[str, ...]]]:
    """The checkpoint blocks of ``model``: ``(parent path, child names)`` per block, in unit order.

    A unit inside an ``nn.Sequential`` forms a block with the parameter-free siblings after it (its
    neurons, dropout, pooling) up to the next unit; any other unit is a block of its own (``parent``
    is then the unit's path and the names are empty).
    """
    unit_set = set(units)
    blocks = []
    positions: Dict[str, Tuple[List[str], Dict[str, int]]] = {}  # per parent: its child names and their indices
    for path in units:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if path else None
        if not isinstance(parent, nn.Sequential):
            blocks.append((path, ()))
            continue
        if parent_path not in positions:
            names = list(parent._modules)
            positions[parent_path] = (names, {n: i for i, n in enumerate(names)})
        names, index = positions[parent_path]
        members = [name]
        for follower in names[index[name] + 1:]:
            child = parent._modules[follower]
            full = f"{parent_path}.{follower}" if parent_path else follower
            if full in unit_set or any(True for _ in child.parameters()):
                break
            members.append(follower)
        blocks.append((parent_path, tuple(members)))
    return blocks


def repeated_blocks(model: nn.Module, units: Sequence[str]) -> List[str]:
    """The units that are one of several of one class in one ``nn.ModuleList`` / ``nn.Sequential`` (a
    transformer's layers; not its embedding, final norm or output layer); all ``units`` when none is."""
    groups: Dict[Tuple[str, type], List[str]] = {}
    for path in units:
        parent = path.rpartition(".")[0]
        if path and isinstance(model.get_submodule(parent), (nn.ModuleList, nn.Sequential)):
            groups.setdefault((parent, type(model.get_submodule(path))), []).append(path)
    repeated = {p for paths in groups.values() if len(paths) > 1 for p in paths}
    return [u for u in units if u in repeated] or list(units)


def checkpoint_blocks(model: nn.Module, units: Sequence[str], every: int = 1, restore: bool = True,
                      saved_ops: Optional[SavedOps] = None, tally: Optional[Counter] = None,
                      only: Sequence[str] = ()) -> int:
    """Checkpoint every ``every``-th block of ``model`` (see :func:`block_segments`), or with ``only`` exactly the
    blocks whose first unit it names (:mod:`..block_choice`); returns how many.
    With ``saved_ops`` each block keeps the outputs of those operators (:mod:`.saved_ops`; ``tally`` hears
    its decisions) and recomputes the rest, else it keeps only its inputs."""
    chosen = chosen_segments(model, units, every, only)
    _checkpoint_segments(model, chosen, restore, saved_ops, tally)
    return len(chosen)


def _checkpoint_segments(model: nn.Module, chosen: List[Tuple[str, Tuple[str, ...]]], restore: bool = True,
                         saved_ops: Optional[SavedOps] = None, tally: Optional[Counter] = None) -> None:
    """Checkpoint each of the blocks ``chosen`` (:func:`block_segments`' ``(parent, members)``)."""
    context_fn = saved_ops.context_fn(tally) if saved_ops is not None else noop_context_fn
    by_parent: Dict[str, List[Tuple[str, ...]]] = {}
    for parent, members in chosen:
        if not members:
            _checkpoint_module(model.get_submodule(parent), restore, context_fn)
        else:
            by_parent.setdefault(parent, []).append(members)
    for parent, segments in by_parent.items():
        _checkpoint_sequential_segments(model.get_submodule(parent), segments, restore, context_fn)


def chosen_segments(model: nn.Module, units: Sequence[str], every: int = 1,
                    only: Sequence[str] = ()) -> List[Tuple[str, Tuple[str, ...]]]:
    """The blocks :func:`checkpoint_blocks` checkpoints (:func:`block_segments`): every ``every``-th, or with
    ``only`` those whose first unit it names."""
    segments = block_segments(model, units)
    if not only:
        return segments[::every]
    check_checkpoint_blocks(only, units)
    named = set(only)
    return [segment for unit, segment in zip(units, segments) if unit in named]


def planned_blocks(model: nn.Module, plan, units: Sequence[str]) -> Optional[List[Tuple[str, Tuple[str, ...]]]]:
    """The blocks (:func:`block_segments`' ``(parent, members)``) that ``plan`` checkpoints in ``model`` (``units``:
    its blocks): the one place that decides them, for :func:`apply_activation_checkpointing` and
    :func:`region_starts` (the estimator's); None where the plan does not checkpoint by blocks (none, time chunks)."""
    if plan.activation_checkpointing == Checkpointing.BLOCKS:
        return chosen_segments(model, units, plan.checkpoint_every, plan.checkpoint_blocks)
    if plan.activation_checkpointing == Checkpointing.OPS:
        return chosen_segments(model, repeated_blocks(model, units), plan.checkpoint_every)
    return None


def region_starts(model: nn.Module, plan, units: Sequence[str]) -> Optional[List[Tuple[str, int]]]:
    """``(path, children)`` per region :func:`apply_activation_checkpointing` makes of ``model`` for ``plan``
    (:func:`planned_blocks`): the module it starts at (a checkpointed module: 1, or the first of a checkpointed
    run of ``children`` siblings); None for time chunks (a region per call of the time-step module, not per
    module) and without checkpointing."""
    chosen = planned_blocks(model, plan, units)
    if chosen is None:
        return None
    return [((f"{parent}.{members[0]}" if parent else members[0]) if members else parent, max(1, len(members)))
            for parent, members in chosen]


def checkpointed_paths(model: nn.Module, plan, units: Sequence[str]) -> List[str]:
    """The modules of ``model`` whose forward :func:`apply_activation_checkpointing` replaces, or on which it
    registers hooks, for ``plan`` (paths, "" the root): a caller can checkpoint a copy made new along these paths
    only (``core.module_copy.copy_along``), the rest of the tree shared."""
    blocks = planned_blocks(model, plan, units)
    if blocks is not None:
        return list(dict.fromkeys(parent for parent, _ in blocks))  # a run's Sequential, or the unit itself
    if plan.activation_checkpointing == Checkpointing.TIME_CHUNKS:
        try:  # the root's hooks start each pass; a path that names no module: apply's own error says so
            model.get_submodule(plan.time_step_module)
        except AttributeError:
            return [""]
        return ["", plan.time_step_module]
    return []


def _checkpointed(region: nn.Module, run: Callable, restore: bool, context_fn: Callable = noop_context_fn) -> Callable:
    """``run`` (the forward of ``region`` or of a run of its children) as one checkpointed region."""
    stateful = _stateful_in(region)

    def forward(*args, **kwargs):
        entry = capture_state(stateful)
        body = _run_from(lambda: entry, stateful, run, restore)
        return checkpoint(body, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return forward


def _checkpoint_module(module: nn.Module, restore: bool, context_fn: Callable) -> None:
    if isinstance(module, CONTAINERS):
        raise ValueError(f"cannot checkpoint a {type(module).__name__}: it has no forward of its own")
    module.forward = _checkpointed(module, module.forward, restore, context_fn)


def _checkpoint_sequential_segments(seq: nn.Sequential, segments: List[Tuple[str, ...]], restore: bool,
                                    context_fn: Callable) -> None:
    """Replace ``seq``'s forward by one that runs each of ``segments`` (runs of its children) checkpointed."""
    starts = {members[0]: members for members in segments}
    regions = {}
    for members in segments:
        children = [seq._modules[n] for n in members]
        holder = nn.Sequential(*children)  # only to find the state of the region's neurons
        regions[members[0]] = _checkpointed(holder, _run_children(children), restore, context_fn)

    def forward(x):
        names = list(seq._modules)
        i = 0
        while i < len(names):
            name = names[i]
            if name in starts:
                x = regions[name](x)
                i += len(starts[name])
            else:
                x = seq._modules[name](x)
                i += 1
        return x

    seq.forward = forward


def _run_children(children: Sequence[nn.Module]) -> Callable:
    def run(x):
        for child in children:
            x = child(x)
        return x

    return run


# ---- time chunks -----------------------------------------------------------------------------------------
@dataclass
class _Chunk:
    """One chunk of time steps of one forward: its entry state and what replaying its steps needs."""
    entry: State
    stateful: Sequence[nn.Module]
    run: Callable
    inputs: List[tuple] = field(default_factory=list)
    rng: List[tuple] = field(default_factory=list)
    grad_flags: List[List[bool]] = field(default_factory=list)
    replayed: Dict[int, State] = field(default_factory=dict)

    def state_at(self, step: int) -> State:
        """The neuron state at the entry of the chunk's ``step``-th step (0: a copy of its entry copy)."""
        if step == 0:
            return _copy_state(self.entry)
        if step not in self.replayed:
            self._replay(max((i for i in self.replayed if i < step), default=0), step)
        return _with_grad_flags(self.replayed.pop(step), self.grad_flags[step])  # backward visits a step once

    def _replay(self, start: int, stop: int) -> None:
        """Run steps ``start .. stop-1`` without gradients from their entry state, keeping the states at the
        entries of steps ``start+1 .. stop``."""
        restore_state(_copy_state(self.entry if start == 0 else self.replayed[start]))
        cuda = [torch.cuda.current_device()] if self.rng[start][1] is not None else []
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            for step in range(start, stop):
                cpu_rng, cuda_rng = self.rng[step]
                torch.set_rng_state(cpu_rng)
                if cuda_rng is not None:
                    torch.cuda.set_rng_state(cuda_rng)
                args, kwargs = self.inputs[step]
                self.run(*args, **kwargs)
                self.replayed[step + 1] = capture_state(self.stateful)


def _copy_state(state: State) -> State:
    return [(m, {slot: _copy(v) for slot, v in slots.items()}) for m, slots in state]


def _rng_state() -> tuple:
    """The CPU generator's state, and the current CUDA device's when CUDA is in use (for replaying a step)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None


def _grad_flags(stateful: Sequence[nn.Module]) -> List[bool]:
    return [isinstance(v, torch.Tensor) and v.requires_grad for m in stateful for _, v in neurons.state_slots(m)]


def _with_grad_flags(state: State, flags: List[bool]) -> State:
    """``state`` with each tensor's ``requires_grad`` set as it was at that step in the forward."""
    out, i = [], 0
    for module, slots in state:
        fixed = {}
        for slot, value in slots.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                value = value.detach().requires_grad_(flags[i])
            fixed[slot] = value
            i += 1
        out.append((module, fixed))
    return out


class _TimeChunks:
    """Checkpoints each call of a module stepped once per time step; a state copy per chunk of steps."""
    def __init__(self, module: nn.Module, every: int, restore: bool):
        self.module, self.every, self.restore = module, every, restore
        self.run = module.forward
        self.stateful = _stateful_in(module)
        self.step = 0
        self.chunk: Optional[_Chunk] = None

    def new_pass(self) -> None:
        self.step, self.chunk = 0, None

    def forward(self, *args, **kwargs):
        index = self.step % self.every
        if index == 0:
            self.chunk = _Chunk(capture_state(self.stateful), self.stateful, self.run)
        chunk = self.chunk
        chunk.inputs.append((args, kwargs))
        chunk.rng.append(_rng_state())
        chunk.grad_flags.append(_grad_flags(self.stateful))
        self.step += 1
        body = _run_from(lambda: chunk.state_at(index), self.stateful, self.run, self.restore)
        return checkpoint(body, *args, use_reentrant=False, **kwargs)


def checkpoint_time_chunks(model: nn.Module, path: str, every: int = 1, restore: bool = True) -> _TimeChunks:
    """Checkpoint each call of ``model``'s module ``path`` (called once per time step), chunks of ``every``."""
    try:
        module = model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"time_step_module={path!r} is not a module of this model") from None
    if isinstance(module, CONTAINERS) or module is model:
        raise ValueError(f"time_step_module={path!r} must be a module that the model's forward calls once per "
                         "time step (not the model itself or a ModuleList / ModuleDict)")
    chunks = _TimeChunks(module, every, restore)
    module.forward = chunks.forward
    model.register_forward_pre_hook(lambda _m, _args: chunks.new_pass())
    model.register_forward_hook(lambda _m, _args, _out: _check_stepped(chunks, path))
    return chunks


def _check_stepped(chunks: _TimeChunks, path: str) -> None:
    if chunks.step == 1:
        raise ValueError(f"time_step_module={path!r} ran once in this forward: the model is not stepped one time "
                         "step at a time, so there are no time chunks to checkpoint; use "
                         "activation_checkpointing='blocks'")


def apply_activation_checkpointing(model: nn.Module, plan, units: Sequence[str], tally: Optional[Counter] = None) -> None:
    """Checkpoint ``model`` as ``plan.activation_checkpointing`` says (``units``: the model's blocks; ``tally``
    hears the op policy's decisions with ``"ops"``)."""
    blocks = planned_blocks(model, plan, units)
    if blocks is not None:
        ops = TORCHTITAN_OPS if plan.activation_checkpointing == Checkpointing.OPS else None
        _checkpoint_segments(model, blocks, saved_ops=ops, tally=tally)
    elif plan.activation_checkpointing == Checkpointing.TIME_CHUNKS:
        checkpoint_time_chunks(model, plan.time_step_module, plan.checkpoint_every)
