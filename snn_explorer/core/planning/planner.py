"""plan(): fit the recommended strategy to the topology, the model and the feature gates."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Mapping, Optional, Tuple, Union

from ..common.modes import MODE_TABLE, MODES, Mode, mode_of, names_text
from ..common.precision import choose_precision
from ..common.topology import SNNDistributedTopology
from ..common.vocabulary import Checkpointing
from ..levers.block_choice import check_checkpoint_blocks, choose_blocks
from ..levers.chunk_choice import choose_chunks
from ..levers.memory_levers import (
    CHECKPOINT_EVERY,
    check_checkpoint_every,
    check_time_step_module,
    choose_levers,
    lever_fields,
    lever_notes,
    lever_variants,
    objective_checkpoints,
    objective_chooses_levers,
    remembered,
)
from ..model.analysis import SNNDistributedAnalysis
from ..model.families import resolve_family
from ..model.layouts import layout_of
from ..tp.tp_plan import check_tied_parameters, check_tp_plan, default_tp_plan, has_gated_attention, with_local_neurons
from .options import PlanOptions, check_options
from .pipeline_plan import (
    balanced_layout,
    check_pp_model,
    layout_text,
    microbatches_for,
    recommend_pipeline,
    resolve_layout,
    units_problem,
    whole_cuts,
)
from .pipeline_schedules import default_schedule, schedule_of
from .plan_types import DistributedFeatureSet, SNNDistributedPlan
from .recommend import (
    UNSET,
    check_backend,
    check_batch_size,
    check_objective,
    neuron_backend_arg,
    recommend_snn_distributed_strategy,
)

#: Modes tried after the recommendation, per objective, when it does not fit (a mode missing
#: here is tried last).
FALLBACKS = {
    "speed": ("dp", "fsdp2", "fsdp2_tp", "tp"),
    "memory": ("fsdp2_tp", "tp", "fsdp2", "dp", "pp_fsdp2_tp", "pp_fsdp2"),  # pipelines: sharded stages first
    "capacity": ("fsdp2_tp", "tp", "fsdp2", "dp", "pp_fsdp2_tp", "pp_fsdp2"),
}


def check_mode(mode: Any) -> Optional[str]:
    """``mode`` lower-cased and checked against the mode table (None: let the planner choose)."""
    if mode is None:
        return None
    if not isinstance(mode, str):
        raise ValueError(f"mode={mode!r} must be a string, one of {MODES} or None")
    return mode_of(mode.lower()).name


def _tp_modes(noun: bool = True) -> str:
    return names_text(lambda m: m.tp, noun)


def _order(objective: str) -> List[str]:
    listed = list(FALLBACKS[objective])
    return listed + [m.name for m in MODE_TABLE if m.distributed and m.name not in listed]


def _tp_for(mode: Mode, analysis: SNNDistributedAnalysis, topology: SNNDistributedTopology,
            explicit: Optional[Mapping[str, str]], features: DistributedFeatureSet) -> Tuple[dict, Optional[str]]:
    """The TP plan for ``mode`` and the reason it cannot be built (None when it can)."""
    if not mode.tp:
        return {}, None
    tp_plan = with_local_neurons(analysis, explicit) if explicit else default_tp_plan(analysis, features)
    if not tp_plan:
        roots = f" under roots {analysis.tensor_parallel_roots}" if analysis.tensor_parallel_roots else ""
        convs = " (conv layers need allow_experimental_conv_tp=True)" if analysis.conv_shapes else ""
        return {}, (f"mode {mode.name!r} needs tensor-parallel candidates, but analysis found no Linear "
                    f"layer{roots}{convs}")
    try:
        check_tp_plan(analysis, tp_plan, topology.size("tp"), features)
    except ValueError as exc:
        return {}, str(exc)
    return tp_plan, None


def _problem(name: str, analysis, topology, explicit, features) -> Tuple[dict, Optional[str]]:
    mode = mode_of(name)
    problem = mode.topology_problem(topology)
    if problem:
        return {}, problem
    try:
        check_tied_parameters(analysis, fsdp_units=analysis.fsdp_unit_names if mode.fsdp else ())
    except ValueError as exc:
        return {}, str(exc)
    pp_problem = mode.pp and units_problem(analysis.pipeline_units, analysis.pipeline_problem,
                                           topology.size("pp"), f"pp={topology.size('pp')}")
    if pp_problem:
        return {}, pp_problem
    if mode.ddp and analysis.trainable_parameters == 0:
        return {}, ("the model has no trainable parameters, so DDP has no gradients to synchronise (and refuses "
                    "the model); use 'fsdp2' or 'tp' to split it, or 'none' on one process")
    return _tp_for(mode, analysis, topology, explicit, features)


def plan(*, analysis: SNNDistributedAnalysis, objective: str,
         topology: Union[Mapping[str, int], SNNDistributedTopology, int], batch_size: int,
         neuron_backend: str = "torch", model_family: Optional[str] = None, mode: Optional[str] = None,
         features: Optional[DistributedFeatureSet] = None, backend: Any = UNSET,
         options: Optional[PlanOptions] = None) -> SNNDistributedPlan:
    """Choose a mode for ``objective`` on ``topology`` and return a plan that ``apply`` accepts.

    ``batch_size`` is the global batch of one optimizer step; the ``dp`` ranks split it. An
    explicit ``mode`` must fit the topology and model; a recommended one that does not is
    replaced by the objective's next choice, with a note saying why. ``neuron_backend`` (default
    ``"torch"``) is the neuron compute backend (see ``NEURON_BACKENDS``); ``backend`` is its seed name.
    ``options`` (a :class:`~snn_explorer.core.planning.options.PlanOptions`) carries the TP plan, the
    pipeline settings, the memory levers, the precision and the data layout.
    """
    o = check_options(options)
    if not isinstance(analysis, SNNDistributedAnalysis):
        raise TypeError(f"analysis must come from analyze(), got {type(analysis).__name__}")
    objective = check_objective(objective)
    neuron_backend = check_backend(neuron_backend_arg(neuron_backend, backend))
    batch_size = check_batch_size(batch_size)
    topology = SNNDistributedTopology.coerce(topology)
    features = _check_features(features)
    mode = check_mode(mode)
    check_time_step_module(analysis, o.time_step_module)
    check_checkpoint_every(o.checkpoint_every, allow_none=True)
    _check_explicit_tp_plan(o.tensor_parallel_plan, mode)
    notes: List[str] = list(analysis.notes)
    family = _family(analysis, model_family, notes)
    _check_backend_support(neuron_backend, analysis)
    rec = recommend_snn_distributed_strategy(family, world_size=topology.world_size, prefer=objective,
                                             batch_size=batch_size, neuron_backend=neuron_backend,
                                             pipelining_available=topology.size("pp") > 1)
    chosen, tp_plan = _choose_mode(mode, rec.mode, objective, analysis, topology, o.tensor_parallel_plan, features,
                                   o.cpu_offload, notes)
    spec = mode_of(chosen)
    zero = _uses_zero(spec, topology, features, notes)
    notes.extend(_mode_notes(spec, analysis, topology, features, o.tensor_parallel_plan))
    pipeline = _pipeline_fields(analysis, topology, batch_size, notes, o.pp_schedule, o.pp_microbatches,
                                o.pp_virtual_stages, o.pp_layout, tp_plan) if spec.pp else {}
    levers = _levers(spec, o.activation_checkpointing, 1 if o.checkpoint_every is None else o.checkpoint_every,
                     o.cpu_offload, o.time_step_module, notes)
    chosen_precision, precision_note = choose_precision(o.precision, objective, features, spec.fsdp,
                                                        analysis.batchnorm_names)
    notes.extend([precision_note] if precision_note else [])
    plan_ = SNNDistributedPlan(
        mode=chosen, objective=objective, topology=topology, model_family=family,
        neuron_backend=neuron_backend, batch_size=batch_size, optimizer_strategy="zero" if zero else "none",
        memopt_level=0 if spec.pp else rec.memopt_level,  # a pipeline keeps its stages gathered for the step
        rationale=(_rationale(objective, chosen, topology, zero, explicit=mode is not None, recommended=rec.mode),),
        notes=tuple(notes), tensor_parallel_roots=analysis.tensor_parallel_roots,
        tensor_parallel_plan=tp_plan, fsdp_units=analysis.fsdp_unit_names if spec.fsdp else (),
        experimental_features=features, **pipeline, **levers, checkpoint_blocks=o.checkpoint_blocks,
        precision=chosen_precision,
        data_layout=layout_of(o.data_layout) if o.data_layout is not None else analysis.data_layout,
    )
    check_checkpoint_blocks(plan_.checkpoint_blocks, analysis.fsdp_unit_names)
    if spec.pp:
        check_pp_model(plan_, analysis.pipeline_units, analysis.pipeline_problem,
                       analysis.shared_parameter_groups, analysis.trainable_units)
    if o.activation_checkpointing is None and objective_chooses_levers(objective, features):
        every = CHECKPOINT_EVERY if o.checkpoint_every is None else (o.checkpoint_every,)  # an explicit k is kept
        plan_ = _levers_by_estimate(plan_, every, o.time_step_module, o.peak_estimate, analysis.fsdp_unit_names)
    if o.checkpoint_every is not None and plan_.activation_checkpointing == Checkpointing.NONE:
        plan_ = dataclasses.replace(plan_, notes=plan_.notes + (_unused_every_note(o.checkpoint_every, objective,
                                                                                    features, o.activation_checkpointing),))
    return plan_


def _unused_every_note(checkpoint_every: int, objective: str, features, activation_checkpointing) -> str:
    """Why an explicit ``checkpoint_every`` does nothing in a plan that checkpoints nothing."""
    if activation_checkpointing is not None:
        why = f"activation_checkpointing={activation_checkpointing!r}"
    elif not objective_checkpoints(objective, features):
        why = ("the speed objective takes no memory lever" if objective == "speed"
               else "the activation-checkpointing gate is closed")
    else:
        why = "no checkpointing lowered the estimated peak"
    return f"checkpoint_every={checkpoint_every} unused: this plan checkpoints nothing ({why})"


def _levers_by_estimate(plan_: SNNDistributedPlan, every: Tuple[int, ...], time_step_module: Optional[str],
                        peak_estimate: Optional[Callable[[SNNDistributedPlan], Any]],
                        blocks: Tuple[str, ...] = ()) -> SNNDistributedPlan:
    """``plan_`` with the lever combination of lowest estimated peak, if it lowers the peak (:func:`choose_levers`
    over :func:`lever_variants`, every ``every``-th block; the blocks chosen one by one,
    :func:`~.block_choice.choose_blocks` over ``blocks``; time chunks of ``time_step_module`` sized by estimate,
    :func:`~.chunk_choice.choose_chunks`, where ``every`` leaves k open, else every ``every[0]`` steps);
    without ``peak_estimate``, ``plan_`` unchanged with a note (no lever by rule)."""
    candidates = lever_variants(plan_, time_step_module, every)
    if not candidates:
        return plan_
    if peak_estimate is None:
        note = (f"memory levers: none on; the {plan_.objective!r} objective switches one on only where its estimated "
                "effect lowers the peak: pass peak_estimate=snn_explorer.plan_estimator(model, example_input), or "
                "use snn_explorer.fit_budget")
        return dataclasses.replace(plan_, notes=plan_.notes + (note,))
    if not callable(peak_estimate):
        raise TypeError(f"peak_estimate must be a callable plan -> estimate (peak_bytes, step_time_s), got "
                        f"{peak_estimate!r}")
    peak_estimate = remembered(peak_estimate)
    by_chunk = choose_chunks(plan_, time_step_module, peak_estimate) if every == CHECKPOINT_EVERY else None
    if by_chunk is not None:  # the time-chunk candidates at the size the estimate chose (none: no size lowers it)
        chunk_every = (by_chunk.plan.checkpoint_every,) if by_chunk.plan is not None else ()
        candidates = lever_variants(plan_, time_step_module, every, chunk_every=chunk_every)
    by_block = choose_blocks(plan_, blocks, peak_estimate)
    if by_block is not None and by_block.plan is not None:
        candidates = candidates + [by_block.plan]
    chosen, note = choose_levers(plan_, candidates, peak_estimate)
    chunk_notes = (by_chunk.note(peak_estimate(plan_).peak_bytes),) if by_chunk is not None and (
        by_chunk.plan is None or chosen.activation_checkpointing == Checkpointing.TIME_CHUNKS) else ()  # chunks won
    levers = dict(activation_checkpointing=chosen.activation_checkpointing, cpu_offload=chosen.cpu_offload)
    return dataclasses.replace(chosen, notes=plan_.notes + chunk_notes + (note,) + tuple(lever_notes(levers)))


def _levers(spec: Mode, activation_checkpointing, checkpoint_every, cpu_offload, time_step_module,
            notes: List[str]) -> dict:
    """The memory-lever fields of the plan (:func:`~.memory_levers.lever_fields`), their notes added to ``notes``."""
    if spec.pp and activation_checkpointing is None:  # the objective's choice; pipelines take none yet
        activation_checkpointing, time_step_module = Checkpointing.NONE, None
    levers = lever_fields(activation_checkpointing, checkpoint_every, cpu_offload, time_step_module)
    notes.extend(lever_notes(levers))
    return levers


def _check_features(features) -> DistributedFeatureSet:
    features = features if features is not None else DistributedFeatureSet()
    if not isinstance(features, DistributedFeatureSet):
        raise TypeError(f"features must be a DistributedFeatureSet, got {features!r}")
    return features


def _family(analysis: SNNDistributedAnalysis, model_family: Optional[str], notes: List[str]) -> Optional[str]:
    """The model family: the one given (its note added to ``notes``), else the analysis's."""
    if model_family is None:
        return analysis.model_family
    family, family_note = resolve_family(None, model_family)
    notes.extend([family_note] if family_note else [])
    return family


