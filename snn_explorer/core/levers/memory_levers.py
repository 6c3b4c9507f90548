"""Memory levers of a plan: activation checkpointing, FSDP2 CPU offload, spike compression, checked at plan time.

``activation_checkpointing`` names the granularity of recomputation:

- ``"none"``: every layer keeps what its backward needs (the default);
- ``"blocks"``: the model's blocks (the FSDP2 units, each with the parameter-free modules that
  follow it in its ``nn.Sequential``: its neurons, dropout) keep only their inputs and a copy of
  their neurons' entry state, and run their forward again in backward; ``checkpoint_every=k``
  checkpoints every k-th block (the first, the (k+1)-th, ...);
- ``"time_chunks"``: for a model whose ``forward`` calls one module once per time step
  (``time_step_module``), each step keeps its input, each chunk of ``checkpoint_every`` steps a
  copy of the neuron state at its start, and backward recomputes the steps;
- ``"ops"``: torchtitan's op-level selective checkpointing (its ``selective`` option ``op``): every
  repeated block (a transformer's layers, not its embedding or output layer, as torchtitan wraps
  ``model.layers``) keeps the outputs of its expensive operators -- matrix products (but every second one),
  attention kernels, reduce-scatters: the policy object
  :data:`~.parallelize.saved_ops.TORCHTITAN_OPS` -- and recomputes the rest in backward (with a copy
  of its neurons' entry state, as ``"blocks"``). It applies to every block (``checkpoint_every=1``);
  torchtitan's "selective layer" option is ``"blocks"`` with ``checkpoint_every=k``. It is taken when
  asked for, never enumerated or chosen by the memory objective (:func:`checkpointing_variants`).

``cpu_offload`` keeps FSDP2's sharded parameters, gradients and optimizer state in CPU memory
(``torch.distributed.fsdp.CPUOffloadPolicy``); it needs a mode that uses FSDP2 and CUDA ranks.
``spike_compression`` keeps the 0/1 tensors saved for backward as bits (:mod:`.spike_compression`);
``activation_offload`` keeps them in host memory until backward (:mod:`.activation_offload`, CUDA ranks).
All of it is gated by :class:`~snn_explorer.core.planning.plan_types.DistributedFeatureSet`.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import nn

from ..common.modes import names_text
from ..common.vocabulary import Checkpointing
from ..model import neurons
from ..model.model_memo import remembered_for
from .activation_offload import check_activation_offload
from .block_choice import block_label, check_block_choice
from .spike_compression import check_spike_compression

#: The granularities of ``SNNDistributedPlan.activation_checkpointing`` (:class:`~.vocabulary.Checkpointing`).
ACTIVATION_CHECKPOINTING = Checkpointing.names()


def remembered(peak_estimate: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``peak_estimate`` estimating each plan once: the one memo of the lever searches (the planner's ``memory``
    objective, ``fit_budget``), whose block choice and lever choice ask for some plans again."""
    seen: dict = {}

    def remember(plan: Any) -> Any:
        if plan not in seen:
            seen[plan] = peak_estimate(plan)
        return seen[plan]

    return remember


def check_checkpoint_every(checkpoint_every: Any, allow_none: bool = False) -> None:
    """``checkpoint_every`` is an int >= 1 (or, with ``allow_none``, None: k chosen by the objective's estimate)."""
    if allow_none and checkpoint_every is None:
        return
    if type(checkpoint_every) is not int or checkpoint_every < 1:
        raise ValueError(f"checkpoint_every={checkpoint_every!r} must be an int >= 1 (checkpoint every k-th block or "
                         "chunk k time steps)" + (", or None to let the objective choose k by estimate (1 with an "
                                                  "explicit activation_checkpointing)" if allow_none else ""))


