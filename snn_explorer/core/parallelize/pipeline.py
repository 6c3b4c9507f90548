"""Pipeline parallelism: the model's units cut into stages, run by torch.distributed.pipelining.

Each rank keeps only its own stages on its device (the other units of its copy of the model go to
the ``meta`` device, which holds no data). torch's schedules (``core.pipeline_schedules``) split every
step's batch into micro-batches **on the batch dim** of the plan's data layout (dim 1 of ``[T, N,
...]``, dim 0 of ``[N, T, ...]``; ``core.layouts``), run them through the stages, and merge the last
stage's outputs on the batch dim of the model's output. A ``per_step`` model's stages run their units
once per time step of the micro-batch ``[T, n, ...]`` and stack the steps (units in a chain, so each
unit seeing all steps in turn computes what the whole model called per step does).

SNN state: a micro-batch is an independent set of samples, so every stage resets its neurons
before each micro-batch's forward (:class:`PipelineStageModule`). Under 1F1B and interleaving a
stage runs the next micro-batch's forward before the previous one's backward; that is safe
because the resets snn_explorer performs (``core.neurons``) *replace* the state tensors (snntorch
``mem = zeros_like(mem)``, spikingjelly's ``_memories[k] = copy``) instead of zeroing them in
place, so the tensors autograd saved for the earlier micro-batch are untouched. A reset function
registered with ``register_stateful`` must do the same.

Data parallelism over ``dp``: after the schedule's step, each stage's gradients are averaged over
its dp replicas with one all-reduce of the flattened gradients. That is simpler and cheaper here
than DDP on the stage module: the schedule calls backward once per micro-batch, and DDP would
all-reduce on every one of them unless each but the last ran under ``no_sync``; the explicit
all-reduce runs exactly once per step, after all micro-batches, whatever the schedule.

FSDP2 over ``dp`` (modes ``pp_fsdp2``, ``pp_fsdp2_tp``): each stage module is ``fully_shard``-ed over the dp
sub-mesh (after TP, so a stage's tp shards become 2-D dp x tp DTensors), the plan's FSDP units inside it first, the stage
module last as the stage's FSDP2 root (the rest of its parameters); torch's ``PipelineStage`` recognises an
FSDP2 module and, as torchtitan runs it, keeps the gathered parameters and unsharded gradients through every
micro-batch but the last backward (no reshard, no gradient sync), then reduce-scatters once per step
(``perform_reduce_grad``). The stages are built with ``reshard_after_forward=False``: one all-gather of every unit
per step instead of one per micro-batch forward (the plan refuses ``memopt_level=1`` here). No dp all-reduce runs.

Tensor parallelism inside the stages (mode ``pp_tp``, mesh pp x dp x tp): the stages' shapes are
taken from the unsharded model (:func:`split_stages`, before TP), then only the rank's own units are
sharded over its tp group; a stage sends whole tensors (the plan refuses a layout that ends a stage on
a shard, ``core.pipeline_plan.check_tp_boundaries``), so every tp peer of a stage receives and sends the
same activations on its own pp group. dp averages the local shards of the gradients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...compat import is_view
from ...compat_pipelining import pipelining
from ..common.precision import FP32, Precision
from ..model import neurons
from ..model.layouts import check_samples
from ..planning.pipeline_plan import resolve_layout, stage_units
from .fsdp import apply_fsdp2
from .mixed_precision import autocast_forward, reduce_in


def run_units(units, x: torch.Tensor, per_step: bool) -> torch.Tensor:
    """``units`` applied in order to ``x``; with ``per_step``, to each step ``x[t]`` of ``[T, n, ...]``, stacked."""
    if per_step:
        return torch.stack([run_units(units, step, False) for step in x.unbind(0)])
    for unit in units:
        x = unit(x)
    return x


class PipelineStageModule(nn.Module):
    """One stage: consecutive units of the user's model (the same module objects), called in order.

    Every call is one micro-batch: the stage first resets all its stateful neurons (replacing their
    state tensors) and counts it in ``resets``. Its input is made contiguous, so every layer sees
    (and saves) one micro-batch-sized copy however it treats strided inputs. With ``own_output``
    (zero-bubble schedules) an output that is a view (a Linear over ``[T, N, F]`` reshapes its
    result) is copied: torch's input backward detaches each stage output in place, which a view
    refuses ("Can't detach views in-place").
    """
    def __init__(self, index: int, paths: Sequence[str], units: Sequence[nn.Module], own_output: bool = False,
                 per_step: bool = False, output_dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.output_dtype = output_dtype  # mixed precision: what the stage sends on (the compute dtype)
        self.index = index
        self.per_step = per_step
        self.paths = tuple(paths)
        self.units = nn.ModuleList(units)
        self.own_output = own_output
        self.resets = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        neurons.reset_all(self)
        self.resets += 1
        x = x.contiguous()  # the first stage's micro-batch is a strided slice of the batch on dim 1
        x = run_units(self.units, x, self.per_step)
        sent = sent_as(x, self.output_dtype)
        if sent is not x:
            return sent
        return x.clone() if self.own_output and is_view(x) else x


def sent_as(x: torch.Tensor, output_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """What a stage sends of its output ``x``: cast to ``output_dtype`` (mixed precision's compute dtype) when
    that is set and ``x`` is a floating tensor of another dtype, else ``x`` itself."""
    if output_dtype is not None and x.is_floating_point() and x.dtype != output_dtype:
        return x.to(output_dtype)
    return x


@dataclass(frozen=True)
class StageConfig:
    """How every pipeline stage is built (:func:`build_stage`), one object for ``apply`` and the estimator's
    stage runs (operator counts, CPU memory, GPU trace), so they all run the stage ``apply`` runs.

    ``per_step``: the data layout runs the units once per time step; ``precision``: the stage's output is sent in
    its compute dtype and, with ``autocast_device``, the stage runs under its autocast on that device type (None:
    no autocast, as the GPU trace runs the stage on meta tensors); ``own_output``: a zero-bubble schedule's
    stage copies an output that is a view (:class:`PipelineStageModule`)."""

    per_step: bool = False
    precision: Precision = FP32
    autocast_device: Optional[str] = None
    own_output: bool = False


def build_stage(index: int, paths: Sequence[str], model: nn.Module, config: StageConfig) -> PipelineStageModule:
    """Stage ``index`` of a pipeline: ``model``'s units at ``paths`` (the same module objects), built as
    ``config`` says."""
    stage = PipelineStageModule(index, paths, [model.get_submodule(p) for p in paths], config.own_output,
                                config.per_step, config.precision.compute_dtype)
    if config.autocast_device is not None:
        autocast_forward(stage, config.precision, config.autocast_device)
    return stage


def _to_meta(module: nn.Module) -> nn.Module:
    """``module`` with its parameters and buffers on the meta device (no data; shapes only)."""
    return module.to("meta")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor's local shard (a TP DTensor's), else the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def own_stage_ids(plan, mesh) -> Tuple[int, ...]:
    """The stages this rank's pp coordinate holds."""
    return tuple(plan.pp_schedule_spec.rank_stages(mesh.get_local_rank("pp"), plan.pp_size, plan.pp_virtual_stages))


def split_stages(model: nn.Module, plan, units: Sequence[str], mesh, device: torch.device) -> List[nn.Sequential]:
    """Every stage's units as shapes only (meta copies, taken before TP shards anything): the rank's own
    units copied, the model's other units moved to ``meta`` themselves (no data); the own units go to
    ``device``."""
    paths = stage_units(units, resolve_layout(plan.pp_layout, units, plan.pp_stages))
    own = {p for s in own_stage_ids(plan, mesh) for p in paths[s]}
    meta = [nn.Sequential(*[_to_meta(neurons.detached_copy(model.get_submodule(p))) if p in own
                            else _to_meta(model.get_submodule(p)) for p in run]) for run in paths]
    for p in own:
        model.get_submodule(p).to(device)
    return meta


def stage_fsdp_units(stage: "PipelineStageModule", units: Sequence[str]) -> Tuple[str, ...]:
    """The plan's FSDP2 ``units`` (paths in the user's model) inside ``stage``, as paths under the stage module
    (``units.<i>`` or ``units.<i>.<rest>``); the stage module itself is the root that holds the rest."""
    out = []
    for i, path in enumerate(stage.paths):
        out += [f"units.{i}" + u[len(path):] for u in units if u == path or u.startswith(path + ".")]
    return tuple(out)


def own_tp_plan(plan, units: Sequence[str], mesh) -> Dict[str, str]:
    """The plan's TP styles of the modules in this rank's own stages (the others are on meta)."""
    paths = stage_units(units, resolve_layout(plan.pp_layout, units, plan.pp_stages))
    own = [p for s in own_stage_ids(plan, mesh) for p in paths[s]]
    return {path: style for path, style in plan.tensor_parallel_plan.items()
            if any(path == u or path.startswith(u + ".") for u in own)}


class PipelinedModel(nn.Module):
    """This rank's pipeline stages of the user's model and the torch schedule that runs them.

    Not callable like the model: a step runs through :meth:`train_step` (``runtime.train_step``).
    ``last_outputs``: the last step's outputs merged over micro-batches, on the rank holding the
    last stage (None elsewhere).
    """
    def __init__(self, model: nn.Module, plan, units: Sequence[str], mesh, device: torch.device,
                 meta_stages: Sequence[nn.Module]):
        super().__init__()
        self.plan = plan
        self.layout = plan.layout
        self.device = device
        self.pp_group = mesh.get_group("pp")
        self.dp_group = mesh.get_group("dp") if plan.dp_size > 1 else None
        self.pp_rank = mesh.get_local_rank("pp")
        self.schedule = plan.pp_schedule_spec
        counts = resolve_layout(plan.pp_layout, units, plan.pp_stages)
        self.stage_paths = stage_units(units, counts)
        self.stage_ids = self.schedule.rank_stages(self.pp_rank, plan.pp_size, plan.pp_virtual_stages)
        self._meta_stages = list(meta_stages)  # shapes only (split_stages)
        config = StageConfig(per_step=self.layout.per_step, precision=plan.precision, autocast_device=device.type,
                             own_output=self.schedule.splits_backward)
        for s in self.stage_ids:
            for p in self.stage_paths[s]:
                model.get_submodule(p).to(device)
        self.stages = nn.ModuleList(build_stage(s, self.stage_paths[s], model, config) for s in self.stage_ids)
        for stage in self.stages:
            if plan.uses_fsdp:  # after TP (the units' layers are already tp shards): FSDP2 over dp, per stage
                apply_fsdp2(stage, mesh["dp"], stage_fsdp_units(stage, plan.fsdp_units),
                            reshard_after_forward=plan.reshard_after_forward,  # False: the plan refuses memopt 1
                            precision=plan.precision)
        self.last_outputs: Optional[torch.Tensor] = None
        self._schedule, self._schedule_key, self._loss_fn, self._loss_dtype = None, None, None, None
        self.pipeline_stages: list = []  # torch's PipelineStage objects of the rank's stages, once a step built them

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipelined model (mode 'pp') holds only this rank's stages and runs a step through "
                           "runtime.train_step(criterion, inputs, labels), which drives the pipeline schedule")

    @property
    def holds_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def holds_last(self) -> bool:
        return self.plan.pp_stages - 1 in self.stage_ids

    # ---- the schedule -------------------------------------------------------------------------
    def _stage_examples(self, micro: torch.Tensor) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(input, output) example of every stage for one micro-batch, propagated on the meta device
        (in the model's dtype: autocast does not act on meta tensors; under mixed precision the examples
        carry the compute dtype each stage sends on)."""
        x = torch.empty(micro.shape, dtype=micro.dtype, device="meta")
        sent, examples = x, []
        with torch.enable_grad():
            for stage in self._meta_stages:
                neurons.reset_all(stage)
                y = run_units(stage, x, self.layout.per_step)
                out = sent_as(y, self.plan.precision.compute_dtype)
                examples.append((sent, out))
                x, sent = y, out
        return examples

    def _build_schedule(self, inputs: torch.Tensor):
        plan = self.plan
        micro_shape = list(inputs.shape)
        micro_shape[self.layout.batch_dim] //= plan.pp_microbatches
        examples = self._stage_examples(torch.empty(micro_shape, dtype=inputs.dtype, device="meta"))
        self._loss_dtype = torch.promote_types(examples[-1][1].dtype, torch.float32)  # a bf16 loss loses digits
        stages = [pipelining().PipelineStage(module, module.index, plan.pp_stages, self.device,
                                input_args=examples[module.index][0], output_args=examples[module.index][1],
                                group=self.pp_group)
                  for module in self.stages]
        self.pipeline_stages = stages
        return self.schedule.build(stages, n_microbatches=plan.pp_microbatches, loss_fn=self._micro_loss,
                                   args_chunk_spec=(pipelining().microbatch.TensorChunkSpec(self.layout.batch_dim),),
                                   output_merge_spec=pipelining().microbatch.TensorChunkSpec(self.output_batch_dim), scale_grads=True)

    @property
    def output_batch_dim(self) -> int:
        """The batch dim of the last stage's output: 1 of ``[T, N, ...]``, 0 of ``[N, T, ...]``."""
        return 0 if self.layout.output == "batch_major" else 1

    def _micro_loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._loss_fn(outputs, labels)

    def _check_inputs(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        plan, layout = self.plan, self.layout
        if inputs.dim() < 2 or check_samples(layout, inputs, labels) != plan.per_rank_batch:
            raise ValueError(f"mode 'pp' takes inputs in data layout {layout} with N = the per-rank batch "
                             f"{plan.per_rank_batch} (split into {plan.pp_microbatches} micro-batches on dim "
                             f"{layout.batch_dim}), got shape {tuple(inputs.shape)}")

    # ---- one step -----------------------------------------------------------------------------
    def train_step(self, loss_fn: Callable, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One step's forward and backward over all micro-batches; the mean micro-batch loss, on every rank."""
        self._check_inputs(inputs, labels)
        key = (tuple(inputs.shape), inputs.dtype)
        if key != self._schedule_key:
            self._schedule, self._schedule_key = self._build_schedule(inputs), key
        self._loss_fn = loss_fn
        args = (inputs.to(self.device),) if self.holds_first else ()
        losses: List[torch.Tensor] = []
        target = labels.to(self.device) if self.holds_last else None
        out = self._schedule.step(*args, target=target, losses=losses if self.holds_last else None)
        self.last_outputs = out.detach() if self.holds_last and out is not None else None
        if self.dp_group is not None and not self.plan.uses_fsdp:  # FSDP2 reduce-scattered them (last backward)
            self._average_gradients()
        return self._broadcast_loss(losses)

    def _average_gradients(self) -> None:
        grads = [_local(p.grad) for p in self.parameters() if p.grad is not None]
        if not grads:
            return
        flat = reduce_in(torch.cat([g.reshape(-1) for g in grads]), self.plan.precision)
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.plan.dp_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def _broadcast_loss(self, losses: List[torch.Tensor]) -> torch.Tensor:
        """The mean of the last stage's micro-batch losses, sent to every rank of the pp group."""
        if self.holds_last:
            loss = torch.stack([l.detach() for l in losses]).mean()
        else:
            loss = torch.zeros((), dtype=self._loss_dtype, device=self.device)
        plan = self.plan
        last = dist.get_global_rank(self.pp_group, self.schedule.rank_of(plan.pp_stages - 1, plan.pp_size,
                                                                         plan.pp_virtual_stages))
        loss = loss.to(self.device, self._loss_dtype).contiguous()
        dist.broadcast(loss, src=last, group=self.pp_group)
        return loss

    # ---- inspection ---------------------------------------------------------------------------
    def full_tensors(self, pick: Callable, gather: Callable) -> Dict[str, Optional[torch.Tensor]]:
        """``pick(param)`` of every parameter of the whole model, by its path, gathered over the stages
        (``gather(owner, name, tensor)``: the full tensor of a TP-sharded one; a collective over tp)."""
        local = {}
        for stage in self.stages:
            tensors = {}
            for path, unit in zip(stage.paths, stage.units):
                for owner_name, owner in unit.named_modules():
                    for name, param in owner.named_parameters(recurse=False):
                        tensor = pick(param)
                        key = ".".join(p for p in (path, owner_name, name) if p)
                        tensors[key] = None if tensor is None else gather(owner, name, tensor).cpu().clone()
            local[stage.index] = tensors
        parts: List[Optional[dict]] = [None] * self.plan.pp_size
        dist.all_gather_object(parts, local, group=self.pp_group)
        out = {}
        plan = self.plan
        for s in range(plan.pp_stages):
            for name, tensor in parts[self.schedule.rank_of(s, plan.pp_size, plan.pp_virtual_stages)][s].items():
                out[name] = None if tensor is None else tensor.to(self.device)
        return out


def apply_pp(model: nn.Module, plan, units: Sequence[str], mesh, device: torch.device,
             meta_stages: Sequence[nn.Module]) -> PipelinedModel:
    """This rank's stages of ``model`` on ``device`` (the rest of its units on ``meta``; ``meta_stages``
    from :func:`split_stages`)."""
    return PipelinedModel(model, plan, units, mesh, device, meta_stages)
