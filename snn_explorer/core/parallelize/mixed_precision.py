"""A plan's precision applied to a model: autocast around its forward, neuron state in its own dtype,
gradients reduced in the reduce dtype, and a dynamic loss scaler for fp16.

- :func:`autocast_forward` makes every call of a module (the model, or each pipeline stage) run
  under ``torch.autocast`` of the precision's compute dtype; parameters stay fp32 (the master
  weights), so gradients and optimizer state are fp32 too.
- :func:`hold_neuron_state` runs each stateful neuron outside autocast, its floating inputs (and
  snntorch's state buffers) cast to the precision's neuron-state dtype: fp32 keeps a membrane that
  sums small inputs over T exact to fp32's 24 bits; bf16 keeps 8.
- :func:`ddp_reduce_hook` is a DDP communication hook that all-reduces each gradient bucket in
  the reduce dtype (torch's ``bf16_compress_hook`` refuses anything but NCCL); FSDP2 takes
  :func:`fsdp_policy` (:func:`fsdp_norm_policy` for norm layers), pipelines cast their flat gradients themselves.
- :class:`LossScaler`: fp16's loss scaling, with the overflow decision taken over all ranks (a
  sharded or pipelined model holds different gradients on each rank, and a step skipped on one
  rank but taken on another would part the replicas).
"""
from __future__ import annotations

import math
from typing import Iterable, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from ...compat import non_persistent_buffer_names
from ..common.precision import Precision
from ..model import neurons


def _context_hooks(module: nn.Module, make_context) -> None:
    """Enter ``make_context()`` before each call of ``module`` and leave it after (also on an error)."""
    open_contexts: List = []

    def enter(_module, _args):
        context = make_context()
        context.__enter__()
        open_contexts.append(context)

    def leave(_module, _args, _out):
        if open_contexts:
            open_contexts.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def autocast_forward(module: nn.Module, precision: Precision, device_type: str) -> None:
    """Run every call of ``module`` under ``precision``'s autocast on ``device_type`` (no-op for fp32)."""
    if precision.mixed:
        precision.check_device(device_type)
        _context_hooks(module, lambda: precision.autocast(device_type))


def _cast_args(dtype: torch.dtype):
    def cast(module, args):
        if neurons.snn_library(module) == "snntorch":  # its membrane is a buffer the forward adds inputs to
            names = non_persistent_buffer_names(module)
            for name, value in list(module.named_buffers(recurse=False)):
                if name in names and value.is_floating_point() and value.dtype != dtype:
                    setattr(module, name, value.to(dtype))
        return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    return cast


def hold_neuron_state(model: nn.Module, precision: Precision, device_type: str) -> int:
    """Make every neuron of ``model`` compute and keep its state in ``precision.neuron_state_dtype()``,
    outside autocast; returns how many neurons (0 for fp32 plans, which change nothing)."""
    if not precision.mixed:
        return 0
    dtype = precision.neuron_state_dtype()
    count = 0
    for _name, module in model.named_modules():
        if neurons.is_spiking_neuron(module) and neurons.state_kind(module) != neurons.DROPOUT_MASK:
            _context_hooks(module, lambda: torch.autocast(device_type=device_type, enabled=False))
            module.register_forward_pre_hook(_cast_args(dtype))
            count += 1
    return count


def fsdp_policy(precision: Precision) -> MixedPrecisionPolicy:
    """FSDP2's policy: parameters all-gathered in the compute dtype, gradients reduce-scattered in
    the reduce dtype (fp32 plans: torch's defaults, the parameters' own dtype)."""
    if not precision.mixed:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=precision.param_dtype, reduce_dtype=precision.reduce_dtype)


def fsdp_norm_policy(precision: Precision) -> MixedPrecisionPolicy:
    """FSDP2's policy for a norm layer's own unit (``fsdp.fsdp_units_of``): parameters gathered in
    their own dtype (``param_dtype=None``; fp32 masters), as autocast leaves them, so they match the
    running statistics; gradients reduce-scattered in the plan's reduce dtype, as every other unit's.
    Its input is not cast (``cast_forward_inputs=False``): the layer computes on what the layer before
    it gives, as under plain autocast, where torch's batch_norm takes a bf16 / fp16 input with fp32
    weights and statistics and returns the input's dtype."""
    if not precision.mixed:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=precision.reduce_dtype, cast_forward_inputs=False)


