"""Activation offload: the tensors autograd saves for backward kept in host memory between forward and backward.

With a plan's ``activation_offload=True`` every forward of the model runs under
``torch.autograd.graph.saved_tensors_hooks``: the pack hook copies each saved tensor to host memory
(pinned, so the copy can run beside compute) and drops the device copy once nothing else holds it; the
unpack hook copies it back to the device for the backward of the operator that saved it. Parameters (and
other leaves that need a gradient) are left where they are: they stay on the device anyway. Values,
dtype, shape and strides come back unchanged, so gradients are bit-identical; what the lever buys is
device memory (the saved activations), what it costs is two copies over the host link per step.

It needs CUDA ranks (on a CPU rank the saved tensors are in host memory already: apply refuses, like
``cpu_offload``), and it is not combined with activation checkpointing, spike compression (both also
decide what is saved), tensor parallelism or pipeline stages yet: refused at plan time.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch
from torch import nn

from ..common.vocabulary import Checkpointing

__all__ = ["check_activation_offload", "check_activation_offload_device", "apply_activation_offload",
           "offload_hooks", "to_host", "to_device"]

_HOOKS = "_snn_activation_offload"


def _kept(t: torch.Tensor) -> bool:
    """Whether ``t`` stays where it is: a leaf that needs a gradient (a parameter), alive on the device anyway."""
    return t.requires_grad and t.grad_fn is None


def to_host(t: torch.Tensor) -> Any:
    """The pack hook: ``t`` copied to (pinned) host memory with its strides, or ``t`` itself for a parameter."""
    if _kept(t) or t.device.type == "cpu":
        return t
    host = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu", pin_memory=True)
    host.copy_(t, non_blocking=True)
    return t.device, host


def to_device(packed: Any) -> torch.Tensor:
    """The unpack hook: the saved tensor back on its device (``packed`` from :func:`to_host`)."""
    if isinstance(packed, torch.Tensor):
        return packed
    device, host = packed
    return host.to(device, non_blocking=True)


def offload_hooks(model: nn.Module, pack=to_host, unpack=to_device) -> Tuple[Any, Any]:
    """Run every forward of ``model`` under ``saved_tensors_hooks(pack, unpack)`` (entered by a forward
    pre-hook, left by a forward hook that runs also when the forward raises); returns the two handles."""
    def enter(module: nn.Module, _args) -> None:
        context = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        context.__enter__()
        module.__dict__.setdefault(_HOOKS, []).append(context)

    def leave(module: nn.Module, _args, _output) -> None:
        module.__dict__[_HOOKS].pop().__exit__(None, None, None)

    return (model.register_forward_pre_hook(enter),
            model.register_forward_hook(leave, always_call=True))


def apply_activation_offload(model: nn.Module, plan: Any) -> None:
    """Offload ``model``'s saved activations to host memory when ``plan.activation_offload`` says so."""
    if plan.activation_offload:
        offload_hooks(model)


def check_activation_offload(plan: Any) -> None:
    """The plan-time checks of ``activation_offload``: a bool, behind its gate, on plans it is tested with."""
    if type(plan.activation_offload) is not bool:
        raise TypeError(f"activation_offload must be a bool, got {plan.activation_offload!r}")
    if not plan.activation_offload:
        return
    if not plan.experimental_features.allow_cpu_offload:
        raise ValueError("activation_offload=True needs DistributedFeatureSet(allow_cpu_offload=True)")
    clashes = [name for name, on in (("activation_checkpointing", plan.activation_checkpointing != Checkpointing.NONE),
                                     ("spike_compression", plan.spike_compression),
                                     ("tensor parallelism (tp > 1)", plan.tp_size > 1),
                                     ("pipeline stages (mode 'pp')", plan.uses_pp)) if on]
    if clashes:
        raise ValueError(f"activation_offload=True is not combined with {', '.join(clashes)} yet (its "
                         "equivalence is untested there); use it alone on a dp / ddp / fsdp2 plan, or turn "
                         "activation_offload off")


def check_activation_offload_device(plan: Any, device_type: str) -> None:
    """Activation offload copies saved tensors from an accelerator to host memory: refuse it on CPU ranks."""
    if plan.activation_offload and device_type != "cuda":
        raise ValueError(f"activation_offload=True keeps saved activations in host memory between forward and "
                         f"backward; on device_type={device_type!r} they are in host memory already, so there is "
                         "nothing to offload: use cuda ranks (NCCL) or activation_offload=False")
