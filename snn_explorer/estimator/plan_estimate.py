"""estimate(): per-rank memory and per-step communication of a plan, without running it.

Plans are compared on the same work: ``plan.batch_size`` and ``example_input`` (``[T, N, ...]``)
are the global batch of one optimizer step, which the plan's data-parallel ranks split between
them (tensor-parallel peers see the same samples); every per-rank number is for
``plan.per_rank_batch`` samples.

Parameters, gradients, optimizer state, buffers and collectives are exact shard arithmetic
(:mod:`.memory.sharding`, :mod:`.timing.collectives`). The peak is the rank's persistent memory (parameters, optimizer state,
buffers, input, neuron state) plus the largest of three phases, each measured once per per-rank
batch (and TP layout) on the model as one rank runs it (the unsharded model, or its TP replica):
the forward, the backward (beside the gradients the plan keeps there) and the optimizer step
(Adam's scratch). DDP adds its gradient buckets; for FSDP2 the same run is replayed with FSDP2's
all-gather and reduce-scatter buffers and unsharded parameters (:mod:`.memory.fsdp_timeline`).

On a hardware profile with ``kernel_model`` (the built-in ``RTX-4090-PCIe-noP2P``), the phases and
the step time come instead from the step as that GPU runs it, traced on the meta device at the
rank's size (:mod:`.memory.gpu_trace`: fused neuron kernels, the caching allocator's bytes;
:mod:`.timing.gpu_kernels`: each kernel's roofline and launch); nothing runs at that size here.
Where a fused neuron op autotunes its kernels at their first call (the triton op, :mod:`.memory.fused_neurons`), the
peak is the larger of that and the first step's, which has no optimizer state yet but holds the tuning's transient
(:attr:`~.memory.gpu_trace.GpuStep.tuned`), as ``torch.cuda.max_memory_allocated`` over a run counts it.
A pipeline plan's stages are timed there too, each stage's micro-batch from its own traced kernels
(:func:`~.timing.gpu_kernels.gpu_pipeline_time`), composed by the schedule as on every profile, and
their memory from the same meta copy (:func:`~.memory.gpu_trace.gpu_stage_memory`: fused neurons, the
allocator's bytes) walked through the schedule as on every profile (:mod:`.memory.pipeline_memory`).
"""
from __future__ import annotations

import dataclasses
import functools
import html
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import pandas as pd
import torch
from torch import nn

from ..core import SNNDistributedPlan
from ..core.common import positive_int, positive_number
from ..core.model import DataLayout, pipeline_units
from .calibration import resolve_hardware
from .instruments.isolation import as_found, one_thread
from .instruments.progress_hook import ProgressHook, check_hook
from .instruments.tables import COLLECTIVE_COLUMNS, PER_RANK_COLUMNS
from .memory.activation_offload import offload_seconds, offloaded_profile
from .memory.fsdp_offload import HOST_COLUMNS, check_fsdp_offload_hardware, fsdp_offload_seconds, host_optimizer_seconds
from .memory.fsdp_timeline import FsdpTimeline
from .memory.gpu_trace import check_trace_size, gpu_peaks, gpu_stage_memory, gpu_step
from .memory.pipeline_memory import pipeline_rows
from .memory.sharding import buffer_bytes, dp_roles, local_params, optimizer_temporaries, rank_bytes, reduce_itemsize
from .memory.spike_compression import compressed_profile, spike_saving
from .memory.stage_memory import measure_stages
from .memory.step_peak import dynamic_peak
from .profile.checkpointed import levered_profile, recompute_fraction
from .profile.profiling import ModelProfile, model_profile, plan_profile, run_fits
from .profile.step import check_inputs, check_optimizer, resolve_layout
from .timing.collectives import pipeline_tp_collectives, step_collectives
from .timing.gpu_kernels import gpu_pipeline_time, gpu_plan_time
from .timing.per_step_gathers import per_step_gather_note
from .timing.step_time import plan_time
from .timing.wire_bytes import with_wire_bytes


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:.2f} MiB"