def ddp_reduce_hook(reduce_dtype: torch.dtype):
    """A DDP communication hook: each bucket divided by the group size, cast to ``reduce_dtype``,
    all-reduced, and copied back into the (fp32) bucket."""
    def hook(group, bucket):
        group = group if group is not None else dist.group.WORLD
        flat = bucket.buffer()
        sent = flat.to(reduce_dtype).div_(dist.get_world_size(group))
        future = dist.all_reduce(sent, group=group, async_op=True).get_future()

        def unpack(done):
            flat.copy_(done.value()[0])
            return flat
        return future.then(unpack)
    return hook


def reduce_in(flat: torch.Tensor, precision: Precision) -> torch.Tensor:
    """``flat`` in the dtype it is all-reduced in under ``precision`` (itself for fp32 plans)."""
    dtype = precision.reduce_dtype
    return flat if dtype is None or dtype == flat.dtype else flat.to(dtype)


class LossScaler:
    """fp16 dynamic loss scaling (the scheme of ``torch.amp.GradScaler``, whose defaults it keeps):
    the loss is multiplied by ``scale`` before backward; before the optimizer step the gradients are
    divided by it and checked; an inf / NaN on any rank skips the step on every rank and halves the
    scale, ``growth_interval`` clean steps in a row double it."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError(f"LossScaler(init_scale={init_scale}, growth_factor={growth_factor}, backoff_factor="
                             f"{backoff_factor}, growth_interval={growth_interval}): needs init_scale > 0, "
                             "growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1")
        self.scale, self.growth_factor, self.backoff_factor = float(init_scale), growth_factor, backoff_factor
        self.growth_interval, self.clean_steps, self.skipped_steps = growth_interval, 0, 0

    def state_dict(self) -> dict:
        """What a checkpoint keeps (plain JSON): the scale, the clean steps since the last change of it
        (the growth tracker) and the steps skipped so far."""
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`; ValueError naming a missing or bad value."""
        if not isinstance(state, dict) or set(state) != {"scale", "clean_steps", "skipped_steps"}:
            raise ValueError(f"loss scaler state {state!r}; expected a dict of scale, clean_steps, skipped_steps")
        scale, clean, skipped = state["scale"], state["clean_steps"], state["skipped_steps"]
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0 < scale < math.inf):
            raise ValueError(f"loss scaler state scale={scale!r}; expected a finite number > 0")
        for name, value in (("clean_steps", clean), ("skipped_steps", skipped)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"loss scaler state {name}={value!r}; expected an int >= 0")
        self.scale, self.clean_steps, self.skipped_steps = float(scale), clean, skipped

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale(self, params: Iterable[torch.Tensor]) -> bool:
        """Divide every gradient by the scale; whether any rank found an inf or NaN."""
        inv, bad = 1.0 / self.scale, torch.zeros(1)
        for param in params:
            grad = param.grad
            if grad is None:
                continue
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            local.mul_(inv)
            if not bool(torch.isfinite(local).all()):
                bad.fill_(1.0)
        if dist.is_initialized() and dist.get_world_size() > 1:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
            bad = bad.to(device)
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bool(bad.item() > 0)

    def step(self, optimizer, params: Iterable[torch.Tensor]) -> bool:
        """Unscale, then step ``optimizer`` unless a gradient overflowed; update the scale. Returns
        whether the step was taken (the gradients stay for the caller's ``zero_grad``)."""
        if self.unscale(params):
            self.scale *= self.backoff_factor
            self.clean_steps, self.skipped_steps = 0, self.skipped_steps + 1
            return False
        optimizer.step()
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0 and math.isfinite(self.scale * self.growth_factor):
            self.scale *= self.growth_factor
        return True


def loss_scaler_for(precision: Precision) -> Optional[LossScaler]:
    """A :class:`LossScaler` for precisions that need one (fp16), else None."""
    return LossScaler() if precision.needs_loss_scaler else None
