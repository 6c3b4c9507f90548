"""What one micro-batch of each pipeline stage allocates, measured on the profile's private model copy.

Each stage runs as mode ``pp`` runs it (:class:`~..core.parallelize.pipeline.PipelineStageModule`:
reset, contiguous input, its units; the loss on the last stage) at the micro-batch size, under a
:class:`~.meter.StorageMeter`: a warm-up micro-batch (neuron state at this size, gradients
allocated), then one with the gradients dropped (a rank's first backward of the stage creates
them) and one with them kept (later backwards: autograd computes each new gradient beside the
accumulated one). Its input is a received activation that requires grad (the stage backward
accumulates its gradient into it, as torch's ``stage_backward`` does) and the gradient of its
output a buffer allocated before (torch's receive buffer); the first stage's input is a strided
slice when the schedule cuts one (more than one micro-batch and time step), as torch's split is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from ..compat import non_persistent_buffer_names
from ._step import batch_slice, loss_of
from .meter import StorageMeter


@dataclass(frozen=True)
class StageMemory:
    """Bytes of one micro-batch of one stage."""

    kept: int  # alive after its forward, above before it: saved for backward, the output (+ loss graph)
    output: int  # the stage's output
    grad_input: int  # the gradient of its input (0 on the first stage)
    held: int  # what its modules keep between micro-batches: neuron state and such tensor attributes
    forward: int  # the forward's peak above the bytes before it
    backward_first: int  # the backward's peak above the bytes before the forward, no gradients yet
    backward_next: int  # the same with the stage's gradients allocated before it
    grads: int  # the stage's gradients


def _bytes(tensors) -> int:
    seen: Dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _held(stage: nn.Module) -> List[torch.Tensor]:
    """Tensors the stage's modules hold besides parameters and persistent buffers (neuron state:
    non-persistent buffers, spikingjelly's ``_memories``, plain tensor attributes such as snntorch's ``reset``)."""
    out = []
    for m in stage.modules():
        out += [b for n, b in m.named_buffers(recurse=False) if n in non_persistent_buffer_names(m)]
        out += [v for v in vars(m).values() if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)]
        memories = getattr(m, "_memories", None)
        if isinstance(memories, dict):
            out += [v for v in memories.values() if isinstance(v, torch.Tensor)]
    return out


def _micro(meter: StorageMeter, stage, inp, labels, grad_out) -> tuple:
    """(kept, forward peak, backward peak, output) of one micro-batch's forward and backward."""
    with meter:
        meter.restart_peak()
        base = meter.current
        out = stage(inp)
        loss = loss_of(out, labels) if grad_out is None else None
        kept, forward = meter.current - base, meter.peak - base
        meter.restart_peak()
        if loss is None:
            torch.autograd.backward([out], [grad_out])
        else:
            loss.backward()
        backward = meter.peak - base
    return kept, forward, backward, out.detach()


def measure_stages(profile, stages: Sequence[Sequence[str]], n: int, t: int, strided: bool) -> List[StageMemory]:
    """:class:`StageMemory` of every stage (``stages``: unit paths) at ``n`` samples, ``t`` steps."""
    from ..core.parallelize.pipeline import PipelineStageModule

    key = (tuple(map(tuple, stages)), n, t, strided)
    if key in profile.stage_memory:
        return profile.stage_memory[key]
    x, y = batch_slice(profile.example_input, profile.labels, n, t)
    x = x.to(profile.dtype)
    if strided:  # a slice of a larger batch on dim 1, as torch's split gives the first stage
        x = torch.cat([x, x], dim=1)[:, :n]
    out: List[StageMemory] = []
    for i, paths in enumerate(stages):
        stage = PipelineStageModule(i, paths, [profile.model.get_submodule(p) for p in paths])
        inp = x if i == 0 else x.detach().requires_grad_()
        grad_out: Optional[torch.Tensor] = None
        if i < len(stages) - 1:
            with torch.no_grad():
                grad_out = torch.ones_like(stage(inp))
        params = [p for p in stage.parameters() if p.requires_grad]
        # one meter over all three micro-batches: what one leaves and the next frees is counted off
        meter = StorageMeter()
        meter.track([inp, grad_out] + list(stage.parameters()) + [p.grad for p in params] + list(stage.buffers())
                    + _held(stage))
        _micro(meter, stage, inp, y, grad_out)  # warm-up
        for p in params:
            p.grad = None
        inp.grad = None
        kept, forward, first, _ = _micro(meter, stage, inp, y, grad_out)
        grad_input = _bytes([inp.grad])
        inp.grad = None
        _, _, after, x = _micro(meter, stage, inp, y, grad_out)
        grads = _bytes(p.grad for p in params)
        out.append(StageMemory(kept=kept, output=_bytes([x]), grad_input=grad_input, held=_bytes(_held(stage)),
                               forward=forward, backward_first=first, backward_next=after, grads=grads))
        for p in params:
            p.grad = None
    profile.stage_memory[key] = out
    return out
