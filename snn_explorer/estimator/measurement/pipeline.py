"""measure() of a pipeline plan (modes ``pp``, ``pp_tp``, ``pp_fsdp2``, ``pp_fsdp2_tp``): one rank's stages under torch's schedule.

torch's MemTracker refuses a module called more than once per step, and every stage runs once
per micro-batch, so the peak here is a :class:`StorageMeter`'s over the measured step (the
rank's parameters, optimizer state, buffers, input and the schedule's receive buffers tracked
from its start). Activations are the most bytes saved for backward alive at once (parameters,
the input and receive buffers left out); neuron state is NaN (each stage replaces it per
micro-batch, so no one moment shows "the" state). The sends and receives are recorded as the
schedule issues them, each named by the stage boundary it crosses; a 3-D plan's tensor-parallel
collectives by the stages they run inside (:func:`~..instruments.tables.tp_phase`).
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch
import torch.distributed as dist

from ... import compat_pipelining
from ...core import apply
from ...core.common import Collective
from ...ranks.progress import heartbeat
from ..instruments.meter import StorageMeter
from ..instruments.recorder import CollectiveRecorder
from ..instruments.storage import LiveSaved, local_tensor, saving, state_tensor_ids, storage_keys, total_bytes
from ..instruments.tables import gather_phase, reduce_phase, tp_phase
from ..profile.step import OPTIMIZERS, batch_slice
from .settings import MeasureSettings, timed_steps

_NAN = float("nan")


def _buffers(pipe) -> list:
    """The stages' buffers but the neuron state (snntorch's membranes), which measure() of other modes
    leaves out of ``buffers_bytes`` too: the estimate counts that state apart."""
    state = state_tensor_ids(pipe)
    return [b for b in pipe.buffers() if id(b) not in state]


def measure_pp_plan(model, plan, run: MeasureSettings) -> dict:
    """One rank's measurement of pipeline ``plan``."""
    runtime = apply(model=model, plan=plan, device_type=run.device)
    x, y = batch_slice(run.example_input, run.labels, plan.per_rank_batch, run.example_input.shape[0],
                       start=runtime.dp_rank * plan.per_rank_batch, layout=run.layout)
    x = x.to(run.dtype)
    kind = OPTIMIZERS[run.optimizer]
    opt = runtime.build_optimizer(kind.cls, lr=run.lr, **kind.kwargs)
    pipe, criterion = runtime.model, torch.nn.functional.cross_entropy

    def step():
        opt.zero_grad(set_to_none=True)
        runtime.train_step(criterion, x, y)
        opt.step()

    times = timed_steps(step, run.steps, plan.mode)

    labels: Dict[int, str] = {}
    for stage in pipe.pipeline_stages:
        compat_pipelining.label_pipeline_p2p(stage, labels)
    recv = [b for stage in pipe.pipeline_stages for b in compat_pipelining.pipeline_recv_buffers(stage)]
    params = [local_tensor(p) for p in pipe.parameters()]  # a 3-D plan's TP shards: their local tensors
    state = [local_tensor(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    inputs = [x] if pipe.holds_first else []
    opt.zero_grad(set_to_none=True)
    meter, recorder = StorageMeter(), CollectiveRecorder(phase="step", labels=labels)
    meter.track(params + state + list(pipe.buffers()) + recv + inputs + ([y] if pipe.holds_last else []))
    saved = LiveSaved(storage_keys(params + recv + [x]))
    with meter, recorder, saving(saved):
        runtime.train_step(criterion, x, y)
        opt.step()
    heartbeat(step=run.steps + 1, total=run.steps + 1, message=f"{plan.mode}: measured step")
    groups = {d: runtime.mesh.get_group(d) for d in plan.mesh_dim_names}
    phases = {("dp", Collective.ALL_REDUCE): reduce_phase(pipe.stage_ids), ("pp", Collective.BROADCAST): "loss",
              ("dp", Collective.REDUCE_SCATTER): reduce_phase(pipe.stage_ids),  # FSDP2 stages (pp_fsdp2*)
              ("dp", Collective.ALL_GATHER): gather_phase(pipe.stage_ids)}
    rows = [dict(r, phase=tp_phase(pipe.stage_ids) if r["mesh_dim"] == "tp" else
                 phases.get((r["mesh_dim"], r["kind"]), r["phase"])) for r in recorder.table(groups)]
    row = dict(rank=dist.get_rank(), params_bytes=total_bytes(params),
               grads_bytes=total_bytes(p.grad for p in pipe.parameters()),
               optimizer_bytes=total_bytes(state), buffers_bytes=total_bytes(_buffers(pipe)), activations_bytes=saved.peak,
               neuron_state_bytes=_NAN, transient_bytes=total_bytes(recv + inputs), peak_bytes=meter.peak)
    return dict(row=row, collectives=rows, times=times, blocked_s=_NAN, debug=None, pp_rank=pipe.pp_rank)


def pp_collectives(plan, results: Sequence[dict]):
    """``(rows, agree)``: the sends per stage boundary of one pipeline (dp replica 0) summed over its
    ranks, each pp rank's gradient all-reduce, the loss broadcast; ``agree`` when every boundary's
    receives equal its sends and every dp replica issued what replica 0 did."""
    key = lambda rows: sorted((r["mesh_dim"], r["kind"], r["phase"], r["count"], r["bytes"]) for r in rows)
    first = {r["pp_rank"]: r for r in results[::plan.dp_size * plan.tp_size]}  # mesh order pp, dp, tp
    agree = all(key(r["collectives"]) == key(first[r["pp_rank"]]["collectives"]) for r in results)
    sums: Dict[tuple, List[int]] = {}
    for pp_rank, result in sorted(first.items()):
        for r in result["collectives"]:
            if r["kind"] == Collective.BROADCAST and pp_rank:
                continue  # one broadcast, issued by all
            acc = sums.setdefault((r["mesh_dim"], r["kind"], r["phase"]), [0, 0])
            acc[0], acc[1] = acc[0] + r["count"], acc[1] + r["bytes"]
    sends = {k[2]: v for k, v in sums.items() if k[1] == Collective.SEND}
    recvs = {k[2]: v for k, v in sums.items() if k[1] == Collective.RECV}
    rows = [dict(mesh_dim=d, kind=k, phase=p, count=c, bytes=n) for (d, k, p), (c, n) in sums.items() if k != Collective.RECV]
    return rows, agree and sends == recvs
