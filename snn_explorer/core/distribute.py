"""apply(): check a plan against the model and process group, then run one function per mode."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .common.vocabulary import NeuronBackend
from .levers.activation_offload import apply_activation_offload, check_activation_offload_device
from .levers.block_choice import check_checkpoint_blocks
from .levers.memory_levers import check_cpu_offload_device
from .levers.spike_compression import apply_spike_compression
from .model.analysis import SNNDistributedAnalysis, analyze
from .model.families import CONTAINERS
from .parallelize.checkpointing import apply_activation_checkpointing
from .parallelize.dp import apply_ddp
from .parallelize.fsdp import apply_fsdp2
from .parallelize.mesh import build_mesh, check_device_type, check_mesh_type, check_process_group, local_device
from .parallelize.mixed_precision import autocast_forward, hold_neuron_state
from .parallelize.pipeline import apply_pp, own_tp_plan, split_stages
from .parallelize.tp import apply_tp
from .planning.pipeline_plan import check_pp_model
from .planning.plan_types import SNNDistributedPlan
from .runtime import SNNDistributedRuntime
from .tp.tp_plan import check_tied_parameters, check_tp_plan


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP / DataParallel wrapper (any other model as it is)."""
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return model.module
    return model


def _already_on(model: nn.Module, device: torch.device) -> bool:
    """Whether every parameter and buffer of ``model`` is on ``device`` (``.to`` would not move any)."""
    wanted = torch.device(device)
    return all(t.device.type == wanted.type and (wanted.index is None or t.device.index == wanted.index)
               for t in list(model.parameters()) + list(model.buffers()))


def preflight(model: nn.Module, plan: SNNDistributedPlan) -> SNNDistributedAnalysis:
    """Everything ``apply`` checks about the model before touching a process group.

    Returns the model's analysis (under the plan's roots). Raises for a plan that does not
    match the model: unknown TP paths, sizes tp does not divide, tied parameters split, missing FSDP
    units.
    """
    if not isinstance(plan, SNNDistributedPlan):
        raise TypeError(f"plan must be an SNNDistributedPlan, got {type(plan).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    analysis = analyze(model, model_family=plan.model_family, roots=plan.tensor_parallel_roots)
    if plan.tensor_parallel_plan:
        check_tp_plan(analysis, plan.tensor_parallel_plan, plan.tp_size, plan.experimental_features)
    check_tied_parameters(analysis, plan.tensor_parallel_plan, plan.fsdp_units)
    if plan.uses_pp:
        check_pp_model(plan, analysis.pipeline_units, analysis.pipeline_problem, analysis.shared_parameter_groups,
                       analysis.trainable_units)
        if NeuronBackend(plan.neuron_backend).compiled:
            raise ValueError("neuron_backend='inductor' (torch.compile) with mode 'pp' may come later; use "
                             "neuron_backend='torch'")
    check_checkpoint_blocks(plan.checkpoint_blocks, analysis.fsdp_unit_names)  # the blocks apply_activation_checkpointing names
    modules = dict(model.named_modules())
    missing = [u for u in plan.fsdp_units if u not in modules]
    if missing:
        raise ValueError(f"plan.fsdp_units names {missing}, which are not modules of this model")
    containers = [f"{u} ({type(modules[u]).__name__})" for u in plan.fsdp_units if isinstance(modules[u], CONTAINERS)]
    if containers:
        raise ValueError(f"plan.fsdp_units names {containers}, container(s) with no forward of their own; "
                         "FSDP2 units must be modules that run: name the modules inside them instead")
    return analysis


#: Set on a model that apply() distributed (its parameters are now shards or DDP-wrapped).
_APPLIED = "_snn_explorer_applied"


def _check_not_applied(model: nn.Module) -> None:
    applied = model.__dict__.get(_APPLIED) if isinstance(model, nn.Module) else None
    if applied:
        raise ValueError(f"this model was already distributed by apply() with {applied}; apply a fresh model "
                         "(keep an undistributed copy with copy.deepcopy(model) before apply)")


def _set_neuron_backend(model: nn.Module, backend: str) -> None:
    if not NeuronBackend(backend).fused:
        return
    for name, module in model.named_modules():
        if hasattr(module, "supported_backends") and hasattr(module, "backend"):
            if backend not in module.supported_backends:
                raise ValueError(f"neuron {name!r} supports backends {tuple(module.supported_backends)}, "
                                 f"not {backend!r}")
            module.backend = backend


def apply(*, model: nn.Module, plan: SNNDistributedPlan, device_type: Optional[str] = None, device_mesh=None):
    """Distribute ``model`` in place as ``plan`` says and return an :class:`SNNDistributedRuntime`.

    Call on every rank of an initialised process group whose size is the plan's world size
    (``mode='none'`` needs none). ``device_type`` selects the mesh device ('cuda' or 'cpu'; default:
    the process group's, else CUDA when available). A ``device_mesh`` of your own must carry the
    plan's ``mesh_dim_names`` and ``mesh_shape``.
    """
    model = _unwrap(model)
    check_mesh_type(device_mesh)
    _check_not_applied(model)
    analysis = preflight(model, plan)
    device_type = check_device_type(device_type)
    check_cpu_offload_device(plan, device_type)
    check_activation_offload_device(plan, device_type)
    plan.precision.check_device(device_type)
    check_process_group(plan)
    device = local_device(device_type)
    mesh = build_mesh(plan, device_type, device_mesh)
    if not plan.uses_pp and not _already_on(model, device):  # a pipeline keeps only its own stages on its device
        model.to(device)
    _set_neuron_backend(model, plan.neuron_backend)
    hold_neuron_state(model, plan.precision, device_type)  # before pp copies the units
    if not plan.uses_pp:  # a pipeline runs its stages under autocast instead
        autocast_forward(model, plan.precision, device_type)
    stages = split_stages(model, plan, analysis.pipeline_units, mesh, device) if plan.uses_pp else None
    if plan.uses_tp:  # a pipeline shards only its own stages' layers (the rest is on meta)
        apply_tp(model, mesh["tp"], own_tp_plan(plan, analysis.pipeline_units, mesh) if plan.uses_pp
                 else plan.tensor_parallel_plan)
    apply_activation_checkpointing(model, plan, analysis.fsdp_unit_names)  # TP, then AC, then FSDP2 / DDP
    apply_spike_compression(model, plan)  # hooks around the whole forward: every saved 0/1 tensor
    apply_activation_offload(model, plan)  # the same, every saved activation to host memory
    if plan.uses_fsdp and not plan.uses_pp:  # a pipeline shards each stage over dp (apply_pp)
        apply_fsdp2(model, mesh["dp"], plan.fsdp_units, reshard_after_forward=plan.reshard_after_forward,
                    cpu_offload=plan.cpu_offload, precision=plan.precision)
    wrapped = apply_ddp(model, mesh["dp"], device, plan.precision.reduce_dtype) if plan.uses_ddp else model
    if plan.uses_pp:
        wrapped = apply_pp(model, plan, analysis.pipeline_units, mesh, device, stages)
    if plan.distributed:
        model.__dict__[_APPLIED] = repr(plan)
    if NeuronBackend(plan.neuron_backend).compiled:
        wrapped = torch.compile(wrapped)
    return SNNDistributedRuntime(model=wrapped, mesh=mesh, analysis=analysis, plan=plan, device=device)
