"""CollectiveRecorder: every collective issued under it, with its mesh dim, phase and bytes.

A TorchDispatchMode that sees both the c10d ops that DDP, FSDP2 and ZeroRedundancyOptimizer call
and the functional collectives DTensor redistributions issue. ``bytes`` is the size of the full
(logical) buffer: the tensor of an all-reduce or broadcast, the output of an all-gather, the
input of a reduce-scatter.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ...compat import (
    ALLGATHER_BASE,
    FUNCTIONAL_COLLECTIVES,
    REDUCE_SCATTER_BASE,
    TorchDispatchMode,
    resolve_process_group,
)
from ...core.common import Collective

_c10d = torch.ops.c10d
_fn = FUNCTIONAL_COLLECTIVES


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _group(arg: Any) -> Tuple[str, Optional[frozenset]]:
    """``(name, ranks)`` of a c10d op's boxed ProcessGroup, ``(name, None)`` of a functional
    collective's ``group_name``."""
    if isinstance(arg, str):
        return arg, None
    if isinstance(arg, torch.ScriptObject):
        arg = dist.ProcessGroup.unbox(arg)
    return arg.group_name, frozenset(dist.get_process_group_ranks(arg))


# op packet -> (kind, index of the group argument, index of the argument whose size is counted)
_OPS = {
    _c10d.allreduce_: (Collective.ALL_REDUCE, 1, 0),
    _c10d.allreduce_coalesced_: (Collective.ALL_REDUCE, 1, 0),
    _c10d.broadcast_: (Collective.BROADCAST, 1, 0),
    ALLGATHER_BASE: (Collective.ALL_GATHER, 2, 0),
    _c10d.allgather_: (Collective.ALL_GATHER, 2, 0),
    _c10d.allgather_coalesced_: (Collective.ALL_GATHER, 2, 0),
    _c10d.allgather_into_tensor_coalesced_: (Collective.ALL_GATHER, 2, 0),
    REDUCE_SCATTER_BASE: (Collective.REDUCE_SCATTER, 2, 1),
    _c10d.reduce_scatter_: (Collective.REDUCE_SCATTER, 2, 1),
    _c10d.reduce_scatter_tensor_coalesced_: (Collective.REDUCE_SCATTER, 2, 1),
    _c10d.alltoall_base_: ("all_to_all", 2, 1),
    _c10d.alltoall_: ("all_to_all", 2, 1),
    _c10d.send: (Collective.SEND, 1, 0),
    _c10d.recv_: (Collective.RECV, 1, 0),
    _fn.all_reduce: (Collective.ALL_REDUCE, 2, 0),
    _fn.all_reduce_coalesced: (Collective.ALL_REDUCE, 2, 0),
    _fn.broadcast: (Collective.BROADCAST, 2, 0),
    _fn.reduce_scatter_tensor: (Collective.REDUCE_SCATTER, 3, 0),
    _fn.reduce_scatter_tensor_coalesced: (Collective.REDUCE_SCATTER, 3, 0),
    _fn.all_to_all_single: ("all_to_all", 3, 0),
}
# All-gathers whose output the functional op allocates: bytes = input x group size.
_GATHERS = {_fn.all_gather_into_tensor: 2, _fn.all_gather_into_tensor_coalesced: 2}


@dataclass
class CollectiveRecorder(TorchDispatchMode):
    """Record collectives as ``(group_name, ranks, kind, phase, bytes)`` (``ranks`` None where the op
    names its group only); set ``phase`` as the step runs. Point-to-point sends and receives take
    their phase from ``labels`` (by tensor ``data_ptr``) where it names them. ``blocked_s`` sums the time spent in the
    collective calls and functional-collective waits it sees (waits on c10d ``Work`` objects, as
    DDP and FSDP2 make, happen outside the dispatcher and are not in it)."""

    phase: str = "forward"
    events: List[tuple] = field(default_factory=list)
    blocked_s: float = 0.0  # seconds inside collective calls and functional-collective waits
    labels: Dict[int, str] = field(default_factory=dict)  # a send / recv tensor's data_ptr -> its phase

    def __post_init__(self):
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        packet = getattr(func, "overloadpacket", None)
        if packet in _OPS or packet in _GATHERS or packet is _fn.wait_tensor:
            self.blocked_s += time.perf_counter() - start
        if packet in _OPS:
            kind, g, b = _OPS[packet]
            phase = self.labels.get(args[0][0].data_ptr(), self.phase) if kind in (Collective.SEND, Collective.RECV) else self.phase
            self.events.append((*_group(args[g]), kind, phase, _nbytes(args[b])))
        elif packet in _GATHERS:
            self.events.append((*_group(args[_GATHERS[packet]]), Collective.ALL_GATHER, self.phase,
                                _nbytes(args[0]) * int(args[1])))
        return out

    def table(self, mesh_groups: Mapping[str, Any]) -> List[dict]:
        """Rows ``mesh_dim, kind, phase, count, bytes`` summed over events.

        ``mesh_groups`` maps each mesh dim to its ProcessGroup (``mesh.get_group(dim)``). A group is
        named by the mesh dim it is, else by the dim with the same ranks (an equal group of an
        earlier mesh, which DTensor may reuse); other groups keep their name.
        """
        by_name = {g.group_name: d for d, g in mesh_groups.items()}
        by_ranks = {frozenset(dist.get_process_group_ranks(g)): d for d, g in mesh_groups.items()}
        rows: Dict[tuple, List[int]] = {}
        for group, ranks, kind, phase, nbytes in self.events:
            if group not in by_name:
                ranks = ranks or frozenset(dist.get_process_group_ranks(resolve_process_group(group)))
                by_name[group] = by_ranks.get(ranks, group)
            key = (by_name[group], kind, phase)
            acc = rows.setdefault(key, [0, 0])
            acc[0] += 1
            acc[1] += nbytes
        return [dict(mesh_dim=d, kind=k, phase=p, count=c, bytes=n) for (d, k, p), (c, n) in rows.items()]