def _check_explicit_tp_plan(tensor_parallel_plan, mode: Optional[str]) -> None:
    if tensor_parallel_plan is None:
        return
    if not isinstance(tensor_parallel_plan, Mapping) or not tensor_parallel_plan:
        raise ValueError(f"tensor_parallel_plan={tensor_parallel_plan!r} must be a non-empty mapping "
                         "module path -> style")
    if mode is not None and not mode_of(mode).tp:
        raise ValueError(f"tensor_parallel_plan is only used by {_tp_modes()}, not mode={mode!r}")


def _choose_mode(mode: Optional[str], recommended: str, objective: str, analysis, topology, explicit_tp,
                 features, cpu_offload: bool, notes: List[str]) -> Tuple[str, dict]:
    """The mode (an explicit one checked; else the recommendation or the objective's next choice that
    fits, with a note saying why) and its TP plan."""
    if mode is not None:
        tp_plan, problem = _problem(mode, analysis, topology, explicit_tp, features)
        if problem:
            raise ValueError(f"mode={mode!r} cannot be applied: {problem}")
        return mode, tp_plan
    order = [recommended] + [m for m in _order(objective) if m != recommended]
    if explicit_tp is not None:
        order = [m for m in order if mode_of(m).tp]
    elif topology.world_size == 1:
        order = ["none"] + [m for m in order if m != "none"]
    if cpu_offload:  # offload moves FSDP2's shards: only FSDP2 modes without pipeline stages can take it
        order = [m for m in order if mode_of(m).fsdp and not mode_of(m).pp]
    reasons = []
    for chosen in order:
        tp_plan, problem = _problem(chosen, analysis, topology, explicit_tp, features)
        if problem is None:
            break
        reasons.append(f"{chosen}: {problem}")
    else:
        restricted = (f" (an explicit tensor_parallel_plan allows only {_tp_modes(noun=False)})"
                      if explicit_tp else "")
        raise ValueError(f"no mode fits topology {dict(topology.dims)} for this model{restricted}: "
                         + "; ".join(reasons))
    if chosen != recommended:
        why = reasons[0].split(": ", 1)[1] if reasons else "an explicit tensor_parallel_plan needs a TP mode"
        notes.append(f"recommended {recommended!r} does not fit ({why}); using {chosen!r}.")
    return chosen, tp_plan


