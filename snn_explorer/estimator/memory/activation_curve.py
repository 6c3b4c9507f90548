"""Activation memory of one rank against the number of time steps, with and without checkpointing."""
from __future__ import annotations

from typing import Sequence

import pandas as pd

from ...core.common import Checkpointing, positive_int
from ...core.levers import checkpointing_variants, copy_without_levers
from ..profile.checkpointed import held_after_forward, levered_profile
from ..profile.profiling import ModelProfile
from ..profile.step import batch_slice

CURVE_COLUMNS = ("time_steps", "plan", "activations_bytes")


def activation_curve(profile: ModelProfile, plan, time_steps: Sequence[int], time_step_module=None) -> pd.DataFrame:
    """Bytes a forward of one rank of ``plan`` leaves alive for its backward besides neuron state (what autograd
    and the checkpoints hold, and the input), measured alike with and without checkpointing, at each
    of ``time_steps``: ``plan`` without checkpointing, and with each granularity its gate allows (``plan``'s own
    when it has one). Rows: ``time_steps``, ``plan`` (the granularity), ``activations_bytes``."""
    plain = copy_without_levers(plan)
    levered = [plan] if Checkpointing(plan.activation_checkpointing).recomputes else checkpointing_variants(plain, time_step_module)
    if not levered:
        raise ValueError("the plan's DistributedFeatureSet closes allow_activation_checkpointing: there is no "
                         "checkpointed curve to compare")
    rows = []
    for t in (positive_int("time_steps", t) for t in time_steps):
        x, y = batch_slice(profile.example_input, profile.labels, plain.per_rank_batch, t, layout=profile.layout)
        _, model = profile.rank_model(plain.tensor_parallel_plan, plain.tp_size)
        rows.append((t, "none", held_after_forward(model, x.to(profile.dtype), y)[0] + x.nbytes))
        for p in levered:
            saved, _ = levered_profile(profile, p).saved_and_state(p.per_rank_batch, t, p.tensor_parallel_plan,
                                                                   p.tp_size)
            rows.append((t, p.activation_checkpointing, saved + x.nbytes))
    return pd.DataFrame(rows, columns=CURVE_COLUMNS)
