"""This host's Adam rate: the ``host_adam_params_per_s`` of a :class:`~..timing.hardware.HardwareProfile`.

FSDP2's CPU offload steps ``torch.optim.Adam`` on the host over each rank's parameter shard (CPU tensors, torch's
default implementation for them). :func:`this_host_adam_rate` times that step here on one thread (a rank's share
of the host's cores) over ``tensors`` fp32 tensors of ``numel`` elements each, after one step that creates the
state, and returns the parameters updated per second of the fastest of ``repeats`` steps.
"""
from __future__ import annotations

import time

import torch

from ...core.common import positive_int
from ..instruments.isolation import one_thread

__all__ = ["this_host_adam_rate"]


def this_host_adam_rate(numel: int = 1 << 20, tensors: int = 8, repeats: int = 3) -> float:
    """Adam parameter updates per second on this host's CPU, one thread (see the module doc)."""
    numel, tensors, repeats = (positive_int(n, v) for n, v in (("numel", numel), ("tensors", tensors),
                                                                 ("repeats", repeats)))
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel, generator=generator)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(numel, generator=generator)
    opt = torch.optim.Adam(params, lr=1e-3)
    best = float("inf")
    with one_thread():
        opt.step()  # creates the state (exp_avg, exp_avg_sq)
        for _ in range(repeats):
            started = time.perf_counter()
            opt.step()
            best = min(best, time.perf_counter() - started)
    return numel * tensors / best
