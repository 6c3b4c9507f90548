"""One measured forward and backward of the profile (:func:`run_point`), and the same composed from runs
cut to a few of the model's repeated blocks (:func:`cut_saved_run`, :func:`cut_logged_run`).

Each run records, per module, the bytes saved for backward, the neuron state left after the forward,
the forward calls and input/output sizes, the order gradients become ready, and (on request) the
storage meter's event log and the operator counts; :mod:`.profiling` fits them over (N, T).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import nn

from ...compat_fake import data_dependent_op
from ...core.common import new_objects_collected
from ...core.model import DataLayout, fixed_loop_error, state_tensors, stateful_modules
from ..instruments.fsdp_events import record
from ..instruments.meter import StorageMeter
from ..instruments.module_calls import ModuleCalls
from ..instruments.op_counter import OpCounter, grad_names
from ..instruments.progress_hook import tell
from ..instruments.storage import SavedByModule, model_state_tensors, saving, state_tensor_ids, storage_bytes
from . import repeats_log
from .repeats import CUT, CUT_FAILURES, Repeats, block_inputs, compose_point, cut, find_repeats
from .repeats_log import LOG_CUTS, compose_log, cut_units, unit_pattern
from .step import batch_slice, forward_loss, input_as


def run_point(model: nn.Module, x: torch.Tensor, labels: Optional[torch.Tensor], saved_only: bool = True,
               units: Sequence[str] = (), count: bool = False, warm_up: bool = True) -> dict:
    """One forward + backward; per-module raw numbers and the dynamic peak above the entry memory.
    With ``count``, that step is also counted (forward and backward each by an
    :class:`~..instruments.op_counter.OpCounter`, in the state
    :func:`~..timing.compute_work.counted_pass` counts in): ``counts``, and ``with_grad`` the
    parameters it gave a gradient. ``warm_up=False`` skips the forward that first gives the neuron
    state this batch size (the last run had it already)."""
    trace = ModuleCalls(model)
    order = []  # the order in which gradients become ready
    hooks = [p.register_post_accumulate_grad_hook(lambda p, n=n: order.append(n))
             for n, p in model.named_parameters() if p.requires_grad]
    try:
        if warm_up:
            with torch.no_grad():  # state tensors take this size (a forward sets them, autograd does not)
                forward_loss(model, x, labels)
        model.zero_grad(set_to_none=True)
        order.clear()
        trace.clear_counts()
        # No reset here: like a rank in training, the step starts with the last step's neuron state
        # (forward_loss resets it, replacing those tensors). Held until the comparison below, so no
        # freed address can alias a saved activation's; the last step's neuron state is counted at
        # the start but not held (the forward replaces it).
        state_ids = state_tensor_ids(model)
        static_refs = [t for t in list(model.parameters()) + list(model.buffers()) if id(t) not in state_ids] + [x]
        static = storage_bytes(static_refs)
        meter = StorageMeter()
        meter.track(static_refs + model_state_tensors(model))
        # The objects that exist now are left out of the collection in _step (a full one scans every
        # object of the process); the graph pieces it is for are all created after this.
        with new_objects_collected() if saved_only else contextlib.nullcontext() as collect:
            run = _step(model, x, labels, meter, SavedByModule(lambda: trace.current), saved_only, units, count,
                        collect)
    finally:
        trace.remove()
        for h in hooks:
            h.remove()
    state_ptrs = {p for s in run["state"].values() for p in s}
    per_saved: Dict[str, int] = {}
    for ptr, (name, nbytes) in run["held"].items():
        if ptr not in static and ptr not in state_ptrs:
            per_saved[name] = per_saved.get(name, 0) + nbytes
    del static_refs
    return dict(saved=per_saved, state={n: sum(s.values()) for n, s in run["state"].items()}, calls=trace.calls,
                ins=trace.ins, outs=trace.outs, rg=trace.needs_grad, isz=trace.in_itemsize, log=run["log"], entry=run["entry"],
                grads=sum(storage_bytes([p.grad for p in model.parameters()]).values()), order=tuple(order),
                input=x.numel() * x.element_size(), counts=run["counts"],
                with_grad=grad_names(model) if count else ())


def cut_saved_run(model: nn.Module, x, labels) -> Optional[dict]:
    """The saved-tensor run of ``model`` (per-module saved bytes and neuron state) composed from runs cut to
    :data:`~.repeats.CUT` of its repeated blocks (:func:`~.repeats.compose_point`), or None where it has none
    or they disagree (then it runs in full)."""
    repeats = find_repeats(model)
    if repeats is None:
        return None
    try:
        with cut(model, repeats, CUT[0]):
            short = run_point(model, x, labels)
        with cut(model, repeats, CUT[1]), block_inputs(model, repeats, (CUT[1] - 2, CUT[1] - 1)) as inputs:
            longer = run_point(model, x, labels)
        return compose_point(short, longer, repeats, inputs, tuple(n for n, _ in model.named_parameters()))
    except CUT_FAILURES:  # the cut runs disagree, or the forward needs all its blocks: run in full
        return None


def cut_logged_run(model: nn.Module, x, labels, units: Sequence[str], repeats: Optional[Repeats] = None) -> Optional[dict]:
    """The logged run of ``model`` (``log``, ``entry``, ``grads``) composed from runs cut to
    :data:`~.repeats_log.LOG_CUTS` of its repeated blocks (``repeats``, else those it has:
    :func:`~.repeats_log.compose_log`), or None where it has fewer than :data:`~.repeats_log.MIN_LOG_REPEATS`
    or they disagree (then it runs in full)."""
    repeats = repeats or find_repeats(model)
    if repeats is None or repeats.count < max(repeats_log.MIN_LOG_REPEATS, LOG_CUTS[-1] + 1):
        return None
    try:
        pattern, runs = unit_pattern(units, repeats), {}
        for k in LOG_CUTS:
            with cut(model, repeats, k):
                runs[k] = run_point(model, x, labels, saved_only=False, units=cut_units(pattern, repeats, k))
        grad_bytes = {n: p.numel() * p.element_size() for n, p in model.named_parameters() if p.requires_grad}
        return compose_log(runs, repeats, units, grad_bytes)
    except CUT_FAILURES:  # the cut runs disagree, or the forward needs all its blocks: run in full
        return None


def _step(model, x, labels, meter: StorageMeter, saved: SavedByModule, saved_only: bool, units, count: bool,
          collect=None) -> dict:
    """The measured forward and backward of :func:`run_point`: with ``saved_only`` the saved
    storages autograd holds after the forward (``held``, after ``collect()``, :func:`new_objects_collected`'s),
    else the meter's event log (``log``) with FSDP2's units; the neuron state's storages after the forward,
    and the operator counts."""
    nothing = contextlib.nullcontext()
    counters = (OpCounter(), OpCounter()) if count else (nothing, nothing)
    with meter if not saved_only else nothing, record(model, units, meter) if not saved_only else nothing as log:
        entry = meter.current
        # The peak run must not hold saved tensors itself (that would raise its peak).
        with saving(saved) if saved_only else nothing, counters[0]:
            loss = forward_loss(model, x, labels)
        if log is not None:
            log.mark(meter, "forward_end")
        state = {n: storage_bytes(state_tensors(m)) for n, m in stateful_modules(model)}
        if saved_only:  # graph pieces in reference cycles would otherwise look alive, depending on timing
            collect()
        held = saved.held()
        with counters[1]:
            loss.backward()
        del loss
        if log is not None:
            log.mark(meter, "end")
    return dict(held=held, state=state, log=log, entry=entry,
                counts=[c.counts for c in counters] if count else None)


def profile_runs(model, convert, example_input, labels, dtype, layout: DataLayout, sizes: Sequence[Tuple[int, int]],
                 on_progress=None, repeats: Optional[Repeats] = None):
    """The runs of :func:`~.profiling.measure_profile` at ``sizes`` (``(N, T)`` pairs) (by batch size: a run leaves the neuron
    state the next one at that size starts from; ``on_progress`` hears each), and the parameters the
    last gave a gradient, and the ``repeats`` composed: from runs cut to a few of them (:func:`cut_runs`)
    unless those disagree (then None, run in full)."""
    if repeats is not None:
        try:
            return cut_runs(model, convert, example_input, labels, dtype, layout, sizes, on_progress, repeats) + (repeats,)
        except CUT_FAILURES:  # the cut runs disagree, or the forward needs all its blocks: run in full
            pass
    by_size, last_n = {}, None
    for n, t in sorted(sizes):
        x, y = batch_slice(example_input, labels, n, t, layout=layout)
        try:
            by_size[n, t] = run_point(model, convert(input_as(x, dtype)), convert(y), count=True, warm_up=n != last_n)
            last_n = n
            tell(on_progress, len(by_size), len(sizes), f"profiling the model: ran batch {n} x {t} time steps")
        except IndexError as exc:  # x[step] past the batch's steps: a loop over a fixed num_steps
            raise fixed_loop_error(example_input.shape[0], t, exc) from exc
        except RuntimeError as exc:
            if by_size or data_dependent_op(exc):  # the latter: step_runner's refusal
                raise
            raise ValueError(f"the model does not run on example_input of shape {tuple(example_input.shape)} "
                             f"(as [T, N, ...]; {example_input.dtype}; a slice {tuple(x.shape)} in data layout "
                             f"{layout} was tried): {exc}; give a batch the model's forward accepts, in the data "
                             "layout it takes") from exc
    return by_size, by_size[sizes[-1]]["with_grad"], None


def cut_runs(model, convert, example_input, labels, dtype, layout: DataLayout, sizes: Sequence[Tuple[int, int]],
             on_progress, repeats: Repeats):
    """:func:`profile_runs` from runs of ``model`` cut to :data:`~.repeats.CUT` repeats at each size
    (:func:`~.repeats.compose_point`; :class:`~.repeats.NotRepeating` where they disagree)."""
    names, by_size = tuple(n for n, _ in model.named_parameters()), {}
    blocks = (CUT[1] - 2, CUT[1] - 1)
    for n, t in sorted(sizes):
        x, y = batch_slice(example_input, labels, n, t, layout=layout)
        x, y = convert(input_as(x, dtype)), convert(y)
        with cut(model, repeats, CUT[0]):
            short = run_point(model, x, y, count=True)
        with cut(model, repeats, CUT[1]), block_inputs(model, repeats, blocks) as inputs:
            longer = run_point(model, x, y, count=True)
        by_size[n, t] = compose_point(short, longer, repeats, inputs, names)
        tell(on_progress, len(by_size), len(sizes), f"profiling the model: ran batch {n} x {t} time steps "
             f"({CUT[1]} of its {repeats.count} repeated blocks)")
    return by_size, by_size[sizes[-1]]["with_grad"]