@dataclass(frozen=True)
class PlanEstimate:
    """Estimated per-rank memory (``per_rank``) and per-step collectives (``collectives``) of a plan.

    ``time_steps`` and ``batch_per_rank`` say which work the numbers describe.
    """

    plan: SNNDistributedPlan
    per_rank: pd.DataFrame
    collectives: pd.DataFrame
    verdict: str
    time_steps: int
    optimizer: str
    memory_budget: Optional[int] = None
    time: Optional[pd.DataFrame] = None  # per rank: compute_s, exposed_comm_s, bubble_s, step_s
    hardware: Optional[object] = None  # the HardwareProfile the time was predicted on
    #: mode pp: per pp rank its stages, units, micro-batches in flight and bubble fraction (else None)
    pipeline: Optional[pd.DataFrame] = None

    @property
    def bubble_fraction(self) -> float:
        """The share of a step each rank idles in the pipeline's fill and drain (0 without pipelining)."""
        return float(self.pipeline["bubble_fraction"].iloc[0]) if self.pipeline is not None else 0.0
    #: FLOPs activation checkpointing recomputes per step, as a fraction of one forward (0.0 without it)
    recompute_forward_fraction: float = 0.0
    #: where N and T sit in the model's input and output, and how that was found (given or detected)
    data_layout: Optional[DataLayout] = None
    data_layout_how: str = ""
    #: what the numbers hide, said with their cost (FSDP2's all-gathers repeated at every time step)
    notes: Tuple[str, ...] = ()

    @property
    def batch_per_rank(self) -> int:
        return self.plan.per_rank_batch

    @property
    def peak_bytes(self) -> int:
        return int(self.per_rank["peak_bytes"].max())

    @property
    def activations_bytes(self) -> int:
        """The most bytes a rank keeps saved for backward (and its input), over the ranks."""
        return int(self.per_rank["activations_bytes"].max())

    @property
    def comm_bytes(self) -> int:
        """The buffers of a step's collectives, summed (what the collectives are handed, not what they send)."""
        return int(self.collectives["bytes"].sum()) if len(self.collectives) else 0

    @property
    def wire_bytes(self) -> int:
        """Bytes each rank sends on the wire over a step, by the algorithm its backend runs every collective
        with (:mod:`.timing.wire_bytes`)."""
        return int(self.collectives["wire_bytes"].sum()) if len(self.collectives) else 0

    @property
    def step_time_s(self) -> float:
        """Predicted seconds of one optimizer step (the slowest rank's)."""
        return float(self.time["step_s"].max())

    @property
    def samples_per_s(self) -> float:
        return self.plan.batch_size / self.step_time_s

    def summary(self) -> dict:
        """One row for comparison tables: plan, global and per-rank batch, peak, traffic, verdict."""
        p = self.plan
        return dict(mode=p.mode + ("+zero" if p.uses_zero else ""),
                    mesh=" x ".join(f"{n}={s}" for n, s in zip(p.mesh_dim_names, p.mesh_shape)),
                    batch=p.batch_size, batch_per_rank=p.per_rank_batch, time_steps=self.time_steps,
                    peak_bytes=self.peak_bytes, comm_bytes=self.comm_bytes, wire_bytes=self.wire_bytes,
                    collectives=int(self.collectives["count"].sum()) if len(self.collectives) else 0,
                    step_time_s=self.step_time_s, samples_per_s=self.samples_per_s, verdict=self.verdict)

    def _repr_html_(self) -> str:
        notes = "".join(f"<p>note: {html.escape(n)}</p>" for n in self.notes)
        return (f"<p>{self.plan!r}: {self.verdict}</p>" + notes + self.per_rank.to_html(index=False)
                + self.collectives.to_html(index=False) + self.time.to_html(index=False))


