"""What calibrate() times of the parallel wrappers on each rank: TP, FSDP2, DDP and ZeRO around a small
spiking MLP, and each pipeline schedule on a pipeline of small spiking blocks."""
from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from ... import ranks
from ...compat_pipelining import pipeline_waits
from ...core import PlanOptions, analyze, apply, plan
from ...core.planning import SCHEDULES
from ..instruments.isolation import collected
from ..instruments.recorder import CollectiveRecorder
from ..timing.hardware import KINDS
from .probes import (
    PIPELINE_HEAVY,
    PIPELINE_REPEATS,
    PROBE_STEPS,
    SIZES_BYTES,
    WRAPPER_REPEATS,
    broadcast_burst,
    busy_time,
    collective_op,
    compute_probes,
    gap_compute,
    leaky_spike,
    probe_net,
    probe_step,
    time_collective,
)


def wrapped_step_times(dist, device) -> dict:
    """Seconds of a training step (forward, backward) of :func:`probe_net` on every rank of the
    world: plain, tensor-parallel (first Linear colwise, second rowwise: an all-reduce per time step
    in the forward), under FSDP2 (each Linear and the root) and under DDP; of the step with an Adam
    update, plain and under ZeroRedundancyOptimizer; and the collectives each wrapper made in one
    step. Timed in rounds of one step of each, the median of :data:`WRAPPER_REPEATS` rounds."""
    mesh = DeviceMesh(device.type, torch.arange(dist.get_world_size()))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    plain = probe_net(device)
    x = torch.rand(PROBE_STEPS, 16, 64, generator=torch.Generator().manual_seed(1)).to(device)
    step = lambda m: m(x).square().mean().backward()

    def recorded(fn) -> list:
        with CollectiveRecorder() as recorder:
            fn()
        return [(kind, nbytes) for _, _, kind, _, nbytes in recorder.events]

    def trained(model, optimizer_of):  # a whole step, optimizer included
        optimizer = optimizer_of(model.parameters())

        def run():
            optimizer.zero_grad(set_to_none=True)
            step(model)
            optimizer.step()
        return run

    fsdp = copy.deepcopy(plain)
    for layer in fsdp.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    tp = parallelize_module(copy.deepcopy(plain), mesh, {"layers.0": ColwiseParallel(), "layers.1": RowwiseParallel()})
    ddp = DistributedDataParallel(copy.deepcopy(plain))
    runs = {"plain": lambda: step(plain), "tp": lambda: step(tp), "fsdp": lambda: step(fsdp), "ddp": lambda: step(ddp),
            "adam": trained(copy.deepcopy(plain), lambda params: torch.optim.Adam(params, lr=1e-9)),
            "zero": trained(copy.deepcopy(plain), lambda params: ZeroRedundancyOptimizer(
                params, optimizer_class=torch.optim.Adam, lr=1e-9))}
    collectives = {name: recorded(runs[name]) for name in ("tp", "fsdp", "ddp", "zero")}  # also the warm-up
    runs["plain"]()
    runs["adam"]()
    times = {name: [] for name in runs}
    with collected():
        for _ in range(WRAPPER_REPEATS):  # in rounds, so that the machine's slow spells touch every variant
            for name, run in runs.items():
                dist.barrier()
                start = time.perf_counter()
                run()
                sync()
                times[name].append(time.perf_counter() - start)
    return {**{name: statistics.median(ts) for name, ts in times.items()}, "collectives": collectives,
            "tp_calls": 2 * PROBE_STEPS}


