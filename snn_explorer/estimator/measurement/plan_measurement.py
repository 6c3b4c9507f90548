"""measure(): run a plan on real gloo ranks for a few steps and record what the estimate predicts.

Per rank: the bytes of the sharded parameters, gradients and optimizer state (each storage
counted once), buffers, activations saved for backward, neuron state, the peak tensor memory of
one training step (torch's ``MemTracker``, the lower of two steps on gloo; DDP's gradient buckets
included),
the collectives issued (:class:`CollectiveRecorder`, checked against torch's ``CommDebugMode``
where that runs) and the step time. ``example_input`` and ``plan.batch_size`` are the global
batch of one optimizer step: each dp rank trains on its ``plan.per_rank_batch`` slice.
The memory and collective numbers describe the last step, after warm-up steps in which DDP
rebuilds its buckets and optimizers create their state.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import tempfile
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn

from ... import compat, ranks
from ...core import SNNDistributedPlan, apply
from ...core.common import positive_number
from ...core.model import DataLayout
from ...core.parallelize import comm_backend_for
from ...ranks.progress import heartbeat
from ..instruments.isolation import as_found
from ..instruments.recorder import CollectiveRecorder
from ..instruments.storage import SavedAlive, model_state_tensors, saving, state_tensor_ids, storage_bytes
from ..instruments.tables import COLLECTIVE_COLUMNS, PER_RANK_COLUMNS, TIME_COLUMNS
from ..profile.step import OPTIMIZERS, batch_slice, forward_loss, input_as
from .pipeline import measure_pp_plan, pp_collectives
from .settings import MeasureSettings, measure_settings, timed_steps

#: The measured steps' learning rate: it changes neither the step time nor the peak memory measured,
#: only the weights' values, so it is fixed rather than a parameter.
MEASURE_LR = 1e-3


@dataclass(frozen=True)
class PlanMeasurement:
    """Measured counterpart of :class:`PlanEstimate`: the same two tables, plus timing.

    ``collectives`` is rank 0's; ``collectives_agree`` says whether every rank issued the same.
    ``transient_bytes`` is measured for DDP (its buckets) and NaN otherwise: on the CPU the
    collective buffers of FSDP2 and DTensor cannot be told apart from other temporaries.
    ``comm_debug_counts`` are CommDebugMode's counts per kind (None where it cannot run: torch's
    CommDebugMode fails on modules called more than once per forward, as per-step SNNs do).
    ``time`` lines up with the estimate's: ``step_s`` is the mean timed step; ``exposed_comm_s``
    the time the recorded step spent blocked in collectives, where the recorder sees all of it
    (plans without DDP, FSDP2 or pipelining, whose waits happen outside it; else NaN);
    ``compute_s`` the rest; ``bubble_s`` NaN for pipelines (idle time is not observed).
    Pipeline plans: see :mod:`.pipeline_measurement` (peak by ``StorageMeter``; the collectives
    list one pipeline's sends per stage boundary, as the estimate does).
    """

    plan: SNNDistributedPlan
    per_rank: pd.DataFrame
    collectives: pd.DataFrame
    step_time_s: List[float]
    samples_per_s: float
    collectives_agree: bool
    comm_debug_counts: Optional[Dict[str, int]] = None
    steps: int = 3
    time: Optional[pd.DataFrame] = None  # rank, compute_s, exposed_comm_s, bubble_s, step_s (as PlanEstimate.time)
    #: where N and T sit in the model's input and output, and how that was found (given or detected)
    data_layout: Optional[DataLayout] = None
    data_layout_how: str = ""

    @property
    def peak_bytes(self) -> int:
        return int(self.per_rank["peak_bytes"].max())

    def _repr_html_(self) -> str:
        return (f"<p>{self.plan!r}: {self.samples_per_s:.1f} samples/s</p>" + self.per_rank.to_html(index=False)
                + self.collectives.to_html(index=False))


def _called_twice(model: nn.Module, run) -> bool:
    counts: Dict[int, int] = {}
    hooks = [m.register_forward_pre_hook(lambda m, a: counts.__setitem__(id(m), counts.get(id(m), 0) + 1))
             for m in model.modules()]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return any(c > 1 for c in counts.values())


@contextlib.contextmanager
def _quiet_tracker_hooks():
    """MemTracker's full backward hooks warn when a module's inputs need no gradient (the first
    layer's); they are this measurement's instruments, not the user's hooks, so the warning is ours."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
        yield


@contextlib.contextmanager
def _spare_frozen(tracker):
    """A global forward pre-hook, entered before MemTracker's, that spares it the grad hook it would
    put on each frozen parameter of the module being entered (it fails on those); modules are seen
    as they are called, so FSDP2's unsharded parameters are covered too."""
    def spare(module, args):
        compat.mem_tracker_skip_grad_hooks(tracker, [p for p in module.parameters() if not p.requires_grad])
    handle = torch.nn.modules.module.register_module_forward_pre_hook(spare)
    try:
        yield
    finally:
        handle.remove()


def _repeat_peak(tracker, step, device: torch.device) -> int:
    """The tracked peak of one more step. gloo's worker thread drops a finished collective's
    buffers a moment after ``wait()`` returns; when the rank runs ahead meanwhile, an FSDP2 buffer
    is counted once more (benchmarks/results/estimator_accuracy.md). Of two identical
    steps the lower peak is the program's own."""
    tracker.reset_mod_stats()
    compat.restart_mem_tracker_peak(tracker, device)
    step()
    return tracker.get_tracker_snapshot("peak")[device]["Total"]


def training_step(model, opt, x, y, layout):
    """``step(recorder=None, saved=None, after_forward=None)``: one training step of ``model`` on ``x``,
    its phases told to ``recorder``, its forward's saved tensors to ``saved``, ``after_forward()``
    called between forward and backward."""
    def step(recorder=None, saved=None, after_forward=None):
        opt.zero_grad(set_to_none=True)
        if recorder is not None:
            recorder.phase = "forward"
        with saving(saved) if saved else contextlib.nullcontext():
            loss = forward_loss(model, x, y, layout)
        if after_forward:
            after_forward()
        if recorder is not None:
            recorder.phase = "backward"
        loss.backward()
        del loss
        if recorder is not None:
            recorder.phase = "optimizer"
        opt.step()
    return step


def _measure_plan(model, plan, run: MeasureSettings) -> dict:
    """One plan measured on this rank: its timed steps, then one tracked step (peak, saved tensors,
    neuron state, collectives); the rank's row of the per-rank table and its collectives."""
    model = copy.deepcopy(model)
    if run.cast is not None:
        model.to(run.cast)
    plan = run.plan_for(plan)
    if plan.uses_pp:
        return measure_pp_plan(model, plan, run)
    runtime, x, y, opt = _rank_step_inputs(model, plan, run)
    module = runtime.module

    step = training_step(runtime.model, opt, x, y, run.layout)
    repeated = _called_twice(module, step)
    times = timed_steps(step, run.steps, plan.mode)
    recorder, saved, seen = CollectiveRecorder(), SavedAlive(), {}

    def after_forward():
        seen["state"] = storage_bytes(model_state_tensors(module))
        seen["saved"] = saved.alive()
        seen["params"] = storage_bytes(module.parameters())  # FSDP2 without resharding: the unsharded ones

    debug = compat.comm_debug_mode() if not repeated else contextlib.nullcontext()
    static = storage_bytes(list(module.parameters()) + list(module.buffers()))
    peak = tracked_peak(runtime, opt, x, step, lambda: step(recorder, saved, after_forward), debug, recorder,
                         run.device == "cuda")
    heartbeat(step=run.steps + 1, total=run.steps + 1, message=f"{plan.mode}: measured step")
    groups = {} if runtime.mesh is None else {d: runtime.mesh.get_group(d) for d in plan.mesh_dim_names}
    return dict(
        row=_rank_row(runtime, plan, opt, x, seen, static, peak),
        collectives=_over_ranks(recorder.table(groups), groups), times=times, blocked_s=recorder.blocked_s,
        debug=None if repeated else {str(k).rsplit(".", 1)[-1]: v for k, v in debug.get_comm_counts().items()})


def _rank_step_inputs(model, plan, run: MeasureSettings):
    """The distributed model of this rank, its share of the batch on its device, its optimizer."""
    runtime = apply(model=model, plan=plan, device_type=run.device)
    x, y = batch_slice(run.example_input, run.labels, plan.per_rank_batch, run.example_input.shape[0],
                       start=runtime.dp_rank * plan.per_rank_batch, layout=run.layout)
    device = next(runtime.model.parameters()).device if run.device == "cuda" else torch.device("cpu")
    x, y = input_as(x, run.dtype).to(device), None if y is None else y.to(device)  # token ids stay integers
    kind = OPTIMIZERS[run.optimizer]
    return runtime, x, y, runtime.build_optimizer(kind.cls, lr=run.lr, **kind.kwargs)


def tracked_peak(runtime, opt, x, step, measured_step, debug, recorder, cuda: bool) -> int:
    """The peak of ``measured_step`` as torch's memory tracker sees it (on CUDA, the allocator's own
    count), after a tracked warm-up ``step``: storages allocated outside any op (DDP's gradient
    buckets) become visible to the tracker when an op first writes them, so the measured step sees
    them from its start, not from the middle of its backward."""
    tracker = compat.mem_tracker_class()()
    tracker.track_external(runtime.model, getattr(opt, "optim", opt), x)  # ZeRO: its local optimizer
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with _spare_frozen(tracker), _quiet_tracker_hooks(), tracker:
        step()
        tracker.reset_mod_stats()
        compat.restart_mem_tracker_peak(tracker, x.device)
        with debug, recorder:
            measured_step()
        peak = tracker.get_tracker_snapshot("peak")[x.device]["Total"]
        if not cuda:
            peak = min(peak, _repeat_peak(tracker, step, x.device))
    if cuda:  # the allocator's own count (block rounding, NCCL's tensors) over the two steps
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    return peak


def _rank_row(runtime, plan, opt, x, seen: dict, static: dict, peak: int) -> dict:
    """This rank's row of the per-rank table from what the tracked step saw."""
    module = runtime.module
    input_ptr = x.untyped_storage().data_ptr()
    activations = sum(n for p, n in seen["saved"].items() if p not in static and p not in seen["state"]
                      and p not in seen["params"] and p != input_ptr) + x.numel() * x.element_size()
    params = list(module.parameters())
    state_dict = getattr(opt, "optim", opt).state
    state_ids = state_tensor_ids(module)
    buckets = sum(compat.ddp_rebuilt_bucket_sizes(runtime.model)) if plan.uses_ddp else float("nan")
    return dict(rank=dist.get_rank(), params_bytes=sum(storage_bytes(params).values()),
                grads_bytes=sum(storage_bytes([p.grad for p in params]).values()),
                optimizer_bytes=sum(storage_bytes([v for s in state_dict.values() for v in s.values()]).values()),
                buffers_bytes=sum(storage_bytes([b for b in module.buffers() if id(b) not in state_ids]).values()),
                activations_bytes=activations, neuron_state_bytes=sum(seen["state"].values()),
                transient_bytes=buckets, peak_bytes=peak)


def _over_ranks(rows: List[dict], groups: Dict[str, object]) -> List[dict]:
    """The rows of collectives over more than one rank: one over a mesh dim of one rank (DDP's
    all-reduce on a one-rank plan) moves nothing, and the estimate lists none."""
    alone = {d for d, g in groups.items() if dist.get_world_size(g) == 1}
    return [r for r in rows if r["mesh_dim"] not in alone]


def measure_on_rank(model, plans, run: MeasureSettings) -> List[dict]:
    return [_measure_plan(model, p, run) for p in plans]


def _time_table(plan: SNNDistributedPlan, results: Sequence[dict], times: Sequence[float]) -> pd.DataFrame:
    """The measured counterpart of :attr:`PlanEstimate.time` (see :class:`PlanMeasurement`)."""
    seen = not (plan.uses_ddp or plan.uses_fsdp or plan.uses_pp)
    comm = [min(r["blocked_s"], t) if seen else float("nan") for r, t in zip(results, times)]
    return pd.DataFrame(dict(rank=range(len(times)), compute_s=[t - c for t, c in zip(times, comm)],
                             exposed_comm_s=comm, bubble_s=float("nan") if plan.uses_pp else 0.0, step_s=times),
                        columns=list(TIME_COLUMNS))


def _assemble(plan: SNNDistributedPlan, results: Sequence[dict], steps: int) -> PlanMeasurement:
    per_rank = pd.DataFrame([r["row"] for r in results], columns=PER_RANK_COLUMNS).sort_values("rank")
    key = lambda rows: sorted((r["mesh_dim"], r["kind"], r["phase"], r["count"], r["bytes"]) for r in rows)
    if plan.uses_pp:
        rows, agree = pp_collectives(plan, results)
    else:
        rows, agree = results[0]["collectives"], all(key(r["collectives"]) == key(results[0]["collectives"])
                                                     for r in results)
    collectives = pd.DataFrame(rows, columns=COLLECTIVE_COLUMNS)
    times = [sum(r["times"]) / len(r["times"]) for r in results]
    return PlanMeasurement(plan=plan, per_rank=per_rank.reset_index(drop=True), collectives=collectives,
                           step_time_s=times, samples_per_s=plan.batch_size / max(times), collectives_agree=agree,
                           comm_debug_counts=results[0]["debug"], steps=steps, time=_time_table(plan, results, times))


def measure_many(model: nn.Module, plans: Sequence[SNNDistributedPlan], *, example_input: torch.Tensor,
                 labels: Optional[torch.Tensor] = None, steps: int = 3, optimizer: str = "adam",
                 dtype: Optional[torch.dtype] = None, timeout: Optional[float] = 300.0,
                 device: str = "cpu", progress=False, layout=None, pool=None) -> List[PlanMeasurement]:
    """:func:`measure` for several plans, one set of ranks per world size (``snn_explorer.ranks``; ``pool``:
    a :class:`~snn_explorer.ranks.RankPool` runs them, so every plan over one rank needs its world size)."""
    run = measure_settings(model, plans, example_input, labels, steps, optimizer, dtype, MEASURE_LR, device, layout)
    backend = comm_backend_for(device)
    for world in sorted({p.world_size for p in plans} - {1}) if pool is not None else ():
        pool.check_fits(world, backend)
    timeout = positive_number("timeout", timeout, what="seconds a rank may go without finishing a step",
                              allow_none=True)
    out: Dict[int, PlanMeasurement] = {}
    for world in sorted({p.world_size for p in plans}):
        idx = [i for i, p in enumerate(plans) if p.world_size == world]
        group = [plans[i] for i in idx]
        if world == 1:
            with as_found():  # it runs in this process: its RNG, environment and temporary directory
                per_rank = [_measure_single(model, group, run, backend)]
        else:
            per_rank = ranks.run(measure_on_rank, (model, group, run), nprocs=world, backend=backend,
                                 timeout=timeout, progress=progress, pool=pool).values
        out.update(zip(idx, assemble_measurements(group, per_rank, run)))
    return [out[i] for i in range(len(plans))]


def assemble_measurements(plans: Sequence[SNNDistributedPlan], per_rank: Sequence[List[dict]],
                          run: MeasureSettings) -> List[PlanMeasurement]:
    """One :class:`PlanMeasurement` per plan from what ``measure_on_rank(model, plans, run)`` returned on
    each rank of one group (``per_rank``, in rank order)."""
    return [dataclasses.replace(_assemble(plan, [r[j] for r in per_rank], run.steps), data_layout=run.layout,
                                data_layout_how=run.layout_how) for j, plan in enumerate(plans)]


def _measure_single(model, plans, run: MeasureSettings, backend: str):
    """A one-rank (mode 'none') measurement in this process, on a private process group."""
    if dist.is_initialized():
        return measure_on_rank(model, plans, run)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        try:
            return measure_on_rank(model, plans, run)
        finally:
            dist.destroy_process_group()


def measure(model: nn.Module, plan: SNNDistributedPlan, *, example_input: torch.Tensor,
            labels: Optional[torch.Tensor] = None, steps: int = 3, optimizer: str = "adam",
            dtype: Optional[torch.dtype] = None, timeout: Optional[float] = 300.0,
            device: str = "cpu", progress=False, layout=None, pool=None) -> PlanMeasurement:
    """Train ``plan`` on ``plan.world_size`` spawned ranks for ``steps`` steps and measure one more.

    ``device``: ``"cpu"`` (gloo; the peak is MemTracker's, a storage meter's for pipeline plans) or
    ``"cuda"`` (NCCL, rank ``r`` on GPU ``r``; the peak is the CUDA allocator's
    ``max_memory_allocated``, a storage meter's for pipeline plans). Pipeline plans need ``labels``.
    ``example_input`` is the global batch (``plan.batch_size`` samples) in the model's data layout
    (``layout``, else the plan's ``data_layout``, else detected as :func:`estimate` does): dp rank
    ``r`` trains on samples ``r * per_rank_batch`` onwards. ``labels`` select a cross-entropy loss
    (else the mean square output). The model is copied; it is not changed.
    The ranks run on :mod:`snn_explorer.ranks`: ``timeout`` is the seconds a rank may take for one
    step (each step is a heartbeat; None: no limit), a failing rank raises ``LaunchError`` with
    its traceback, ``progress`` shows the steps (True: widgets / a text line, or a callable).
    ``pool``: a :class:`~snn_explorer.ranks.RankPool` of ``plan.world_size`` ranks on the device's backend
    runs it on its warm ranks (one that does not fit is refused before anything runs).
    """
    return measure_many(model, [plan], example_input=example_input, labels=labels, steps=steps,
                        optimizer=optimizer, dtype=dtype, timeout=timeout, device=device,
                        progress=progress, layout=layout, pool=pool)[0]
