"""calibrate(): measure this machine's compute and collectives into a :class:`HardwareProfile`.

For each group size ``p``, ``p`` real ranks (``snn_explorer.ranks``; gloo on CPUs, NCCL with one
GPU per rank) are started (in ``worlds`` fresh worlds one after another, every figure then their
median: :func:`median_profile`): a world of exactly the ranks a plan of that size runs, since
ranks that only wait still take a share of the cores. In the first world rank 0 times alone a
square matmul (FLOP/s), a large elementwise add (bytes/s) and a one-element add (the fixed cost of
one operator);
then all ``p`` ranks run a small SNN training step together (:func:`_probe_step`), every
collective kind at a few buffer sizes (each issued between a little compute, as in a step:
:func:`_time_collective`), a burst of broadcasts as ZeroRedundancyOptimizer issues them
(:func:`_broadcast_burst`), the wrappers' cost: TP, FSDP2, DDP and ZeRO around a small spiking
MLP (:func:`_wrapped_step_times`), beyond the plain step and its collectives, and each pipeline
schedule's own cost per action and per transfer on a pipeline of small spiking blocks
(:func:`_pipeline_step_times`, :func:`_pipeline_costs`). ``compute_sharing[p]`` is how much
slower that step runs on each of ``p`` ranks than in the calling process on one thread (on GPUs:
than on rank 0 alone), the factor by which a rank's step is slower than the one the estimator
times in the calling process. Each (kind, p) gets
``alpha + beta * bytes`` fitted by least squares (:func:`fit_alpha_beta`) to the median of the
slowest rank's times. Group sizes 2 and 4 took 42-46 s on a 2-core CPU machine (gloo).

:func:`default_hardware` is what ``estimate`` uses without ``hardware=``: the profile named by the
``SNN_EXPLORER_HARDWARE`` environment variable (a built-in name or a JSON file), else this
machine's calibration, made on first use and cached in the process and on disk
(``$XDG_CACHE_HOME/snn_explorer`` or ``~/.cache/snn_explorer``).
"""
from __future__ import annotations

import datetime
import os
import socket
import statistics
import time
from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

from .. import ranks
from ..core.pipeline_schedules import SCHEDULES
from ..core.validate import positive_int
from .hardware import KINDS, HardwareProfile, hardware_profile
from .isolation import collected, one_thread

#: Buffer sizes (bytes) each collective is timed at, repetitions per size, collectives per repetition.
SIZES_BYTES = (4 * 2 ** 10, 256 * 2 ** 10, 2 ** 20, 4 * 2 ** 20, 16 * 2 ** 20)
REPEATS = 5
LOOP_OPS = 8
#: 64 x 64 matmuls run before each timed collective (see :func:`_time_collective`).
GAP_MATMULS = 16
#: Broadcasts issued at once when timing them as ZeroRedundancyOptimizer issues them.
BURST = 8
#: Seconds each rank computes when timing how ranks on one host slow each other.
SHARING_PROBE_S = 0.25
#: Time steps of the probe SNN the wrappers' costs are timed on, and timed steps per wrapper (median).
PROBE_STEPS = 8
WRAPPER_REPEATS = 15
#: Work of rank 0's blocks in the pipeline probe where it is the slowest rank, and timed steps of each probe.
PIPELINE_HEAVY = 6
PIPELINE_REPEATS = 7
#: Bumped when what calibrate() measures changes, so that older cached calibrations are not reused.
CALIBRATION_VERSION = 12
#: The smallest beta a fit gives (s/byte: 10 TB/s), when the times do not grow with the size.
MIN_BETA = 1e-13


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float]) -> Tuple[float, float]:
    """Least-squares ``seconds = alpha + beta * nbytes`` in relative error (weights ``1 / seconds**2``);
    alpha clamped at 0 (then beta refitted through 0).
    Times that do not grow with the size give their smallest as alpha and :data:`MIN_BETA` or more."""
    if len(nbytes) != len(seconds) or len(set(nbytes)) < 2:
        raise ValueError(f"need timings at two or more distinct sizes, got sizes {list(nbytes)}")
    n = len(nbytes)
    w = [1.0 / max(y, 1e-12) ** 2 for y in seconds]  # relative errors: the small sizes fix alpha
    sw = sum(w)
    mx, my = sum(wi * x for wi, x in zip(w, nbytes)) / sw, sum(wi * y for wi, y in zip(w, seconds)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, nbytes))
    beta = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, nbytes, seconds)) / sxx
    alpha = my - beta * mx
    if alpha < 0:
        alpha = 0.0
        beta = sum(wi * x * y for wi, x, y in zip(w, nbytes, seconds)) / sum(wi * x * x for wi, x in zip(w, nbytes))
    if beta <= MIN_BETA:  # latency-bound over every size (or noise hid the slope): the level and the largest size
        alpha = min(seconds)
        big = max(range(n), key=lambda i: nbytes[i])
        beta = max(MIN_BETA, (seconds[big] - alpha) / nbytes[big])
    return alpha, beta