def probe_block(work: int):
    """A probe stage: a Linear(64, 64) with a leaky, smoothly spiking state (:func:`leaky_spike`)
    over the time steps of its input ``[T, N, 64]``, its membrane's input summed over ``work`` calls
    of the Linear (more work, the same shapes)."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(64, 64)

        def forward(self, x):
            mem, out = torch.zeros_like(x[0]), []
            for t in range(x.shape[0]):
                mem, spike = leaky_spike(mem, sum(self.linear(x[t]) for _ in range(work)) / work)
                out.append(spike)
            return torch.stack(out)

    return Block()


def probe_pipeline(p: int, schedule, heavy: int = 1):
    """``p`` ranks' pipeline of probe blocks (:func:`probe_block`), as many stages per rank as
    ``schedule`` (a :class:`~..core.pipeline_schedules.PipelineSchedule`) runs and as many
    micro-batches of 4 samples as stages, rank 0's blocks ``heavy`` times the work of the others:
    the model, its plan and a batch."""
    virtual = schedule.virtual_stages or (2 if schedule.multi_stage else 1)
    first = schedule.rank_stages(0, p, virtual)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(probe_block(heavy if s in first else 1) for s in range(p * virtual)))
    micro = p * virtual
    pp_plan = plan(analysis=analyze(model), objective="speed", topology={"pp": p}, mode="pp", batch_size=4 * micro, options=PlanOptions(pp_schedule=schedule.name, pp_microbatches=micro, pp_virtual_stages=virtual))
    return model, pp_plan, torch.rand(PROBE_STEPS, 4 * micro, 64, generator=torch.Generator().manual_seed(2))


def pipeline_step_times(dist, device, schedule, heavy: int) -> dict:
    """Seconds of a training step of :func:`probe_pipeline` (``schedule``, ``heavy``) on this rank and
    of its waits for sends and receives in it (:func:`~...compat_pipelining.pipeline_waits`), of one
    micro-batch's forward and backward of a block (and of a heavy block, where ``heavy > 1``) run
    alone (every rank at once, in turns with the steps), each the median of
    :data:`PIPELINE_REPEATS`; the plan, ``heavy`` and the bytes of one transfer."""
    model, pp_plan, x = probe_pipeline(dist.get_world_size(), schedule, heavy)
    blocks = {"light": probe_block(1).to(device), **({"heavy": probe_block(heavy).to(device)} if heavy > 1 else {})}
    micro = x[:, :x.shape[1] // pp_plan.pp_microbatches].clone().to(device).requires_grad_()
    runtime = apply(model=model, plan=pp_plan, device_type=device.type)
    x, labels = x.to(device), torch.zeros(x.shape[1], dtype=torch.long)
    loss = lambda out, _: out.square().mean()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    runtime.train_step(loss, x, labels)
    times = {k: [] for k in ("step", "waited", *(f"{name}_{phase}" for name in blocks for phase in "FB"))}
    with collected():
        for _ in range(PIPELINE_REPEATS):
            dist.barrier()
            with pipeline_waits() as waited:
                times["step"].append(timed(lambda: runtime.train_step(loss, x, labels)))
            times["waited"].append(waited[0])
            dist.barrier()
            for name, block in blocks.items():
                out = []
                times[f"{name}_F"].append(timed(lambda: out.append(block(micro))))
                times[f"{name}_B"].append(timed(lambda: out[0].backward(torch.ones_like(out[0]))))
    return {**{k: statistics.median(v) for k, v in times.items()}, "plan": pp_plan, "heavy": heavy,
            "bytes": micro.numel() * micro.element_size()}


#: The pieces :func:`calibrate_on_rank` reports as it goes (``step`` of ``total`` in ``ranks.report``):
#: the step's core sharing, each collective kind, the wrappers, the broadcast burst, each pipeline
#: schedule, the end.
RANK_PHASES = 4 + len(KINDS) + len(SCHEDULES)


def calibrate_on_rank(with_compute: bool) -> dict:
    """Everything timed in a world of ``p`` ranks (every rank of the world takes part, none idles);
    each piece done is reported (``step`` of :data:`RANK_PHASES`, the piece as ``message``)."""
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    p = dist.get_world_size()
    done = iter(range(1, RANK_PHASES + 1))

    def piece(what: str) -> None:
        ranks.report(step=next(done), total=RANK_PHASES, message=f"{p} ranks: {what}")

    alone = compute_probes(device) if with_compute and dist.get_rank() == 0 else None
    dist.barrier()
    probe, sync = probe_step(device), torch.cuda.synchronize if cuda else (lambda: None)
    shared = statistics.median(busy_time(probe, sync) for _ in range(3))  # one loop alone varies on shared cores
    piece("compute timed")
    gap = gap_compute(device)
    collectives = {}
    for kind in KINDS:
        collectives.update({(kind, nbytes): time_collective(dist, collective_op(dist, kind, p, nbytes, device),
                                                            device, gap) for nbytes in SIZES_BYTES})
        piece(f"{kind} timed")
    framework = wrapped_step_times(dist, device)
    piece("TP, FSDP2, DDP and ZeRO steps timed")
    framework["broadcast_burst"] = time_collective(dist, broadcast_burst(dist, device), device, gap)
    piece("broadcast burst timed")
    framework["pipeline"] = {}
    for name, spec in SCHEDULES.items():
        framework["pipeline"][name] = [pipeline_step_times(dist, device, spec, heavy) for heavy in (PIPELINE_HEAVY, 1)]
        piece(f"{name} pipeline timed")
    piece(f"calibrated {p} ranks")
    return {"alone": alone, "shared": shared, "collectives": collectives, "framework": framework}