def estimate(model: nn.Module, plan: SNNDistributedPlan, *, example_input: torch.Tensor,
             labels: Optional[torch.Tensor] = None, time_steps: Optional[int] = None, optimizer: str = "adam",
             dtype: Optional[torch.dtype] = None, memory_budget: Optional[int] = None,
             profile: Optional[ModelProfile] = None, hardware=None, layout=None,
             on_progress: Optional[ProgressHook] = None) -> PlanEstimate:
    """Estimate ``plan`` for ``model`` per rank of its mesh, for one optimizer step.

    ``example_input`` ``[T, N, ...]`` stands for the global batch of one optimizer step
    (``plan.batch_size`` samples, which the dp ranks split; TP peers see the same samples); only
    its per-sample shape and dtype matter, ``T`` is the default ``time_steps``. ``labels`` select
    the cross-entropy loss that :func:`measure` uses too (else the mean square output). The unsharded model is measured once (see ``profile``) and the
    measurement is cached, so estimating many plans of one model is fast. ``dtype`` (default:
    the model's; a model that mixes dtypes is run as it is) is the parameter and activation dtype. ``memory_budget`` (bytes per device)
    turns the verdict into fits / does not fit. Every argument is checked before anything runs,
    and a ``time_steps`` whose run cannot fit in this machine's memory is refused (not on a
    ``kernel_model`` profile, which traces the step on the meta device). The caller's
    RNG, environment, temporary directory and thread count are left as they were (the model runs
    on one thread: :func:`~.instruments.isolation.one_thread`).

    ``hardware`` (a :class:`HardwareProfile`, a built-in profile's name, or None for this
    machine's calibration: the first call calibrates (on spawned ranks), and keeps it
    on disk) is where the step time (``time``, ``step_time_s``; :mod:`.timing.step_time`) is predicted.

    ``layout`` (a :class:`~snn_explorer.core.model.layouts.DataLayout`, else the plan's ``data_layout``) says
    where N and T sit in ``example_input`` and the model's output; when neither states it, it is
    detected (:func:`~.profile.step.resolve_layout`). ``data_layout`` and ``data_layout_how`` say which
    and how.

    ``on_progress(done, total, label)`` (:mod:`.instruments.progress_hook`) hears the calibration and
    the profiling when this call makes them (each a phase of its own label).
    """
    optimizer = check_optimizer(optimizer)
    check_hook(on_progress)
    check_inputs(model, example_input, None, dtype, plan)
    if time_steps is not None:
        positive_int("time_steps", time_steps)
    positive_number("memory_budget", memory_budget, allow_none=True, what="bytes per device")
    if profile is not None and not isinstance(profile, ModelProfile):
        raise TypeError(f"profile must be a ModelProfile (from model_profile) or None, got {type(profile).__name__}")
    with as_found(), one_thread():  # detection runs the model once
        layout, how = resolve_layout(model, example_input, labels, (plan,), layout)
    check_inputs(model, example_input, labels, dtype, plan, layout)
    if profile is not None and profile.layout != layout:
        raise ValueError(f"the profile was measured in data layout {profile.layout}, not {layout}")
    t = layout.steps(example_input) if time_steps is None else time_steps
    hardware = resolve_hardware(hardware, on_progress)
    with as_found(), one_thread():  # the runs below draw random numbers and may import torch's compiler
        profile = profile or plan_profile(model, example_input, labels, dtype, layout, plan.precision, plan.uses_fsdp,
                                          on_progress=on_progress)
        result = _estimate(model, plan, example_input, labels, t, optimizer, dtype, memory_budget, profile, hardware)
    return dataclasses.replace(result, data_layout=layout, data_layout_how=how)


def _per_rank(rows, roles, plan: SNNDistributedPlan) -> pd.DataFrame:
    """The per-rank table: rank ``r`` (mesh order dp, tp) gets the row of its dp coordinate's role."""
    dp_of_rank = np.arange(plan.world_size) // plan.tp_size
    role = np.searchsorted(np.asarray(roles), dp_of_rank, side="right") - 1
    table = pd.DataFrame(rows).iloc[role].reset_index(drop=True)
    table.insert(0, "rank", np.arange(plan.world_size))
    return table[list(PER_RANK_COLUMNS)]


def _with_levers(profile, plan, n: int, t: int, hardware, optimizer: str):
    """``(profile of the plan's model with its memory levers, seconds the levers add per step)``:
    checkpointing, spikes saved as bits, FSDP2's shards and saved tensors offloaded to host memory."""
    profile = levered_profile(profile, plan)
    packed = spike_saving(profile, n, t, plan.tensor_parallel_plan, plan.tp_size) if plan.spike_compression else None
    profile = compressed_profile(profile) if packed is not None else profile  # measured with spikes as bits
    extra_s = packed.seconds(hardware) if packed is not None else 0.0
    if plan.cpu_offload:  # FSDP2's shards over the host link (the slowest role's copies: dp rank 0 holds most)
        check_fsdp_offload_hardware(hardware, plan, optimizer)
        extra_s += fsdp_offload_seconds(_params(profile, plan), plan, hardware)
    if plan.activation_offload:  # measured with the saved tensors outside the device's memory
        hardware.require_host_link("activation_offload=True", "copies saved activations")
        profile = offloaded_profile(profile)
        extra_s += offload_seconds(profile.copies(n, t, plan.tensor_parallel_plan, plan.tp_size), hardware)
    return profile, extra_s


def untraced_levers(plan) -> list:
    """The plan's levers the GPU trace does not model yet (host-memory offload, spikes stored as bits): a GPU
    profile estimates such a plan on the operator-count model (its verdict says so)."""
    return [name for name, on in (("activation offload", plan.activation_offload), ("FSDP2 CPU offload",
            plan.cpu_offload), ("spike compression", plan.spike_compression)) if on]