def check_memory_levers(plan: Any) -> None:
    """Raise ValueError / TypeError for memory-lever fields of ``plan`` that do not go together."""
    granularity, every = plan.activation_checkpointing, plan.checkpoint_every
    features = plan.experimental_features
    if granularity not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"activation_checkpointing={granularity!r}; expected one of {ACTIVATION_CHECKPOINTING}")
    check_checkpoint_every(every)
    if granularity == Checkpointing.OPS and every != 1:
        raise ValueError(f"checkpoint_every={every} does not go with activation_checkpointing='ops', which keeps "
                         "the expensive operators' outputs of every block (torchtitan's op policy); leave "
                         "checkpoint_every=1, or checkpoint every k-th block with activation_checkpointing='blocks'")
    if granularity == Checkpointing.NONE and every != 1:
        raise ValueError(f"checkpoint_every={every} has no effect with activation_checkpointing='none'; "
                         "pick 'blocks' or 'time_chunks', or leave checkpoint_every=1")
    if granularity != Checkpointing.NONE and not features.allow_activation_checkpointing:
        raise ValueError(f"activation_checkpointing={granularity!r} needs "
                         "DistributedFeatureSet(allow_activation_checkpointing=True)")
    if granularity != Checkpointing.NONE and plan.uses_pp:
        raise ValueError(f"activation_checkpointing={granularity!r} is not combined with pipeline stages "
                         f"(mode {plan.mode!r}) yet (it may come later; its equivalence is untested); use "
                         "activation_checkpointing='none' with pp, or a dp / tp / fsdp2 / fsdp2_tp plan")
    step_module = plan.time_step_module
    if step_module is not None and (not isinstance(step_module, str) or not step_module):
        raise ValueError(f"time_step_module={step_module!r} must be a module path (a non-empty string) or None")
    if granularity == Checkpointing.TIME_CHUNKS and step_module is None:
        raise ValueError("activation_checkpointing='time_chunks' needs time_step_module, the module the model "
                         "calls once per time step (find_time_step_module(model, example_input) finds it); a "
                         "model that runs all time steps in one call takes activation_checkpointing='blocks'")
    if granularity != Checkpointing.TIME_CHUNKS and step_module is not None:
        raise ValueError(f"time_step_module={step_module!r} is only used by activation_checkpointing="
                         f"'time_chunks', not {granularity!r}")
    check_block_choice(plan)
    if type(plan.cpu_offload) is not bool:
        raise TypeError(f"cpu_offload must be a bool, got {plan.cpu_offload!r}")
    if plan.cpu_offload:
        _check_cpu_offload(plan)
    check_spike_compression(plan)
    check_activation_offload(plan)


def _check_cpu_offload(plan: Any) -> None:
    if not plan.experimental_features.allow_cpu_offload:
        raise ValueError("cpu_offload=True needs DistributedFeatureSet(allow_cpu_offload=True)")
    if not plan.uses_fsdp or plan.uses_pp:  # a pipeline's FSDP2 stages: not offloaded (untested, not estimated)
        raise ValueError(f"cpu_offload=True offloads FSDP2's shards (CPUOffloadPolicy), so it needs "
                         f"{names_text(lambda m: m.fsdp and not m.pp)}, not mode={plan.mode!r}")


def check_time_step_module(analysis: Any, path: Optional[str]) -> None:
    """The plan-time check of ``time_step_module`` against the model's analysis: it must hold neuron state."""
    if path is None:
        return
    inside = [n for n in analysis.memory_module_names if path == "" or n == path or n.startswith(path + ".")]
    if not inside:
        raise ValueError(f"time_step_module={path!r} holds none of the model's stateful neurons "
                         f"{list(analysis.memory_module_names)[:4]}; name the module the model's forward "
                         "calls once per time step (find_time_step_module(model, example_input) finds it)")


def check_cpu_offload_device(plan: Any, device_type: str) -> None:
    """CPU offload moves FSDP2's shards between CPU and an accelerator: refuse it on CPU ranks."""
    if plan.cpu_offload and device_type != "cuda":
        raise ValueError(f"cpu_offload=True keeps FSDP2's shards in CPU memory and copies them to the GPU for "
                         f"each unit; on device_type={device_type!r} the parameters are in CPU memory already, "
                         "so there is nothing to offload (torch's CPUOffloadPolicy() pins memory and fails with 'Cannot "
                         "access accelerator device' without a GPU): use cuda ranks (NCCL) or cpu_offload=False")


def find_time_step_module(model: nn.Module, example_input: torch.Tensor) -> Optional[str]:
    """The module ``model``'s forward calls once per time step, or None for a model that runs all steps in
    one call.

    Runs one forward (on a copy, without gradients) and returns the outermost module that was called more
    than once and holds both parameters and stateful neurons (``"net"`` for the zoo's ``mlp``). Kept per model
    object while its structure stays the same (:func:`~.model_memo.remembered_for`).
    """
    question = ("time step module", tuple(example_input.shape), example_input.dtype, example_input.device.type)
    return remembered_for(model, question, lambda: _stepped_module(model, example_input))


def _stepped_module(model: nn.Module, example_input: torch.Tensor) -> Optional[str]:
    """:func:`find_time_step_module`'s run of a copy of ``model``."""
    probe = neurons.detached_copy(model)
    calls: Counter = Counter()
    handles = [m.register_forward_pre_hook(lambda mod, _args, name=n: calls.update([name]))
               for n, m in probe.named_modules() if n]
    try:
        with torch.no_grad():
            probe(example_input)
    finally:
        for handle in handles:
            handle.remove()
    modules = dict(probe.named_modules())
    stepped = [n for n, c in calls.items() if c > 1 and _holds_params_and_state(modules[n])]
    outermost = [n for n in stepped if not any(n.startswith(o + ".") for o in stepped)]
    return min(outermost, key=lambda n: n.count(".")) if outermost else None


