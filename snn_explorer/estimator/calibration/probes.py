"""What calibrate() times on each rank: compute alone, a small spiking step, and every collective
kind issued between a little compute, as a training step issues it."""
from __future__ import annotations

import statistics
import time
from typing import Dict, List

import torch

from ...core.common import Collective, precision_of
from ..timing.hardware import HALF_PRECISIONS

#: Buffer sizes (bytes) each collective is timed at, repetitions per size, collectives per repetition.
SIZES_BYTES = (4 * 2 ** 10, 256 * 2 ** 10, 2 ** 20, 4 * 2 ** 20, 16 * 2 ** 20)
REPEATS = 5
LOOP_OPS = 8
#: 64 x 64 matmuls run before each timed collective (see :func:`time_collective`).
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


def median_time(fn, repeats: int, sync) -> float:
    fn()
    sync()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def compute_probes(device) -> Dict[str, float]:

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    n = 1024 if device.type == "cuda" else 256
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    big = torch.randn(2 ** 22 if device.type == "cuda" else 2 ** 20, device=device)
    tiny = torch.ones(1, device=device)
    flops = 2 * n ** 3 / median_time(lambda: a @ b, 5, sync)
    bandwidth = 3 * big.numel() * 4 / median_time(lambda: big + big, 5, sync)
    loop = 200
    overhead = median_time(lambda: [tiny + tiny for _ in range(loop)], 3, sync) / loop
    return dict(flops=flops, bandwidth=bandwidth, overhead=overhead, step=busy_time(probe_step(device), sync),
                half=half_probes(device))


def half_probes(device) -> Dict[str, Dict[str, float]]:
    """Per half precision ``device``'s autocast runs (bf16; fp16 where offered): the FLOP/s of the
    same square matmul as :func:`compute_probes` and the bytes/s of the same elementwise add, on
    tensors of that dtype (the kernels autocast dispatches to; its casts are operators of their own)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    n = 1024 if device.type == "cuda" else 256
    rates = {}
    for name in HALF_PRECISIONS:
        precision = precision_of(name)
        try:
            precision.check_device(device.type)
        except ValueError:  # this device's autocast does not run it: no rate to measure
            continue
        dtype = precision.compute_dtype
        a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
        big = torch.randn(2 ** 22 if device.type == "cuda" else 2 ** 20, device=device).to(dtype)
        rates[name] = dict(flops_per_s=2 * n ** 3 / median_time(lambda: a @ b, 5, sync),
                           bytes_per_s=3 * big.numel() * big.element_size() / median_time(lambda: big + big, 5, sync))
    return rates


def leaky_spike(mem, current):
    """One time step of the probes' neuron: leaky integration, a smooth spike, a soft reset; the new
    membrane and the spike."""
    mem = 0.9 * mem + current
    spike = torch.sigmoid(4 * (mem - 1))
    return mem - spike, spike


def probe_step(device):
    """One training step of a small spiking MLP: 8 time steps of linear -> leaky integration -> a
    smooth spike -> linear, backward, SGD update. Many small operators and a few matmuls, like the
    SNN steps whose slow-down on a shared host it measures (a matmul alone missed most of it)."""
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(64, 128, generator=g).div_(8).to(device).requires_grad_()
    w2 = torch.randn(128, 10, generator=g).div_(8).to(device).requires_grad_()
    x = torch.rand(8, 16, 64, generator=g).to(device)

    def step():
        mem, out = torch.zeros(16, 128, device=device), 0
        for t in range(x.shape[0]):
            mem, spike = leaky_spike(mem, x[t] @ w1)
            out = out + spike @ w2
        out.square().mean().backward()
        with torch.no_grad():
            for w in (w1, w2):
                w -= 1e-3 * w.grad
                w.grad = None

    return step


def busy_time(op, sync, seconds: float = SHARING_PROBE_S) -> float:
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


def collective_op(dist, kind: str, p: int, nbytes: int, device):
    """One ``kind`` collective of ``nbytes`` over the world's ``p`` ranks, as a callable."""
    rank, elems = dist.get_rank(), nbytes // 4
    if kind == Collective.ALL_GATHER:
        out, inp = torch.empty(elems, device=device), torch.ones(elems // p, device=device)
        return lambda: dist.all_gather_into_tensor(out, inp)
    if kind == Collective.REDUCE_SCATTER:
        out, inp = torch.empty(elems // p, device=device), torch.ones(elems, device=device)
        return lambda: dist.reduce_scatter_tensor(out, inp)
    buf = torch.ones(elems, device=device)
    if kind == Collective.SEND:
        return (lambda: dist.send(buf, rank + 1)) if rank % 2 == 0 else (lambda: dist.recv(buf, rank - 1))
    return (lambda: dist.all_reduce(buf)) if kind == Collective.ALL_REDUCE else (lambda: dist.broadcast(buf, 0))


def gap_compute(device):
    """A little compute (some 0.1 ms on a CPU core) to run between timed collectives, as a step does."""
    a = torch.randn(64, 64, device=device)

    def gap():
        for _ in range(GAP_MATMULS):
            a @ a
    return gap


def broadcast_burst(dist, device):
    """:data:`BURST` broadcasts of 1 KiB issued at once, each from the next rank, then waited for
    (as ZeroRedundancyOptimizer sends each rank's updated parameters), as a callable."""
    p, bufs = dist.get_world_size(), [torch.ones(256, device=device) for _ in range(BURST)]

    def burst():
        for work in [dist.broadcast(buf, src=i % p, async_op=True) for i, buf in enumerate(bufs)]:
            work.wait()
    return burst


def time_collective(dist, op, device, gap) -> List[float]:
    """Seconds the collective(s) ``op()`` adds to a stream of compute, :data:`REPEATS` times after a
    warm-up: a loop of :data:`LOOP_OPS` (``gap()``, ``op()``) against the same loop of ``gap()``
    alone. Issued between compute, as in a training step, a collective also pays for waking the
    ranks that wait in it: on ranks sharing a CPU's cores that costs several times the latency of
    collectives timed back to back."""
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


def probe_net(device):
    """The small spiking MLP the wrappers are timed on: ``Linear(64, 128) -> Linear(128, 128) ->
    Linear(128, 10)`` with a leaky, smoothly spiking state after the first two, run over
    :data:`PROBE_STEPS` time steps inside its forward, as the zoo's SNNs run."""
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