def _median_time(fn, repeats: int, sync) -> float:
    fn()
    sync()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def _compute_probes(device) -> Dict[str, float]:
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    n = 1024 if device.type == "cuda" else 256
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    big = torch.randn(2 ** 22 if device.type == "cuda" else 2 ** 20, device=device)
    tiny = torch.ones(1, device=device)
    flops = 2 * n ** 3 / _median_time(lambda: a @ b, 5, sync)
    bandwidth = 3 * big.numel() * 4 / _median_time(lambda: big + big, 5, sync)
    loop = 200
    overhead = _median_time(lambda: [tiny + tiny for _ in range(loop)], 3, sync) / loop
    return dict(flops=flops, bandwidth=bandwidth, overhead=overhead, step=_busy_time(_probe_step(device), sync))


def _leaky_spike(mem, current):
    """One time step of the probes' neuron: leaky integration, a smooth spike, a soft reset; the new
    membrane and the spike."""
    import torch

    mem = 0.9 * mem + current
    spike = torch.sigmoid(4 * (mem - 1))
    return mem - spike, spike


def _probe_step(device):
    """One training step of a small spiking MLP: 8 time steps of linear -> leaky integration -> a
    smooth spike -> linear, backward, SGD update. Many small operators and a few matmuls, like the
    SNN steps whose slow-down on a shared host it measures (a matmul alone missed most of it)."""
    import torch

    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(64, 128, generator=g).div_(8).to(device).requires_grad_()
    w2 = torch.randn(128, 10, generator=g).div_(8).to(device).requires_grad_()
    x = torch.rand(8, 16, 64, generator=g).to(device)

    def step():
        mem, out = torch.zeros(16, 128, device=device), 0
        for t in range(x.shape[0]):
            mem, spike = _leaky_spike(mem, x[t] @ w1)
            out = out + spike @ w2
        out.square().mean().backward()
        with torch.no_grad():
            for w in (w1, w2):
                w -= 1e-3 * w.grad
                w.grad = None

    return step


def _busy_time(op, sync, seconds: float = SHARING_PROBE_S) -> float:
    """Seconds of one ``op`` averaged over a loop of about ``seconds`` (longer than a scheduler time
    slice, so that ranks sharing cores really run side by side)."""
    op()
    sync()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        op()
        calls += 1
    sync()
    return (time.perf_counter() - start) / calls