def _uses_zero(spec: Mode, topology, features, notes: List[str]) -> bool:
    """Whether the plan shards the optimizer (ZeRO): its mode allows it on more than one dp rank, and the gate."""
    zero = spec.allows_zero and topology.size("dp") > 1
    if zero and not features.allow_zero_optimizer:
        notes.append("ZeRO optimizer sharding is disabled by DistributedFeatureSet(allow_zero_optimizer=False); "
                     "optimizer_strategy='none'.")
        return False
    return zero


def _mode_notes(spec: Mode, analysis, topology, features, explicit_tp) -> List[str]:
    """What the chosen mode does to attention and BatchNorm, in words."""
    notes = []
    if spec.tp and has_gated_attention(analysis) and not explicit_tp and not features.allow_experimental_spikformer_tp:
        notes.append("attention is not split by heads (separate q/k/v Linears are each sharded with gathered "
                     "outputs); allow_experimental_spikformer_tp=True gives each rank whole heads instead.")
    if analysis.batchnorm_names and spec.splits_batch and topology.size("dp") > 1:
        notes.append(f"{len(analysis.batchnorm_names)} BatchNorm layer(s) normalise over each rank's share of the "
                     "batch in training mode (convert to SyncBatchNorm on CUDA for global statistics).")
    return notes


