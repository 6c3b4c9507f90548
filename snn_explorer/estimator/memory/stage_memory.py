"""What one micro-batch of each pipeline stage allocates, measured on the profile's private model copy.

Each stage runs as mode ``pp`` runs it (:class:`~...core.parallelize.pipeline.PipelineStageModule`:
reset, contiguous input, its units; the loss on the last stage) at the micro-batch size, two
micro-batches under one :class:`~..instruments.meter.StorageMeter`: the first without gradients (a rank's first
backward of the stage allocates them; what it leaves besides them is the neuron state the stage
keeps), the second with them (later backwards: autograd computes each new gradient beside the
accumulated one; the meter counts off the state the first left when the reset replaces it). Its
input is a received activation that requires grad (the backward accumulates its gradient into it,
as torch's ``stage_backward`` does) and the gradient of its output a buffer allocated before
(torch's receive buffer); the first stage's input and the labels are views of the rank's batch,
as torch's split gives them (a strided slice when there are several micro-batches and time steps).
Each stage runs in the profile's precision as ``apply`` runs it: autocast around the stage, its
output (what it sends on) in the compute dtype; the profile's neurons already keep their state dtype. The forward runs under the saved-tensor hooks measure() counts activations with (:class:`~..instruments.storage.LiveSaved`),
so both see the same tensors kept for backward.
"""
from __future__ import annotations

from dataclasses import astuple, dataclass, fields
from typing import Callable, Iterable, List, Mapping, Optional, Sequence

import torch

from ...core.parallelize import StageConfig, build_stage
from ..instruments.meter import StorageMeter
from ..instruments.storage import LiveSaved, saving, state_tensor_ids, storage_keys, total_bytes
from ..profile.stage_repeats import composed_stages
from ..profile.step import batch_slice, input_as, loss_of


@dataclass(frozen=True)
class StageMemory:
    """Bytes of one micro-batch of one stage."""

    kept: int  # alive after its forward, above before it: saved for backward, the output (+ loss graph)
    saved: int  # saved for backward (its input, a received buffer, and the parameters left out)
    output: int  # the stage's output
    grad_input: int  # the gradient of its input (0 on the first stage)
    held: int  # what the stage keeps between micro-batches (neuron state)
    forward: int  # the forward's peak above the bytes before it
    backward_first: int  # the backward's peak above the bytes before the forward, no gradients yet
    backward_next: int  # the same with the stage's gradients allocated before it
    grads: int  # the stage's gradients


#: Per :class:`StageMemory` figure that is a peak over a run (not a sum over its modules), the summed figures whose
#: growth per block bounds its events' (:func:`~..profile.stage_repeats.composed_stages`): what a block keeps and
#: its neuron state, and in a first backward the gradients it allocates.
PEAK_BOUNDS = {"forward": ("kept", "held"), "backward_first": ("kept", "held", "grads"),
               "backward_next": ("kept", "held")}
_INDEX = {f.name: i for i, f in enumerate(fields(StageMemory))}
STAGE_PEAKS = {_INDEX[peak]: tuple(_INDEX[b] for b in bounds) for peak, bounds in PEAK_BOUNDS.items()}


@dataclass(frozen=True)
class Counting:
    """How a stage's run is counted: its meter (a new :class:`StorageMeter`), its counter of the storages
    saved for backward (``saved(tensors left out)``, as :class:`LiveSaved`), the bytes of some tensors'
    distinct storages, and whether the stage runs under the precision's CPU autocast (as ``apply`` runs it
    on CPU ranks; the GPU trace, :func:`~.gpu_trace.gpu_stage_memory`, runs the stage as traced)."""

    meter: Callable[[], StorageMeter]
    saved: Callable[[list], LiveSaved]
    nbytes: Callable[[Iterable], int]
    autocast: bool = True


#: The stages as this machine runs them (real tensors or FakeTensors).
HOST = Counting(StorageMeter, lambda tensors: LiveSaved(storage_keys(tensors)), total_bytes)