def _collective_op(dist, kind: str, p: int, nbytes: int, device):
    """One ``kind`` collective of ``nbytes`` over the world's ``p`` ranks, as a callable."""
    import torch

    rank, elems = dist.get_rank(), nbytes // 4
    if kind == "all_gather":
        out, inp = torch.empty(elems, device=device), torch.ones(elems // p, device=device)
        return lambda: dist.all_gather_into_tensor(out, inp)
    if kind == "reduce_scatter":
        out, inp = torch.empty(elems // p, device=device), torch.ones(elems, device=device)
        return lambda: dist.reduce_scatter_tensor(out, inp)
    buf = torch.ones(elems, device=device)
    if kind == "send":
        return (lambda: dist.send(buf, rank + 1)) if rank % 2 == 0 else (lambda: dist.recv(buf, rank - 1))
    return (lambda: dist.all_reduce(buf)) if kind == "all_reduce" else (lambda: dist.broadcast(buf, 0))


def _gap_compute(device):
    """A little compute (some 0.1 ms on a CPU core) to run between timed collectives, as a step does."""
    import torch

    a = torch.randn(64, 64, device=device)

    def gap():
        for _ in range(GAP_MATMULS):
            a @ a
    return gap


def _broadcast_burst(dist, device):
    """:data:`BURST` broadcasts of 1 KiB issued at once, each from the next rank, then waited for
    (as ZeroRedundancyOptimizer sends each rank's updated parameters), as a callable."""
    import torch

    p, bufs = dist.get_world_size(), [torch.ones(256, device=device) for _ in range(BURST)]

    def burst():
        for work in [dist.broadcast(buf, src=i % p, async_op=True) for i, buf in enumerate(bufs)]:
            work.wait()
    return burst


def _time_collective(dist, op, device, gap) -> List[float]:
    """Seconds the collective(s) ``op()`` adds to a stream of compute, :data:`REPEATS` times after a
    warm-up: a loop of :data:`LOOP_OPS` (``gap()``, ``op()``) against the same loop of ``gap()``
    alone. Issued between compute, as in a training step, a collective also pays for waking the
    ranks that wait in it: on ranks sharing a CPU's cores that costs several times the latency of
    collectives timed back to back."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def loop(with_op: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(LOOP_OPS):
            gap()
            if with_op:
                op()
        sync()
        return (time.perf_counter() - start) / LOOP_OPS

    loop(True)
    return [max(loop(True) - loop(False), 1e-7) for _ in range(REPEATS)]


def _probe_net(device):
    """The small spiking MLP the wrappers are timed on: ``Linear(64, 128) -> Linear(128, 128) ->
    Linear(128, 10)`` with a leaky, smoothly spiking state after the first two, run over
    :data:`PROBE_STEPS` time steps inside its forward, as the zoo's SNNs run."""
    import torch

    class ProbeNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(i, o) for i, o in ((64, 128), (128, 128), (128, 10)))
            with torch.no_grad():
                for layer in self.layers:
                    layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) / 8)

        def forward(self, x):
            mems, out = [None, None], 0
            for t in range(x.shape[0]):
                h = x[t]
                for i, layer in enumerate(self.layers[:2]):
                    mems[i] = layer(h) if mems[i] is None else 0.9 * mems[i] + layer(h)
                    h = torch.sigmoid(4 * (mems[i] - 1))
                    mems[i] = mems[i] - h
                out = out + self.layers[2](h)
            return out

    return ProbeNet().to(device)


def _wrapped_step_times(dist, device) -> dict:
    """Seconds of a training step (forward, backward) of :func:`_probe_net` on every rank of the
    world: plain, tensor-parallel (first Linear colwise, second rowwise: an all-reduce per time step
    in the forward), under FSDP2 (each Linear and the root) and under DDP; of the step with an Adam
    update, plain and under ZeroRedundancyOptimizer; and the collectives each wrapper made in one
    step. Timed in rounds of one step of each, the median of :data:`WRAPPER_REPEATS` rounds."""
    import copy

    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    from .recorder import CollectiveRecorder

    mesh = DeviceMesh(device.type, torch.arange(dist.get_world_size()))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    plain = _probe_net(device)
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


def _probe_block(work: int):
    """A probe stage: a Linear(64, 64) with a leaky, smoothly spiking state (:func:`_leaky_spike`)
    over the time steps of its input ``[T, N, 64]``, its membrane's input summed over ``work`` calls
    of the Linear (more work, the same shapes)."""
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(64, 64)

        def forward(self, x):
            mem, out = torch.zeros_like(x[0]), []
            for t in range(x.shape[0]):
                mem, spike = _leaky_spike(mem, sum(self.linear(x[t]) for _ in range(work)) / work)
                out.append(spike)
            return torch.stack(out)

    return Block()


def _probe_pipeline(p: int, schedule, heavy: int = 1):
    """``p`` ranks' pipeline of probe blocks (:func:`_probe_block`), as many stages per rank as
    ``schedule`` (a :class:`~..core.pipeline_schedules.PipelineSchedule`) runs and as many
    micro-batches of 4 samples as stages, rank 0's blocks ``heavy`` times the work of the others:
    the model, its plan and a batch."""
    import torch

    from ..core import analyze, plan

    virtual = schedule.virtual_stages or (2 if schedule.multi_stage else 1)
    first = schedule.rank_stages(0, p, virtual)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(_probe_block(heavy if s in first else 1) for s in range(p * virtual)))
    micro = p * virtual
    pp_plan = plan(analysis=analyze(model), objective="speed", topology={"pp": p}, mode="pp", batch_size=4 * micro,
                   pp_schedule=schedule.name, pp_microbatches=micro, pp_virtual_stages=virtual)
    return model, pp_plan, torch.rand(PROBE_STEPS, 4 * micro, 64, generator=torch.Generator().manual_seed(2))