def _params(profile, plan) -> list:
    """The parameters as one rank of ``plan`` holds them (:func:`local_params`)."""
    return local_params(profile.params, plan, profile.param_itemsizes or profile.compute_itemsize, profile.norm_layers)


def _estimate(model, plan, example_input, labels, t, optimizer, dtype, memory_budget, profile, hardware):
    n = plan.per_rank_batch
    profile, extra_s = _with_levers(profile or model_profile(model, example_input, labels, dtype), plan, n, t,
                                    hardware, optimizer)
    # the step (or each pipeline stage) as the GPU runs it (:mod:`.memory.gpu_trace`); the host-memory levers are not
    # traced yet: their plans keep the operator-count model on the GPU profile's rates (said in the verdict)
    gpu = hardware.kernel_model and not untraced_levers(plan)
    if gpu:  # refuses a trace or run too long even shape-only, before anything runs at this size
        check_trace_size(profile, n, t, plan.neuron_backend)
    else:
        run_fits(profile, n, t)
    itemsize = profile.compute_itemsize  # activations sent between ranks: the precision's compute dtype
    params = _params(profile, plan)
    if plan.uses_pp:  # the rank's stages, micro-batches in flight, sends between stages
        units = pipeline_units(model)[0]
        measure = functools.partial(gpu_stage_memory, neuron_backend=plan.neuron_backend) \
            if gpu else measure_stages  # the stages as the GPU runs them, else as here
        rows, collectives, pipeline = pipeline_rows(plan, profile, units, params, t, itemsize, optimizer, measure)
        collectives += pipeline_tp_collectives(plan, profile, units, t, itemsize)  # 3-D: TP inside the stages
        return _finish(plan, pd.DataFrame(rows)[list(PER_RANK_COLUMNS)], collectives, t, optimizer, memory_budget,
                       profile, hardware, pipeline)
    # Activations and temporaries of the forward (the gradients were set to None), of the backward
    # and after it (both beside the gradients): measured on the model as one rank runs it.
    timeline = FsdpTimeline.of(params, plan.dp_size, plan.reshard_after_forward, reduce_itemsize(plan),
                               plan.cpu_offload) if plan.uses_fsdp else None
    step, tuned = None, 0
    if gpu:
        units = {u.path for u in timeline.units if u.path} if timeline else ()
        step = gpu_step(profile, n, t, plan.tensor_parallel_plan, plan.tp_size, plan.neuron_backend, units)
        saved_local, state = step.saved, step.state
        fwd, bwd, after_bwd, fsdp_held = gpu_peaks(step, timeline)
        tuned = step.tuned
    else:
        saved_local, state = profile.saved_and_state(n, t, plan.tensor_parallel_plan, plan.tp_size)
        fwd, bwd, after_bwd, fsdp_held = dynamic_peak(profile, n, t, plan.tensor_parallel_plan, plan.tp_size,
                                                      timeline)
    activations = saved_local + profile.input_bytes(n, t)
    buffers = buffer_bytes(profile.buffers, profile.dtype, plan)
    # DDP's flat gradient buckets are allocated once, every gradient's size, and live through the
    # optimizer step beside the gradients, which are all live at the backward's peak.
    transient = sum(p.numel * p.itemsize for p in params) if plan.uses_ddp else fsdp_held
    static = buffers + profile.input_bytes(n, t) + state
    rows = []  # one per role (dp ranks holding the same shards), then repeated for their ranks
    for dp_rank in dp_roles(params, plan):
        b = rank_bytes(params, plan, dp_rank * plan.tp_size, optimizer)
        scratch = optimizer_temporaries(params, plan, dp_rank * plan.tp_size, optimizer)
        # CPU offload: shards, gradients, optimizer state and its step in host memory (.memory.fsdp_offload); the
        # columns keep their bytes (the optimizer step's time reads them), the device's peak goes without them
        held = dict(b, **dict.fromkeys(HOST_COLUMNS, 0)) if plan.cpu_offload else b
        scratch = 0 if plan.cpu_offload else scratch
        if timeline:  # FSDP2's buffers and gradients are in the replayed phases
            phases = (fwd, bwd, after_bwd + scratch)
        else:
            phases = (fwd + transient, bwd + b["grads_bytes"] + transient,
                      after_bwd + b["grads_bytes"] + transient + scratch)
        peak = held["params_bytes"] + held["optimizer_bytes"] + static + max(phases)
        # the first step, before the optimizer has state: a fused op autotuning its kernels holds a transient
        # (gpu_trace's ``tuned``, the trace's gradients in it; FSDP2's most held buffers stand beside it)
        peak = max(peak, held["params_bytes"] + static + transient + tuned) if tuned else peak
        rows.append(dict(**b, buffers_bytes=buffers, activations_bytes=round(activations),
                         neuron_state_bytes=round(state), transient_bytes=round(transient), peak_bytes=round(peak)))
    per_rank = _per_rank(rows, dp_roles(params, plan), plan)
    # the step with every unit called once: what FSDP2 would gather without a per-step model's repeats
    once = step_collectives(plan, params, profile, 1, itemsize, timeline) if plan.uses_fsdp else None
    return _finish(plan, per_rank, step_collectives(plan, params, profile, t, itemsize, timeline), t, optimizer,
                   memory_budget, profile, hardware, step=step, extra_s=extra_s, timeline=timeline, once=once,
                   host_optimizer_s=functools.partial(host_optimizer_seconds, params, plan, hardware)
                   if plan.cpu_offload else None)


