"""The training step that the profile and measure() both run, so their numbers describe the same work."""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Tuple

import torch
from torch import nn

from ...core import SNNDistributedPlan, SNNDistributedRuntime
from ...core.common import check_batch_tensor, check_dtype, check_instance
from ...core.model import TIME_MAJOR, DataLayout, detect_layout, layout_of, reset_all
from ...core.model.layouts import model_output

#: The attribute naming the :class:`DataLayout` a private model copy of the estimator runs in (set on
#: the profile's copy; deep copies of it, TP replicas and checkpointed copies, inherit it).
RUN_LAYOUT = "_snn_explorer_run_layout"


@dataclass(frozen=True)
class OptimizerKind:
    """An optimizer the estimator plans and measure() runs: its torch class and arguments, the state
    tensors it keeps per parameter (each the parameter's size) and whether it keeps a step counter."""

    name: str
    cls: type
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    state_tensors: int = 0
    counts_steps: bool = False

    def make(self, params, lr: float) -> torch.optim.Optimizer:
        return self.cls(params, lr=lr, **self.kwargs)


#: Every optimizer by name (Adam's and AdamW's exp_avg and exp_avg_sq; SGD's momentum buffer).
OPTIMIZERS = {kind.name: kind for kind in (
    OptimizerKind("adam", torch.optim.Adam, state_tensors=2, counts_steps=True),
    OptimizerKind("adamw", torch.optim.AdamW, state_tensors=2, counts_steps=True),
    OptimizerKind("sgd", torch.optim.SGD),
    OptimizerKind("sgd_momentum", torch.optim.SGD, {"momentum": 0.9}, state_tensors=1),
)}


def check_optimizer(name: str) -> str:
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer={name!r}; expected one of {tuple(OPTIMIZERS)}")
    return name


def check_inputs(model: nn.Module, example_input, labels, dtype=None, plan=None,
                 layout: DataLayout = TIME_MAJOR) -> None:
    """The arguments every estimate and measurement shares, each refused with its own message;
    ``example_input`` is read in ``layout``."""
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
    n = layout.samples(example_input)
    if labels.dim() == 0 or labels.shape[0] != n:
        other = example_input.shape[layout.time_dim]
        hint = (f"; dim {layout.time_dim} holds {other}: is the data layout other than {layout.name}? (pass "
                "layout=, e.g. snn_explorer.core.model.layouts.BATCH_MAJOR)" if labels.dim() and labels.shape[0] == other
                else "")
        raise ValueError(f"labels of shape {tuple(labels.shape)} do not match example_input "
                         f"{tuple(example_input.shape)}: expected [N] (or [N, C]) with N={n} samples (dim "
                         f"{layout.batch_dim} of data layout {layout}){hint}")


#: Layouts found per model object, per (input shape, labels' N, stated layout): detection runs the model once.
_FOUND: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def resolve_layout(model: nn.Module, example_input: torch.Tensor, labels=None, plans=(),
                   layout=None) -> Tuple[DataLayout, str]:
    """``(layout, how it was found)`` of ``example_input`` for ``model``: ``layout`` or the plans'
    ``data_layout`` (ValueError when they differ), checked against the labels; else detected
    (:func:`~snn_explorer.core.model.layouts.detect_layout`: the labels' N against dims 0 and 1, the output's
    dims from one eval run; time-major assumed, and said so, when N and T have one size)."""
    stated = {p.data_layout for p in plans if p.data_layout is not None}
    if layout is not None:
        stated.add(layout_of(layout))
    if len(stated) > 1:
        raise ValueError(f"data layouts disagree: {sorted(str(s) for s in stated)} (layout= and the plans' "
                         "data_layout must name one)")
    given = next(iter(stated), None)
    n = labels.shape[0] if isinstance(labels, torch.Tensor) and labels.dim() else None
    key = (tuple(example_input.shape), n, given)
    found = _FOUND.setdefault(model, {})
    if key not in found:
        found[key] = detect_layout(model, example_input, reset_all, labels, data_layout=given, assume="time_major")
    return found[key]


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


def input_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The batch ``x`` in the run's float ``dtype``; integer inputs (token ids) stay as they are."""
    return x.to(dtype) if x.is_floating_point() else x


def _check_output(outputs) -> torch.Tensor:
    """The output tensor estimate and measure take: the tensor, or a tuple's spikes (:func:`model_output`)."""
    return model_output(outputs)


def loss_of(outputs: torch.Tensor, labels: Optional[torch.Tensor], layout: DataLayout = TIME_MAJOR) -> torch.Tensor:
    """Cross-entropy of the time-mean output when ``labels`` are given (of every position's scores for a
    language model's next-token ``labels``: :func:`token_cross_entropy`), else the mean square output;
    the output's N and T where ``layout`` puts them."""
    outputs = _check_output(outputs)
    if outputs.dtype in (torch.bfloat16, torch.float16):  # mixed precision: the loss in fp32, as the runtime's
        outputs = outputs.float()
    if labels is None:
        return outputs.square().mean()
    if is_token_labels(outputs, labels):
        return token_cross_entropy(outputs, labels, layout)
    outputs, labels = SNNDistributedRuntime.prepare_classification_output(outputs, labels, layout=layout)
    return nn.functional.cross_entropy(outputs, labels)


def is_token_labels(outputs: torch.Tensor, labels: torch.Tensor) -> bool:
    """Whether ``labels`` are a language model's next-token ids ``[N, S]`` for scores ``[T, N, S, V]``."""
    return labels.dim() >= 2 and not labels.is_floating_point() and outputs.dim() == labels.dim() + 2


def token_cross_entropy(outputs: torch.Tensor, labels: torch.Tensor, layout: DataLayout = TIME_MAJOR) -> torch.Tensor:
    """Cross-entropy of every position's scores against ``labels`` ``[N, S]``: of the time-mean scores, one
    step's taken as they are (torchtitan's loss: ``cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))``)."""
    time_dim = 0 if layout.output == "time_major" else 1
    scores = outputs.select(time_dim, 0) if outputs.shape[time_dim] == 1 else outputs.mean(time_dim)
    return nn.functional.cross_entropy(scores.flatten(0, -2), labels.flatten())


def run_layout(model: nn.Module) -> DataLayout:
    """The layout a private model copy runs in (:data:`RUN_LAYOUT`; time-major when unset)."""
    return getattr(model, RUN_LAYOUT, TIME_MAJOR)


def forward_loss(model: nn.Module, inputs: torch.Tensor, labels: Optional[torch.Tensor],
                 layout: Optional[DataLayout] = None) -> torch.Tensor:
    """Reset every stateful neuron, run the model on ``inputs`` as ``layout`` (default: the model
    copy's :func:`run_layout`) says, and return the loss."""
    layout = run_layout(model) if layout is None else layout
    reset_all(model)
    return loss_of(layout.run(model, inputs), labels, layout)


def batch_slice(example_input: torch.Tensor, labels: Optional[torch.Tensor], n: int, t: int, start: int = 0,
                layout: DataLayout = TIME_MAJOR):
    """``n`` samples from ``start`` and ``t`` steps of ``example_input`` ``[T, N, ...]`` (indices
    wrap), as fresh tensors, the batch in ``layout`` (``[N, T, ...]`` for batch-major models)."""
    steps = torch.arange(t) % example_input.shape[0]
    samples = (torch.arange(n) + start) % example_input.shape[1]
    x = layout.from_time_major(example_input[steps][:, samples]).contiguous()
    y = None if labels is None else labels[samples].contiguous()
    return x, y