def _pipeline_step_times(dist, device, schedule, heavy: int) -> dict:
    """Seconds of a training step of :func:`_probe_pipeline` (``schedule``, ``heavy``) on this rank and
    of its waits for sends and receives in it (:func:`~..compat.pipeline_waits`), of one
    micro-batch's forward and backward of a block (and of a heavy block, where ``heavy > 1``) run
    alone (every rank at once, in turns with the steps), each the median of
    :data:`PIPELINE_REPEATS`; the plan, ``heavy`` and the bytes of one transfer."""
    import torch

    from ..compat import pipeline_waits
    from ..core import apply

    model, pp_plan, x = _probe_pipeline(dist.get_world_size(), schedule, heavy)
    blocks = {"light": _probe_block(1).to(device), **({"heavy": _probe_block(heavy).to(device)} if heavy > 1 else {})}
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


def _calibrate_on_rank(with_compute: bool) -> dict:
    """Everything timed in a world of ``p`` ranks (every rank of the world takes part, none idles)."""
    import torch
    import torch.distributed as dist

    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    p = dist.get_world_size()
    alone = _compute_probes(device) if with_compute and dist.get_rank() == 0 else None
    dist.barrier()
    probe, sync = _probe_step(device), torch.cuda.synchronize if cuda else (lambda: None)
    shared = statistics.median(_busy_time(probe, sync) for _ in range(3))  # one loop varied by 30 % here
    gap = _gap_compute(device)
    collectives = {(kind, nbytes): _time_collective(dist, _collective_op(dist, kind, p, nbytes, device), device, gap)
                   for kind in KINDS for nbytes in SIZES_BYTES}
    framework = _wrapped_step_times(dist, device)
    framework["broadcast_burst"] = _time_collective(dist, _broadcast_burst(dist, device), device, gap)
    framework["pipeline"] = {name: [_pipeline_step_times(dist, device, spec, heavy) for heavy in (PIPELINE_HEAVY, 1)]
                             for name, spec in SCHEDULES.items()}
    ranks.report(message=f"calibrated {p} ranks")
    return {"alone": alone, "shared": shared, "collectives": collectives, "framework": framework}


def _overheads(values: List[dict], table: Dict[str, Tuple[float, float]]) -> Dict[str, float]:
    """Per TP-sharded module call, per FSDP2 collective, per DDP step and per ZeRO step: what the
    slowest rank's wrapped step (:func:`_wrapped_step_times`) takes beyond the plain one and beyond
    the collectives it made, as fitted (``table``: kind -> alpha, beta), ZeRO's broadcasts at the
    fixed cost of one in a burst (``broadcast_in_burst``, from :func:`_broadcast_burst`); per
    action and per transfer of each pipeline schedule (:func:`_pipeline_costs`)."""
    times = {k: max(v["framework"][k] for v in values) for k in ("plain", "tp", "fsdp", "ddp", "adam", "zero")}
    made = values[0]["framework"]["collectives"]
    costs = {}
    if "broadcast_burst" in values[0]["framework"]:  # the slowest rank's median, per broadcast
        burst = statistics.median(max(ts) for ts in zip(*(v["framework"]["broadcast_burst"] for v in values)))
        costs["broadcast_in_burst"] = max(burst / BURST - table["broadcast"][1] * 1024, 0.0)
    alpha = {kind: table[kind][0] for kind in KINDS}
    # ZeRO's broadcasts go out back to back
    alpha_of = lambda name, kind: (costs.get("broadcast_in_burst", alpha[kind]) if (name, kind) == ("zero", "broadcast")
                                   else alpha[kind])
    comm = {name: sum(alpha_of(name, kind) + table[kind][1] * nbytes for kind, nbytes in rows)
            for name, rows in made.items()}
    beyond = lambda name, base: max(0.0, times[name] - times[base] - comm[name])
    return {"tp_module": beyond("tp", "plain") / values[0]["framework"]["tp_calls"],
            "fsdp_collective": beyond("fsdp", "plain") / max(1, len(made["fsdp"])),
            "ddp_step": beyond("ddp", "plain"), "zero_step": beyond("zero", "adam"),
            **costs,
            **{key: cost for name in values[0]["framework"].get("pipeline", {})
               for key, cost in _pipeline_costs(name, [v["framework"]["pipeline"][name] for v in values],
                                                table).items()}}


