"""The step function the Explorer trains with when it is given none: its example batch, cross-entropy."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import nn


def example_step(ndigits: Optional[int] = None) -> Callable:
    """A ``launch_plan`` step function (``train_fn(runtime, step, batch, state, inputs, labels)``):
    this dp rank's share of the global batch ``inputs`` and ``labels [N]`` (``runtime.rank_share``: cut
    on the batch dim of the plan's data layout, refused unless it holds the plan's batch size),
    cross-entropy on the outputs averaged over time, an optimizer step; the loss, rounded to
    ``ndigits`` when given. Made inside this function so that it travels to the ranks by value (a rank
    then does not import the notebook layer)."""
    def train_step(runtime, step, batch, state, inputs, labels) -> float:
        share, share_labels = runtime.rank_share(inputs, labels)
        optimizer = state["optimizer"]
        optimizer.zero_grad()
        loss = runtime.train_step(nn.CrossEntropyLoss(), share, share_labels)
        optimizer.step()
        return float(loss.item()) if ndigits is None else round(loss.item(), ndigits)
    return train_step


def example_batch(example_input: Optional[torch.Tensor], labels: Optional[torch.Tensor]) -> Tuple[dict, str]:
    """``train_kwargs`` of :func:`example_step` (the Explorer's example input and labels); ValueError
    saying what is missing."""
    missing = [name for name, value in (("example_input", example_input), ("labels", labels)) if value is None]
    if missing:
        raise ValueError(f"training without a train_fn uses the Explorer's example batch, but its {' and '.join(missing)} "
                         "is None; give Explorer(model, example_input=[T, N, ...], labels=[N]) or pass your own "
                         "train_fn(runtime, step, batch, state, **train_kwargs)")
    if labels.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) or labels.dim() != 1:
        raise ValueError(f"the example step uses cross-entropy on class indices, but labels are "
                         f"{labels.dtype} of shape {tuple(labels.shape)}; pass your own train_fn for other losses")
    return {"inputs": example_input, "labels": labels}