def _finish(plan, per_rank, collective_rows, t, optimizer, memory_budget, profile, hardware,
            pipeline=None, step=None, extra_s: float = 0.0, host_optimizer_s=None, timeline=None,
            once=None) -> PlanEstimate:
    """The estimate with its verdict and step time, from the per-rank table and the collective rows;
    ``extra_s`` is time a lever adds to every rank's step (spike compression's check, pack, unpack; activation
    offload's copies to the host and back); ``once``: the collective rows of the step with every unit called once
    (FSDP2 plans: the note on the gathers repeated at every time step compares with them)."""
    collectives = pd.DataFrame(collective_rows, columns=COLLECTIVE_COLUMNS)
    wire = with_wire_bytes(collectives, plan, hardware)
    notes = () if once is None else tuple(filter(None, [per_step_gather_note(
        plan, wire, pd.DataFrame(once, columns=COLLECTIVE_COLUMNS), hardware, t)]))
    peak = int(per_rank["peak_bytes"].max())
    if memory_budget is None:
        verdict = (f"peak {_mib(peak)} per rank; collectives on {collectives['bytes'].sum() / 2 ** 20:.2f} MiB of "
                   f"buffers per step, {wire['wire_bytes'].sum() / 2 ** 20:.2f} MiB sent on the wire per rank")
        if plan.world_size == 1:
            verdict = f"peak {_mib(peak)}; nothing communicated (one rank)"
    elif peak <= memory_budget:
        verdict = f"fits: peak {_mib(peak)} of a {_mib(memory_budget)} budget per device"
    else:
        verdict = f"does not fit: peak {_mib(peak)} exceeds the {_mib(memory_budget)} budget per device"
    if step is not None:
        time = gpu_plan_time(plan, profile, collectives, per_rank, hardware, optimizer, step, timeline)
        verdict += (f"; as {hardware.name} runs it: {len(step.fused)} neuron layer(s) as fused kernels, "
                    "the allocator's bytes")
    elif plan.uses_pp and hardware.kernel_model:  # each stage's kernels as the GPU runs them
        time = gpu_pipeline_time(plan, profile, collectives, per_rank, hardware, t, optimizer)
        verdict += f"; stages timed as {hardware.name} runs their kernels"
    else:
        time = plan_time(plan, profile, collectives, per_rank, hardware, t, optimizer, host_optimizer_s)
    if hardware.kernel_model and untraced_levers(plan):
        verdict += (f"; {', '.join(untraced_levers(plan))} not in the GPU trace yet: counted by operator, not kernel "
                    "by kernel")
    if hardware.kernel_model and plan.precision.mixed and plan.uses_pp:  # stages: no autocast on meta
        verdict += f"; the stages are traced in {profile.dtype}, their convolutions and matmuls timed in {plan.precision.name}"
    if extra_s:
        time = time.assign(compute_s=time["compute_s"] + extra_s, step_s=time["step_s"] + extra_s)
    return PlanEstimate(plan=plan, per_rank=per_rank, collectives=wire, verdict=verdict, time_steps=t,
                        optimizer=optimizer, memory_budget=memory_budget, time=time, hardware=hardware,
                        pipeline=pipeline, recompute_forward_fraction=recompute_fraction(profile, plan, t), notes=notes)


def estimate_all(model: nn.Module, plans, *, example_input: torch.Tensor, **kwargs) -> pd.DataFrame:
    """:func:`estimate` for each plan; one summary row per plan (incl. global and per-rank batch)."""
    rows = [estimate(model, p, example_input=example_input, **kwargs).summary() for p in plans]
    return pd.DataFrame(rows)