def _probe_costs(values: List[dict], per_action: float = 0.0) -> Dict[Tuple[str, int], float]:
    """Seconds of each ``(action kind, stage)`` of a pipeline probe (every rank's values): its block's
    own time (the slowest rank's), plus ``per_action``."""
    from .pipeline_time import BACKWARD_SHARE

    pp_plan, heavy = values[0]["plan"], values[0]["heavy"]
    first = pp_plan.pp_schedule_spec.rank_stages(0, pp_plan.pp_size, pp_plan.pp_virtual_stages)
    block = lambda s, phase: max(v[f"{'heavy' if s in first and heavy > 1 else 'light'}_{phase}"] for v in values)
    return {(kind, s): per_action + (block(s, "F") if kind == "F" else share * block(s, "B"))
            for s in range(pp_plan.pp_stages) for kind, share in (("F", 1.0), *BACKWARD_SHARE.items())}


def _replayed_step(values: List[dict], table: Dict[str, Tuple[float, float]], per_action: float = 0.0,
                   extra_link: float = 0.0):
    """(seconds of the step, time lines) of a pipeline probe (:func:`_pipeline_step_times`, every
    rank's values) as its schedule replays (:func:`~.pipeline_time.replay_plan`): each action
    :func:`_probe_costs`, each transfer the fitted latency plus ``extra_link``, then the loss broadcast."""
    from .pipeline_time import replay_plan

    pp_plan = values[0]["plan"]
    link = table["send"][0] + table["send"][1] * values[0]["bytes"] + extra_link
    lines = replay_plan(pp_plan, _probe_costs(values, per_action),
                        {(s + d, s + 1 - d): link for s in range(pp_plan.pp_stages - 1) for d in (0, 1)})
    return max(span[-1] for spans in lines.values() for span in spans) + table["broadcast"][0], lines


def _pipeline_costs(name: str, probes: List[List[dict]], table: Dict[str, Tuple[float, float]]) -> Dict[str, float]:
    """A pipeline schedule's own costs from its probes (``probes``: per rank, its
    :func:`_pipeline_step_times` with rank 0's blocks heavy, then with every block alike), neither below 0:

    - ``pp_action:<name>``, per action of a rank (a micro-batch's forward or backward through a
      stage): what the slowest rank (rank 0, heavy) took beyond its actions' compute, its waits for
      transfers and the loss broadcast, per action (a rank that others wait for pays less per
      action than one that waits in turn; a pipeline's step is set by its slowest rank);
    - ``pp_link:<name>``, latency per transfer beyond the fitted send's: what makes the replay of
      the probe with every block alike, with that cost per action, take its measured step."""
    heavy, even = [ranks[0] for ranks in probes], [ranks[1] for ranks in probes]
    rank0 = _replayed_step(heavy, table)[1][0]
    costs = _probe_costs(heavy)
    own = heavy[0]["step"] - heavy[0]["waited"] - table["broadcast"][0] - sum(costs[(k, s)] for k, s, *_ in rank0)
    per_action = max(0.0, own / len(rank0))
    measured = max(v["step"] for v in even)
    step_with = lambda link: _replayed_step(even, table, per_action, link)[0]
    low, high = 0.0, (measured if step_with(0.0) < measured else 0.0)
    for _ in range(40):  # bisection: the replayed step grows with the latency
        mid = (low + high) / 2
        low, high = (mid, high) if step_with(mid) < measured else (low, mid)
    return {f"pp_action:{name}": per_action, f"pp_link:{name}": high}


def _profile_from(runs: Dict[int, List[dict]], backend: str, name: Optional[str],
                  reference_step: Optional[float] = None) -> HardwareProfile:
    """The profile from every rank's values of the world of each group size ``p`` (``runs[p]``);
    sharing relative to ``reference_step`` (the probe step timed in the calling process, as the
    estimator times a model's step there) or, without it, to rank 0's probe step run alone."""
    alone = next(v[0]["alone"] for v in runs.values() if v[0]["alone"] is not None)
    reference_step = reference_step or alone["step"]
    table: Dict[str, Dict[int, Tuple[float, float]]] = {k: {} for k in KINDS}
    sharing, overheads = {}, {}
    for p, values in runs.items():
        sharing[p] = max(v["shared"] for v in values) / reference_step
        for kind in KINDS:
            medians = [statistics.median(max(ts) for ts in zip(*(v["collectives"][(kind, s)] for v in values)))
                       for s in SIZES_BYTES]
            table[kind][p] = fit_alpha_beta(SIZES_BYTES, medians)
        if "framework" in values[0]:
            overheads[p] = _overheads(values, {kind: table[kind][p] for kind in KINDS})
    host = socket.gethostname()
    device = "cuda" if backend == "nccl" else "cpu"
    return HardwareProfile(name=name or f"{host} ({device}, {backend})", device=device, flops_per_s=alone["flops"],
                           bytes_per_s=alone["bandwidth"], op_overhead_s=alone["overhead"], collectives=table,
                           compute_sharing=sharing, framework_overhead=overheads, efficiency=1.0, host=host,
                           source=f"calibrated on {host} {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC "
                                  f"({backend}, {max(runs)} ranks)")