def _holds_params_and_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) and any(neurons.is_stateful(m) for m in module.modules())


def lever_label(plan: Any) -> str:
    """A short label of the plan's memory levers ('' when it uses none): ``+ac:blocks/2``, ``+offload``."""
    parts = []
    if plan.activation_checkpointing != Checkpointing.NONE:
        every = f"/{plan.checkpoint_every}" if plan.checkpoint_every > 1 else ""
        parts.append(f"+ac:{plan.activation_checkpointing}{every}{block_label(plan)}")
    if plan.cpu_offload:
        parts.append("+offload")
    if plan.spike_compression:
        parts.append("+spikes:1bit")
    if plan.activation_offload:
        parts.append("+offload:activations")
    return "".join(parts)


def lever_fields(activation_checkpointing: Optional[str] = Checkpointing.NONE, checkpoint_every: int = 1,
                 cpu_offload: bool = False, time_step_module: Optional[str] = None) -> dict:
    """The plan fields of the memory levers, as ``plan(...)`` passes them on (checked by the plan itself).

    ``activation_checkpointing=None`` (the objective's choice) is ``none`` here: no lever is switched on by a
    rule. The ``memory`` and ``capacity`` objectives switch levers on only by their estimated effect
    (:func:`choose_levers`, with the ``peak_estimate`` given to ``plan``); ``time_step_module`` is kept
    in the plan only with ``time_chunks``.
    """
    if activation_checkpointing is None:  # the choice left open: time_step_module and k only serve the search
        activation_checkpointing, time_step_module, checkpoint_every = Checkpointing.NONE, None, 1
    return dict(activation_checkpointing=activation_checkpointing, checkpoint_every=checkpoint_every,
                cpu_offload=cpu_offload, time_step_module=time_step_module)


def objective_checkpoints(objective: str, features: Any) -> bool:
    """Whether ``activation_checkpointing=None`` lets ``objective`` consider checkpointing: its gate is open and
    the objective is not ``speed`` (only then can the choice need ``time_step_module``)."""
    return objective != "speed" and features is not None and features.allow_activation_checkpointing


def objective_chooses_levers(objective: str, features: Any) -> bool:
    """Whether ``objective`` looks for memory levers (checkpointing, spike compression) when the caller left
    the choice open: it is not ``speed`` and a lever's gate is open."""
    return objective != "speed" and features is not None and (
        features.allow_activation_checkpointing or features.allow_spike_compression)


def checkpointing_variants(plan: Any, time_step_module: Optional[str] = None) -> List[Any]:
    """``plan`` with each checkpointing granularity its gate allows: ``blocks``, and ``time_chunks`` (k=1)
    when ``time_step_module`` names the module stepped once per time step ([] with the gate closed, and for
    pipeline plans, which do not take checkpointing yet)."""
    if (not plan.experimental_features.allow_activation_checkpointing
            or plan.activation_checkpointing != Checkpointing.NONE
            or plan.uses_pp):
        return []
    variants = [dataclasses.replace(plan, activation_checkpointing=Checkpointing.BLOCKS)]
    if time_step_module is not None:
        variants.append(dataclasses.replace(plan, activation_checkpointing=Checkpointing.TIME_CHUNKS,
                                            time_step_module=time_step_module))
    return variants


#: Checkpoint every k-th block / time step for these k: 1 recomputes most and saves most; 2 recomputes half.
CHECKPOINT_EVERY = (1, 2)


def lever_variants(plan: Any, time_step_module: Optional[str] = None,
                   every: Tuple[int, ...] = CHECKPOINT_EVERY, offload: bool = False,
                   shard_offload: Optional[bool] = None, chunk_every: Optional[Tuple[int, ...]] = None) -> List[Any]:
    """``plan`` (without levers) with each combination of memory levers its gates allow: each checkpointing
    granularity (:func:`checkpointing_variants`) for each k of ``every`` (time chunks: of ``chunk_every``, default
    ``every``; the size chosen by estimate, :func:`~.chunk_choice.choose_chunks`), and spike compression alone and
    together with each of those ([] for pipeline plans); with ``offload`` (the caller's hardware has a host
    link to offload over) also activation offload, alone (:func:`activation_offload_variants`); with
    ``shard_offload`` (default: ``offload``; the hardware also states the host's optimizer rate) FSDP2's CPU
    offload alone and with each of the others but activation offload (:func:`fsdp_offload_variants`)."""
    sizes = {Checkpointing.TIME_CHUNKS: every if chunk_every is None else chunk_every}
    checkpointed = [dataclasses.replace(v, checkpoint_every=k) for v in checkpointing_variants(plan, time_step_module)
                    for k in sizes.get(v.activation_checkpointing, every)]
    compressed = spike_compression_variants([plan] + checkpointed)
    shards = fsdp_offload_variants([plan] + checkpointed + compressed) if (
        offload if shard_offload is None else shard_offload) else []
    return checkpointed + compressed + (activation_offload_variants(plan) if offload else []) + shards


