"""The training step that the profile and measure() both run, so their numbers describe the same work."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ...core import SNNDistributedPlan, SNNDistributedRuntime
from ...core.neurons import reset_all
from ...core.validate import check_batch_tensor, check_dtype, check_instance

OPTIMIZERS = {
    "adam": (torch.optim.Adam, {}),
    "adamw": (torch.optim.AdamW, {}),
    "sgd": (torch.optim.SGD, {}),
    "sgd_momentum": (torch.optim.SGD, {"momentum": 0.9}),
}


def check_optimizer(name: str) -> str:
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer={name!r}; expected one of {tuple(OPTIMIZERS)}")
    return name


def check_inputs(model: nn.Module, example_input, labels, dtype=None, plan=None) -> None:
    """The arguments every estimate and measurement shares, each refused with its own message."""
    check_instance("model", model, nn.Module, "a torch.nn.Module")
    if plan is not None:
        check_instance("plan", plan, SNNDistributedPlan, "an SNNDistributedPlan (from plan() or "
                       "SNNDistributedPlan.from_dict)")
    check_batch_tensor("example_input", example_input)
    check_dtype("dtype", dtype)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters (none requires grad); estimate and measure "
                         "describe a training step")
    if labels is None:
        return
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor [N] of class indices (or None), got {type(labels).__name__}")
    n = example_input.shape[1]
    if labels.dim() == 0 or labels.shape[0] != n:
        raise ValueError(f"labels of shape {tuple(labels.shape)} do not match example_input "
                         f"{tuple(example_input.shape)}: expected [N] (or [N, C]) with N={n} samples")


def run_dtypes(model: nn.Module, dtype: Optional[torch.dtype], example_input: torch.Tensor):
    """``(dtype to cast the model to, or None to keep its own; dtype of the input batch)``.

    An explicit ``dtype`` casts both. Without one, a model with one floating dtype runs in it; a
    model that mixes dtypes (float32 and float64 layers) runs as it is, as ``apply`` runs it,
    with the input in its first parameter's dtype.
    """
    if dtype is not None:
        return dtype, dtype
    floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
    first = floats[0] if floats else (example_input.dtype if example_input.is_floating_point() else torch.float32)
    return (first if len(set(floats)) <= 1 else None), first


def _check_output(outputs) -> torch.Tensor:
    if not isinstance(outputs, torch.Tensor):
        raise TypeError(f"the model returned a {type(outputs).__name__}, not a tensor; estimate and measure need "
                        "a forward that returns one tensor (e.g. [T, N, C] spikes or scores)")
    return outputs


def loss_of(outputs: torch.Tensor, labels: Optional[torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of the time-mean output when ``labels`` are given, else the mean square output."""
    outputs = _check_output(outputs)
    if outputs.dtype in (torch.bfloat16, torch.float16):  # mixed precision: the loss in fp32, as the runtime's
        outputs = outputs.float()
    if labels is None:
        return outputs.square().mean()
    outputs, labels = SNNDistributedRuntime.prepare_classification_output(outputs, labels)
    return nn.functional.cross_entropy(outputs, labels)


def forward_loss(model: nn.Module, inputs: torch.Tensor, labels: Optional[torch.Tensor]) -> torch.Tensor:
    """Reset every stateful neuron, run the model on ``[T, N, ...]`` and return the loss."""
    reset_all(model)
    return loss_of(model(inputs), labels)


def batch_slice(example_input: torch.Tensor, labels: Optional[torch.Tensor], n: int, t: int, start: int = 0):
    """``n`` samples from ``start`` and ``t`` steps of ``[T, N, ...]`` (indices wrap), as fresh tensors."""
    steps = torch.arange(t) % example_input.shape[0]
    samples = (torch.arange(n) + start) % example_input.shape[1]
    x = example_input[steps][:, samples].contiguous()
    y = None if labels is None else labels[samples].contiguous()
    return x, y