def median_profile(profiles: Sequence[HardwareProfile]) -> HardwareProfile:
    """One profile whose every calibrated figure (compute, each alpha and beta, sharing, wrapper
    costs) is the median over ``profiles``, calibrations of the same sizes."""
    first, med = profiles[0], statistics.median
    if len(profiles) == 1:
        return first
    collectives = {kind: {p: tuple(med(pr.collectives[kind][p][i] for pr in profiles) for i in (0, 1))
                          for p in by_size} for kind, by_size in first.collectives.items()}
    sharing = {p: med(pr.compute_sharing[p] for pr in profiles) for p in first.compute_sharing}
    overheads = {p: {key: med(pr.framework_overhead[p][key] for pr in profiles) for key in costs}
                 for p, costs in first.framework_overhead.items()}
    return replace(first, flops_per_s=med(pr.flops_per_s for pr in profiles),
                   bytes_per_s=med(pr.bytes_per_s for pr in profiles),
                   op_overhead_s=med(pr.op_overhead_s for pr in profiles), collectives=collectives,
                   compute_sharing=sharing, framework_overhead=overheads,
                   source=f"{first.source}, median of {len(profiles)} worlds per size")


def calibrate(group_sizes: Sequence[int] = (2, 4), *, backend: str = "auto", name: Optional[str] = None,
              timeout: float = 120.0, worlds: int = 1) -> HardwareProfile:
    """Measure this machine into a :class:`HardwareProfile` (see the module doc; 42-46 s for sizes 2
    and 4 on a 2-core CPU machine). ``group_sizes`` (each >= 2): the collective group sizes to time, each in
    a world of its own size (ranks that only waited would still take the cores' time);
    ``backend``: ``"auto"`` (NCCL when there is a GPU per rank, else gloo), ``"gloo"`` or ``"nccl"``;
    ``worlds``: fresh worlds per size, the profile their median (:func:`median_profile`): on shared
    CPU cores a collective's latency can differ several times between two worlds."""
    sizes = sorted({positive_int("group size", p) for p in group_sizes})
    worlds = positive_int("worlds", worlds, what="fresh worlds per group size")
    if not sizes or sizes[0] < 2:
        raise ValueError(f"group_sizes={list(group_sizes)}; expected sizes >= 2 (the ranks a collective spans)")
    if "send" in KINDS and sizes[0] % 2:
        raise ValueError(f"group_sizes={list(group_sizes)}: send/recv is timed between rank pairs; use even sizes")
    all_runs, used = [], backend
    for _ in range(worlds):
        runs = {}
        for p in sizes:
            result = ranks.run(_calibrate_on_rank, (p == sizes[0],), nprocs=p, backend=backend, timeout=timeout)
            runs[p], used = result.values, result.backend
        all_runs.append(runs)
    reference = None
    if used == "gloo":  # CPU ranks: against the step in this process, on one thread (see local_correction)
        import torch

        with one_thread():
            probe = _probe_step(torch.device("cpu"))
            reference = statistics.median(_busy_time(probe, lambda: None) for _ in range(3))
    return median_profile([_profile_from(runs, used, name, reference) for runs in all_runs])


_DEFAULT: Dict[str, HardwareProfile] = {}
ENV_VAR = "SNN_EXPLORER_HARDWARE"


def cache_path() -> str:
    """Where this machine's calibration is kept between sessions."""
    import torch

    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    name = f"hardware-v{CALIBRATION_VERSION}-{socket.gethostname()}-torch{torch.__version__}.json"
    return os.path.join(root, "snn_explorer", name)


def default_hardware() -> HardwareProfile:
    """The profile ``estimate`` uses without ``hardware=`` (see the module doc)."""
    chosen = os.environ.get(ENV_VAR)
    if chosen:
        return HardwareProfile.load(chosen) if os.path.exists(chosen) else hardware_profile(chosen)
    if "local" not in _DEFAULT:
        path = cache_path()
        if os.path.exists(path):
            _DEFAULT["local"] = HardwareProfile.load(path)
        else:
            profile = calibrate()
            os.makedirs(os.path.dirname(path), exist_ok=True)
            profile.save(path)
            _DEFAULT["local"] = profile
    return _DEFAULT["local"]
