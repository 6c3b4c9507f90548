"""Bytes on the wire: what one rank sends for a collective, by the algorithm its backend runs.

A collective table's ``bytes`` is the buffer (all-reduce / broadcast: the tensor, all-gather: the
output, reduce-scatter: the input). What crosses a rank's link is a fraction of it that depends on
the algorithm, the factor nccl-tests calls the algorithm-to-bus bandwidth ratio
(``nccl-tests/doc/PERFORMANCE.md``):

- ring all-reduce (a reduce-scatter, then an all-gather, around the ring): ``2 (p - 1) / p``;
- NCCL's double binary tree all-reduce: every one of the ``p - 1`` edges of each tree carries its
  half of the buffer up and down, ``2 (p - 1) / p`` per rank on average as well (the ranks differ:
  a tree's inner ranks send more than its leaves);
- ring all-gather / reduce-scatter: ``(p - 1) / p`` (each rank forwards ``p - 1`` chunks of ``1/p``);
- broadcast (NCCL's pipelined ring, gloo's binomial tree): ``p - 1`` copies of the buffer leave the
  ranks, ``(p - 1) / p`` per rank on average (the root and inner ranks send more, leaves nothing);
- send / recv: the whole buffer, one way.

gloo (``ProcessGroupGloo`` on CPU) runs its all-reduce and all-gather as rings, its broadcast as a
binomial tree, and its ``reduce_scatter_tensor`` as a full ring all-reduce whose slice each rank
keeps: ``2 (p - 1) / p``, twice a ring reduce-scatter's bytes (measured: each rank's ``wchar``
counter of ``/proc/self/io`` over one call, 4 MiB buffers on 2 and 4 ranks, tests/test_wire_bytes.py).
NCCL picks ring or tree by size and topology (``NCCL_ALGO``); the table labels an all-reduce over
ranks of more than one node ``tree`` and the rest ``ring``, which send the same bytes on average.
"""
from __future__ import annotations

from typing import Tuple

import pandas as pd

from ...core.common import Collective
from .placement import group_size, spans_nodes

#: The algorithm each backend runs per collective kind (NCCL's all-reduce: ``tree`` across nodes).
_ALGORITHMS = {
    "gloo": {Collective.ALL_REDUCE: "ring", Collective.ALL_GATHER: "ring",
             Collective.REDUCE_SCATTER: "ring all-reduce", Collective.BROADCAST: "binomial tree",
             Collective.SEND: "point-to-point", Collective.RECV: "point-to-point"},
    "nccl": {Collective.ALL_REDUCE: "ring", Collective.ALL_GATHER: "ring", Collective.REDUCE_SCATTER: "ring",
             Collective.BROADCAST: "ring", Collective.SEND: "point-to-point", Collective.RECV: "point-to-point"},
}
#: The communication backends whose algorithms are known (``ranks.COMM_BACKENDS`` less ``auto``, which resolves
#: to one of them: :func:`backend_of`).
BACKENDS = tuple(_ALGORITHMS)


def algorithm(kind: str, backend: str, spans_nodes: bool = False) -> str:
    """The algorithm ``backend`` runs a collective of ``kind`` with (see the module doc)."""
    if backend not in _ALGORITHMS:
        raise ValueError(f"unknown communication backend {backend!r}; expected one of {BACKENDS}")
    kind = Collective(kind)
    if backend == "nccl" and kind is Collective.ALL_REDUCE and spans_nodes:
        return "tree"
    return _ALGORITHMS[backend][kind]


def wire_factor(kind: str, p: int, algo: str) -> float:
    """Bytes one rank sends per byte of the buffer, for a collective of ``kind`` over ``p`` ranks
    run as ``algo`` (a mean over the ranks where they differ)."""
    if p < 1:
        raise ValueError(f"a collective's group has at least one rank, got p={p}")
    kind = Collective(kind)
    if p == 1 and kind not in (Collective.SEND, Collective.RECV):
        return 0.0
    if algo in ("ring", "tree", "ring all-reduce", "binomial tree"):
        full = Collective.ALL_REDUCE if algo in ("tree", "ring all-reduce") else kind
        return full.ring_fraction(p) if full is not Collective.BROADCAST else (p - 1) / p
    if algo == "point-to-point":
        return 1.0
    raise ValueError(f"unknown collective algorithm {algo!r}")


def wire_bytes(kind: str, nbytes: int, p: int, backend: str, spans_nodes: bool = False) -> Tuple[str, int]:
    """``(algorithm, bytes one rank sends)`` for a collective of ``kind`` on a buffer of ``nbytes``."""
    algo = algorithm(kind, backend, spans_nodes)
    return algo, round(nbytes * wire_factor(kind, p, algo))


def backend_of(hardware) -> str:
    """The backend a plan's ranks communicate with on ``hardware``: gloo on CPU, NCCL on a GPU."""
    return "gloo" if hardware.device == "cpu" else "nccl"


def with_wire_bytes(collectives: pd.DataFrame, plan, hardware) -> pd.DataFrame:
    """``collectives`` (rows ``mesh_dim, kind, phase, count, bytes``) with two columns more:
    ``algorithm`` and ``wire_bytes`` (what each rank sends over the step), for ``plan``'s group sizes
    on ``hardware``'s backend."""
    backend = backend_of(hardware)
    algos, wire = [], []
    for dim, kind, nbytes in zip(collectives["mesh_dim"], collectives["kind"], collectives["bytes"]):
        p = group_size(plan, dim, kind)
        algo, sent = wire_bytes(kind, int(nbytes), p, backend, spans_nodes(plan, dim, hardware, p))
        algos.append(algo)
        wire.append(sent)
    return collectives.assign(algorithm=pd.Series(algos, index=collectives.index, dtype=object),
                              wire_bytes=pd.Series(wire, index=collectives.index, dtype="int64"))