def fsdp_offload_variants(plans: List[Any]) -> List[Any]:
    """Each of ``plans`` with ``cpu_offload=True`` (FSDP2's shards, gradients and optimizer state in host memory)
    where its gate allows it: FSDP2 plans that do not pipeline (the estimator models it there)."""
    return [dataclasses.replace(p, cpu_offload=True) for p in plans
            if p.experimental_features.allow_cpu_offload and p.uses_fsdp and not p.uses_pp and not p.cpu_offload]


def activation_offload_variants(plan: Any) -> List[Any]:
    """``plan`` with ``activation_offload=True`` where its gate allows it and it is tested (no other lever,
    no tensor parallelism, no pipeline stages), else []."""
    if (not plan.experimental_features.allow_cpu_offload or plan.uses_pp or plan.tp_size > 1
            or plan.activation_checkpointing != Checkpointing.NONE or plan.spike_compression):
        return []
    return [dataclasses.replace(plan, activation_offload=True)]


def choose_levers(plan: Any, candidates: List[Any], peak_estimate: Callable[[Any], Any]) -> Tuple[Any, str]:
    """The candidate of lowest estimated peak when that is below ``plan``'s own (ties: the faster), else
    ``plan``; and a note that says what was chosen, by how much it lowers the peak and what it costs per step.

    ``peak_estimate(plan)`` returns an object with ``peak_bytes`` and ``step_time_s`` (the estimator's
    ``PlanEstimate``): the core does not estimate, the caller injects the estimator.
    """
    base = peak_estimate(plan)
    best, best_est = plan, base
    for candidate in candidates:
        est = peak_estimate(candidate)
        lower = est.peak_bytes < best_est.peak_bytes
        tie = best is not plan and est.peak_bytes == best_est.peak_bytes and est.step_time_s < best_est.step_time_s
        if lower or tie:
            best, best_est = candidate, est
    tried = ", ".join(sorted({lever_label(c).lstrip("+") for c in candidates})) or "none allowed"
    if best is plan:
        return plan, (f"memory levers: none lowers the estimated peak of {base.peak_bytes} B (tried {tried}), "
                      "so none is on")
    return best, (f"memory levers: {lever_label(best).lstrip('+')} chosen by estimate: peak {best_est.peak_bytes} B "
                  f"against {base.peak_bytes} B without levers, {(best_est.step_time_s - base.step_time_s) * 1e3:+.3f} "
                  f"ms per step (tried {tried})")


def lever_notes(levers: dict) -> List[str]:
    """What a plan with these memory levers should know before it runs (for ``plan.notes``)."""
    notes = []
    if levers["cpu_offload"]:
        notes.append("cpu_offload=True needs CUDA ranks: it keeps FSDP2's shards in CPU memory and copies each "
                     "unit's to the GPU when it runs (apply refuses CPU ranks, whose parameters are in CPU memory "
                     "already).")
    if levers["activation_checkpointing"] != Checkpointing.NONE:
        notes.append(f"activation_checkpointing={levers['activation_checkpointing']!r} recomputes forward work "
                     "in backward: less activation memory for more compute per step.")
    return notes


def copy_without_levers(plan: Any) -> Any:
    """``plan`` with activation checkpointing, CPU offload, spike compression and activation offload off (the same layout otherwise)."""
    return dataclasses.replace(plan, **lever_fields(), spike_compression=False, activation_offload=False,
                               checkpoint_blocks=())


def spike_compression_variants(plans: List[Any]) -> List[Any]:
    """Each of ``plans`` with ``spike_compression=True`` where its gate allows it (not for pipeline plans)."""
    return [dataclasses.replace(p, spike_compression=True) for p in plans
            if p.experimental_features.allow_spike_compression and not p.spike_compression and not p.uses_pp]


__all__: Tuple[str, ...] = ("ACTIVATION_CHECKPOINTING", "check_checkpoint_every", "check_memory_levers", "check_time_step_module",
                            "check_cpu_offload_device", "find_time_step_module", "lever_label", "objective_checkpoints", "objective_chooses_levers", "lever_fields",
                            "lever_notes", "checkpointing_variants", "CHECKPOINT_EVERY", "lever_variants",
                            "choose_levers", "copy_without_levers", "spike_compression_variants",
                            "activation_offload_variants", "fsdp_offload_variants", "remembered")