def _pipeline_fields(analysis: SNNDistributedAnalysis, topology: SNNDistributedTopology, batch_size: int,
                     notes: List[str], schedule, micro, virtual, layout, tp_plan: Mapping[str, str]) -> dict:
    """The pp fields: those given, the rest as ``recommend_pipeline`` picks them for this topology
    (its pp stages, each dp replica's batch), with one stage per rank when the model has too few units."""
    pp, per_replica, units = topology.size("pp"), batch_size // topology.size("dp"), analysis.pipeline_units
    picked = recommend_pipeline(per_replica, pp) or (1, per_replica)
    if virtual is None:
        virtual = picked[0] if schedule is None else _stages_per_rank(schedule_of(schedule), picked[0])
        cuttable = sum(whole_cuts(tp_plan, units)[:-1]) + 1 if tp_plan and units else len(units)
        if virtual * pp > cuttable:
            what = f"{len(units)}" if cuttable == len(units) else \
                f"{len(units)}, which tensor parallelism lets end a stage at {cuttable - 1} place(s)"
            notes.append(f"{virtual} virtual stages per rank need {virtual * pp} pipeline units; the model has "
                         f"{what}, so one stage per rank.")
            virtual = 1
    if micro is None:
        micro = picked[1] if virtual == picked[0] else microbatches_for(per_replica, pp * virtual) or per_replica
    if analysis.batchnorm_names:
        notes.append(f"{len(analysis.batchnorm_names)} BatchNorm layer(s) normalise over each micro-batch, not "
                     "over the whole batch.")
    stages = pp * virtual
    if tp_plan and layout is None and stages <= len(units):  # stages end on whole tensors, even in count
        counts = balanced_layout([1.0] * len(units), stages, cuts=whole_cuts(tp_plan, units))
    else:
        counts = resolve_layout(layout, units, stages) if stages <= len(units) else ()
    return dict(pp_schedule=default_schedule(virtual) if schedule is None else schedule, pp_microbatches=micro,
                pp_virtual_stages=virtual, pp_layout=layout_text(counts))