def _micro(meter: StorageMeter, stage, inp, labels, grad_out, layout, counting: Counting = HOST) -> tuple:
    """(kept, saved for backward, forward peak, backward peak, output) of one micro-batch's forward
    and backward (saved: the storages packed for backward, its input and the parameters left out)."""
    saved = counting.saved([inp] + list(stage.parameters()))
    with meter:
        meter.restart_peak()
        base = meter.current
        with saving(saved):
            out = stage(inp)
            loss = loss_of(out, labels, layout) if grad_out is None else None
        kept, forward, packed = meter.current - base, meter.peak - base, saved.current
        meter.restart_peak()
        if loss is not None:
            loss.backward()
        elif out.requires_grad:  # a first stage with every parameter frozen has no backward (nor has torch's)
            torch.autograd.backward([out], [grad_out])
        backward = meter.peak - base
    return kept, packed, forward, backward, out.detach()


def measure_stages(profile, stages: Sequence[Sequence[str]], n: int, t: int, micro: int,
                   tp_plan: Optional[Mapping[str, str]] = None, tp: int = 1) -> List[StageMemory]:
    """:class:`StageMemory` of every stage (``stages``: unit paths) at ``n`` samples, ``t`` steps, the
    micro-batch cut out of a batch of ``micro`` of them; with ``tp_plan`` over ``tp`` ranks, as one TP
    rank runs the stage (the profile's TP replica, ``profile.rank_model``)."""
    key = (tuple(map(tuple, stages)), n, t, micro) + profile.rank_model(tp_plan, tp)[0]
    if key not in profile.stage_memory:
        with profile.runner(tp_plan, tp, profile.shape_only) as (model, convert):  # FakeTensors when shape-only
            run = lambda cut: _measure(profile, model, convert, cut, n, t, micro)  # noqa: E731
            composed = composed_stages(profile.composed if tp == 1 else None, stages, run, astuple, STAGE_PEAKS)
            profile.stage_memory[key] = run(stages) if composed is None else [StageMemory(*map(int, c))
                                                                                for c in composed]
    return profile.stage_memory[key]


def _measure(profile, model, convert, stages, n: int, t: int, micro: int,
             counting: Counting = HOST) -> List[StageMemory]:
    layout = profile.layout
    x, y = batch_slice(profile.example_input, profile.labels, n * micro, t, layout=layout)
    x, y = convert(input_as(x, profile.dtype)), convert(y)  # token ids stay ints
    # views of the batch on its batch dim, as torch's split gives the first stage and the loss
    x, y = layout.share(x, 0, n), None if y is None else y[:n]
    out: List[StageMemory] = []
    # as apply runs each stage on CPU ranks (the root's autocast skips them), or as the GPU trace runs it
    config = StageConfig(per_step=layout.per_step, precision=profile.precision,
                         autocast_device="cpu" if counting.autocast else None)
    for i, paths in enumerate(stages):
        stage = build_stage(i, paths, model, config)
        inp = x if i == 0 else x.detach().requires_grad_()
        grad_out: Optional[torch.Tensor] = None
        if i < len(stages) - 1:
            with torch.no_grad():
                grad_out = torch.ones_like(stage(inp))
        params = [p for p in stage.parameters() if p.requires_grad]
        for p in params:
            p.grad = None
        inp.grad = None
        # one meter over both micro-batches: what the first leaves (its neuron state) the second frees
        meter = counting.meter()
        state = state_tensor_ids(stage)  # left untracked, as measure() leaves it: its replacement is not counted off
        meter.track([inp, grad_out] + list(stage.parameters()) + [b for b in stage.buffers() if id(b) not in state])
        base = meter.current
        first = _micro(meter, stage, inp, y, grad_out, layout, counting)[3]
        grad_input, grads = counting.nbytes([inp.grad]), counting.nbytes(p.grad for p in params)
        inp.grad = None
        held = meter.current - base - grads
        kept, saved, forward, after, x = _micro(meter, stage, inp, y, grad_out, layout, counting)
        # the first micro-batch's peak includes the state it creates, which the walk counts apart
        out.append(StageMemory(kept=kept, saved=saved, output=counting.nbytes([x]), grad_input=grad_input, held=held,
                               forward=forward, backward_first=first - held, backward_next=after, grads=grads))
        for p in params:
            p.grad = None
    return out
