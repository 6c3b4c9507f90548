"""FSDP2's collectives unit by unit against the traced step's kernels: what of them the compute hides.

FSDP2 issues one all-gather per unit before the unit's forward (again before its backward when it
reshards after the forward; the root never does) and one reduce-scatter after the unit's backward
(``torch.distributed.fsdp.fully_shard``). They run on their own streams, so they overlap the compute,
but they all go through one NCCL communicator, which runs them one after another in the order they
were issued. The walk below replays a traced step (:func:`~..memory.gpu_trace.trace_step`, whose event
log places each unit's forward and backward among the kernels) on two clocks, the compute stream's
and the communicator's:

- a unit's all-gather is issued one unit ahead (FSDP2 prefetches the next unit's: the CPU runs ahead
  of the GPU in the forward, the backward prefetches explicitly), i.e. when the previous gated unit
  started computing, and its compute waits for it;
- a unit's reduce-scatter is issued when its last gradient is computed (the root's at the end of the
  backward), and the step ends when both clocks have;

Around each collective FSDP2 runs copies (torch's ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``),
memory-bound kernels timed as the trace times one (``copy_s(bytes moved)``):

- before an all-gather, ``all_gather_copy_in`` copies the rank's shards into the all-gather input (on the
  all-gather's copy-in stream: on the communicator's clock here), reading and writing ``flat / dp`` bytes;
- after it, ``foreach_all_gather_copy_out`` (``split_with_sizes_copy``, run by ``wait_for_unshard`` on the
  compute stream) copies the gathered buffer into the unsharded parameters: ``flat`` read, ``unsharded``
  written, on the compute clock before the unit's compute;
- before a reduce-scatter, ``foreach_reduce_scatter_copy_in`` (``torch._chunk_cat`` of the unsharded
  gradients, on the reduce-scatter stream) reads the gradients and writes the reduce-scatter input:
  ``2 * scatter_bytes`` on the communicator's clock.

``exposed = end - compute`` (the compute-stream copies included). The collectives are timed by the profile
(:meth:`HardwareProfile.collective_time`).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence

from ...core.common import Collective
from .hardware import HardwareProfile
from .placement import ranks_on_host, spans_nodes


def fsdp_exposed_s(log, kernel_s: Sequence[float], units, reshard: bool,
                   collective_s: Callable[[str, int], float], dp: int = 1,
                   copy_s: Callable[[int], float] = lambda nbytes: 0.0) -> float:
    """Seconds of FSDP2 communication (and its compute-stream copies) the compute does not hide (module doc).
    ``log``: the traced step's :class:`~..instruments.fsdp_events.EventLog`; ``kernel_s``: seconds of each of its
    kernels in order; ``units``: the plan's :class:`~..memory.fsdp_timeline.Unit` s; ``collective_s(kind,
    bytes)``: one collective's seconds; ``dp``: ranks sharing each unit; ``copy_s(bytes)``: one copy kernel's
    seconds moving that many bytes (read plus written)."""
    by_path = {u.path: u for u in units}
    prefix: List[float] = [0.0]
    for s in kernel_s:
        prefix.append(prefix[-1] + s)
    last_post: Dict[str, int] = {}
    for i, (kind, path, *_rest) in enumerate(log.events):
        if kind == "post_backward" and path in by_path:
            last_post[path] = i
    clock = comm = issue = 0.0
    done = 0
    gathered_fwd, gathered_bwd = set(), set()
    phase = "forward"
    for i, (kind, path, *_rest) in enumerate(log.events):
        at = log.kernel_at[i]
        clock += prefix[at] - prefix[done]
        done = at
        if kind == "forward_end":
            phase, issue = "backward", clock
        gate = None
        if kind == "pre_forward" and path in by_path and (path not in gathered_fwd or (reshard and path)):
            gathered_fwd.add(path)
            gate = by_path[path].flat
        elif kind == "pre_backward" and phase == "backward" and reshard and path and path in by_path \
                and path not in gathered_bwd:
            gathered_bwd.add(path)
            gate = by_path[path].flat
        if gate is not None:  # issued one unit ahead, waited for by this unit's compute
            comm = max(comm, issue) + copy_s(2 * gate // dp) + collective_s(Collective.ALL_GATHER, gate)
            clock = max(clock, comm) + copy_s(gate + by_path[path].unsharded)  # copy-out on the compute stream
            issue = clock
        if (kind == "post_backward" and last_post.get(path) == i) or (kind == "end_backward" and "" in by_path
                                                                 and "" not in last_post):
            unit = by_path[path if kind == "post_backward" else ""]
            comm = max(comm, clock) + copy_s(2 * unit.scatter_bytes) + collective_s(Collective.REDUCE_SCATTER,
                                                                                     unit.scatter_bytes)
    clock += prefix[-1] - prefix[done]
    return max(clock, comm) - prefix[-1]


def fsdp_collective_s(plan, hw: HardwareProfile) -> Callable[[str, int], float]:
    """One FSDP2 collective's seconds on ``hw`` for ``plan``'s dp groups."""
    dp = plan.dp_size
    spans = spans_nodes(plan, "dp", hw, dp)
    concurrent = max(1, ranks_on_host(plan, hw) // dp)
    return lambda kind, nbytes: hw.collective_time(kind, dp, nbytes, 1, spans, concurrent=concurrent)