def _stages_per_rank(schedule, recommended: int) -> int:
    """The stages per rank ``schedule`` runs when the caller left them unset."""
    if not schedule.multi_stage:
        return 1
    return schedule.virtual_stages or max(2, recommended)


def _rationale(objective: str, chosen: str, topology: SNNDistributedTopology, zero: bool, *, explicit: bool,
               recommended: str) -> str:
    """One sentence that explains the plan as it is: why this mode on this mesh for this objective."""
    mesh = " x ".join(f"{n}={s}" for n, s in topology.dims.items())
    spec = mode_of(chosen)
    what = f"{chosen}{'+zero' if zero else ''} on {mesh} {spec.benefit}"
    if zero:
        what += ", and ZeRO shards the optimizer state over dp"
    if explicit:
        return f"{objective}: {what} (mode chosen explicitly)."
    if not spec.distributed:
        return f"{objective}: one process, nothing to distribute."
    goal = {"speed": "the fastest step", "memory": "the least memory per rank",
            "capacity": "the largest model" + ("" if spec.pp else " (pipeline parallelism is not available here, "
                                                                   "so the least memory per rank)")}[objective]
    if chosen != recommended:
        return f"{objective}: for {goal}, {recommended} would come first but does not fit this mesh, so {what}."
    return f"{objective}: for {goal}, {what}."


def _check_backend_support(neuron_backend: str, analysis: SNNDistributedAnalysis) -> None:
    if neuron_backend.fused:
        others = [n for n, lib in analysis.snn_libraries if lib != "spikingjelly"]
        if others:
            raise ValueError(f"neuron_backend={neuron_backend!r} is a spikingjelly neuron backend, but "
                             f"{others[0]!r} is not a spikingjelly neuron; use neuron_backend='torch'")
