"""balanced_pp_plan(): a pipeline plan whose stages the model's profile balances."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

from ..core.model import pipeline_units, shared_parameters, trainable_units
from ..core.planning import balanced_layout, check_pp_model, layout_text, whole_cuts
from .memory.pipeline_memory import under
from .profile.profiling import model_profile


def balanced_pp_plan(model, plan, example_input, labels=None):
    """``plan`` (mode ``pp``) with its ``pp_layout`` balanced by the model's profile (:func:`layout_by_profile`),
    every stage holding a trainable unit; ValueError when no such layout exists or it would split a tied
    parameter over stages."""
    if not plan.uses_pp:
        raise ValueError(f"balanced_pp_plan balances pipeline stages; {plan!r} has none")
    profile = model_profile(model, example_input, labels, layout=plan.layout)
    units = pipeline_units(model)[0]
    trainable = trainable_units(model, units)
    layout = layout_by_profile(profile, plan, units, profile.example_input.shape[0], trainable)
    balanced = dataclasses.replace(plan, pp_layout=layout)
    check_pp_model(balanced, units, shared=shared_parameters(model), trainable=trainable)
    return balanced


def layout_by_profile(profile, plan, units: Sequence[str], t: int, trainable: Optional[Sequence[str]] = None) -> str:
    """A ``pp_layout`` balancing the stages by what the profile measured per unit: the bytes each unit
    saves for backward plus its parameters (memory), and its input and output elements (a proxy
    for its time, which the profile does not time), each as a share of the model's total; with
    ``trainable`` (unit paths) every stage holds one of them (ValueError when it cannot); under TP
    (mode ``pp_tp``) a stage ends only after a unit whose output is whole."""
    n = max(1, plan.per_rank_batch // (plan.pp_microbatches or 1))
    memory, work = [], []
    for unit in units:
        mods = [m for name, m in profile.modules.items() if name and under(name, [unit])]
        params = sum(math.prod(shape) for name, shape in profile.params if under(name, [unit]))
        memory.append(sum(m.saved(n, t) for m in mods) + params)
        work.append(profile.modules[unit].in_elems(n, t) + profile.modules[unit].out_elems(n, t) + params)
    total_m, total_w = sum(memory) or 1.0, sum(work) or 1.0
    costs = [m / total_m + w / total_w for m, w in zip(memory, work)]
    eligible = None if trainable is None else [u in trainable for u in units]
    cuts = whole_cuts(plan.tensor_parallel_plan, units) if plan.uses_tp else None  # 3-D: stages send whole tensors
    return layout_text(balanced_layout(costs, plan.pp_stages, eligible, cuts))
