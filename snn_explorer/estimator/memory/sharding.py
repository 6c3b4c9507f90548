"""Per-rank bytes of parameters, gradients, optimizer state and buffers under a plan.

Exact arithmetic of the shards torch creates: TP splits the dims its style names
(``core.styles``: ``colwise`` weight and bias dim 0, ``rowwise`` weight dim 1, ...), FSDP2 chunks dim 0 of each
(TP-local) parameter over ``dp`` like ``torch.chunk`` into padded storage, and
ZeroRedundancyOptimizer assigns whole parameters to ranks greedily, largest first.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ...core import SNNDistributedPlan
from ...core.parallelize import fsdp_units_of
from ...core.tp import STYLES
from ..profile.step import OPTIMIZERS, check_optimizer

#: Optimizer state tensors per parameter, each the size of the (local) parameter.


class HashedOnce:
    """A frozen dataclass whose ``__hash__`` keeps its value in ``_hash``: not pickled or copied along, since
    a string's hash differs between processes."""

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state


@dataclass(frozen=True)
class Param(HashedOnce):
    """A parameter as a rank of the plan holds it: ``shape`` after TP, FSDP2 group if any."""

    name: str
    shape: Tuple[int, ...]
    itemsize: int
    group: str = ""  # FSDP2 unit path ('' = the root group); None-like '' also for non-FSDP plans
    gather_size: int = 0  # bytes per element FSDP2 all-gathers and computes it in (0: ``itemsize``)

    @property
    def gathered_itemsize(self) -> int:
        return self.gather_size or self.itemsize

    def __hash__(self) -> int:  # the fields' hash, computed once (ZeRO's partition is cached by the parameters)
        found = self.__dict__.get("_hash")
        if found is None:
            found = hash((self.name, self.shape, self.itemsize, self.group, self.gather_size))
            object.__setattr__(self, "_hash", found)
        return found

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    def rows(self, dp: int, dp_rank: int) -> Tuple[int, int]:
        """(padded rows, real rows) of this rank's FSDP2 dim-0 chunk."""
        dim0 = self.shape[0] if self.shape else 1
        chunk = -(-dim0 // dp)
        return chunk, max(0, min(chunk, dim0 - dp_rank * chunk))

    @functools.cached_property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1


def tp_local_shape(plan: SNNDistributedPlan, name: str, shape: Sequence[int]) -> Tuple[int, ...]:
    """The shape of parameter or buffer ``name`` on one TP rank of ``plan`` (its owner's style says)."""
    return tp_local_shapes(plan)(name, shape)


def tp_local_shapes(plan: SNNDistributedPlan) -> Callable[[str, Sequence[int]], Tuple[int, ...]]:
    """:func:`tp_local_shape` of ``plan`` as a function of ``(name, shape)``: the plan's TP size and layout read
    once, for loops over every parameter or buffer."""
    tp = plan.tp_size
    if tp == 1:
        return _whole_shape
    layout = plan.tensor_parallel_plan

    def local_shape(name: str, shape: Sequence[int]) -> Tuple[int, ...]:
        owner, _, leaf = name.rpartition(".")
        style = STYLES.get(layout.get(owner))
        return tuple(shape) if style is None else style.local_shape(leaf, shape, tp)
    return local_shape


def _whole_shape(name: str, shape: Sequence[int]) -> Tuple[int, ...]:
    return tuple(shape)


def fsdp_group_of(units, name: str) -> str:
    """The innermost FSDP2 unit (a set of module paths) that holds parameter ``name``; '' = the root."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in units:
            return prefix
    return ""


def fsdp_groups(params: Sequence[Param]) -> Dict[str, List[Param]]:
    """The parameters of each FSDP2 group (unit path, '' = the root), in parameter order."""
    groups: Dict[str, List[Param]] = {}
    for p in params:
        groups.setdefault(p.group, []).append(p)
    return groups


def fsdp_group_sizes(group: Sequence[Param], dp: int, reduce_itemsize: Optional[int] = None) -> Tuple[int, int, int, int]:
    """``(unsharded, gather, master, scatter)`` bytes of one FSDP2 group, in one pass over its parameters: as the
    forward uses them (each at its gather dtype); the all-gather output (``dp`` padded dim-0 chunks, each parameter at
    its gather dtype); the reduce-scatter input at the parameters' own dtypes and at ``reduce_itemsize`` (None: their
    own as well)."""
    unsharded = gather = master = scatter = 0
    for p in group:  # numel = dim 0 x row numel (1 x 1 for a scalar): one cached figure read per parameter
        dim0, row_numel, gathered = p.shape[0] if p.shape else 1, p.row_numel, p.gather_size or p.itemsize
        padded = -(-dim0 // dp) * row_numel
        unsharded += dim0 * row_numel * gathered
        gather += padded * gathered
        master += padded * p.itemsize
        scatter += padded * (reduce_itemsize or p.itemsize)
    return unsharded, dp * gather, dp * master, dp * scatter


def gather_itemsize(plan: SNNDistributedPlan) -> Optional[int]:
    """Bytes per element FSDP2 all-gathers and computes parameters in under ``plan``'s precision
    (``MixedPrecisionPolicy.param_dtype``); None: the parameters' own. Norm layers' own units gather
    in the parameters' own dtype (``core.parallelize.fsdp``; :func:`local_params` leaves them so)."""
    return plan.precision.itemsize("param") if plan.precision.param_dtype is not None else None


def reduce_itemsize(plan: SNNDistributedPlan) -> Optional[int]:
    """Bytes per element gradients are reduced in over dp under ``plan``'s precision; None: their own."""
    return plan.precision.itemsize("reduce") if plan.precision.reduce_dtype is not None else None


def as_gathered(params: Sequence[Param]) -> List[Param]:
    """``params`` as FSDP2 holds them unsharded (all-gather output, the parameters the forward uses):
    each at the dtype it is gathered in."""
    return [p if not p.gather_size else dataclasses.replace(p, itemsize=p.gather_size) for p in params]


def ddp_reduce_bytes(params: Sequence[Param], bucket_bytes: int, plan: SNNDistributedPlan) -> int:
    """Bytes DDP all-reduces per step: its buckets' (``bucket_bytes``, the gradients at their own dtype),
    or every gradient at ``plan``'s reduce dtype, to which its communication hook casts each bucket."""
    size = reduce_itemsize(plan)
    if size is None or all(p.itemsize == size for p in params):
        return bucket_bytes
    return sum(p.numel for p in params) * size


#: The last few :func:`local_params` results, by what they are made of (one estimate after another asks again).
_RECENT_PARAMS: Dict[tuple, tuple] = {}
_RECENT_KEPT = 8


def local_params(shapes: Sequence[Tuple[str, Tuple[int, ...]]], plan: SNNDistributedPlan,
                 itemsize: Union[int, Mapping[str, int]], norm_layers: Sequence[str] = ()) -> List[Param]:
    """Every trainable parameter (``profile.profiling.trainable_shapes``) as one rank holds it before FSDP2 sharding
    (TP applied); ``itemsize``: one for all, or per parameter name (models that mix dtypes). Under FSDP2 each
    is in the unit ``apply`` gives it (``core.parallelize.fsdp.fsdp_units_of``: the plan's units, and under half
    precision each of ``norm_layers`` its own) and gathered in that unit's dtype. The same ``Param`` objects come
    back for the same arguments (a per-name ``itemsize`` by identity) and plan layout, TP size, units and precision."""
    mapping = isinstance(itemsize, Mapping)
    key = (tuple(shapes), plan.tp_size, tuple(sorted(plan.tensor_parallel_plan.items())), plan.uses_fsdp,
           tuple(plan.fsdp_units), plan.precision, id(itemsize) if mapping else itemsize, tuple(norm_layers))
    found = _RECENT_PARAMS.get(key)
    if found is None or found[0] is not itemsize and mapping:
        found = (itemsize, tuple(_local_params(shapes, plan, itemsize, norm_layers)))
        _RECENT_PARAMS.pop(key, None)
        if len(_RECENT_PARAMS) >= _RECENT_KEPT:
            del _RECENT_PARAMS[next(iter(_RECENT_PARAMS))]
        _RECENT_PARAMS[key] = found
    return list(found[1])


def _local_params(shapes: Sequence[Tuple[str, Tuple[int, ...]]], plan: SNNDistributedPlan,
                  itemsize: Union[int, Mapping[str, int]], norm_layers: Sequence[str] = ()) -> List[Param]:
    size_of = itemsize.__getitem__ if isinstance(itemsize, Mapping) else (lambda _: itemsize)
    local_shape = tp_local_shapes(plan)
    if not plan.uses_fsdp:
        return [Param(n, local_shape(n, shape), size_of(n)) for n, shape in shapes]
    units = fsdp_units_of(plan.fsdp_units, norm_layers, plan.precision)
    paths, gather = set(units.paths), gather_itemsize(plan) or 0
    params = []
    for n, shape in shapes:
        group = fsdp_group_of(paths, n)
        params.append(Param(n, local_shape(n, shape), size_of(n), group, 0 if group in units.fp32 else gather))
    return params


def zero_partition(params: Sequence[Param], world: int) -> List[List[Param]]:
    """ZeroRedundancyOptimizer's partition: largest first, each to the least-loaded rank (the lowest
    such rank on ties). Only ranks that own something are listed: at most ``len(params)``, since a
    rank beyond them never becomes the least loaded one first."""
    return _zero_partition(tuple(params), world)


@functools.lru_cache(maxsize=16)
def _zero_partition(params: Tuple[Param, ...], world: int) -> List[List[Param]]:
    ranks = min(world, len(params))
    heap, parts = [(0, r) for r in range(ranks)], [[] for _ in range(ranks)]
    for p in sorted(params, key=lambda p: p.numel, reverse=True):
        load, rank = heapq.heappop(heap)
        parts[rank].append(p)
        heapq.heappush(heap, (load + p.numel, rank))
    return parts


def zero_owned(params: Sequence[Param], world: int, rank: int) -> List[Param]:
    """The parameters dp rank ``rank`` updates under ZeRO (see :func:`zero_partition`)."""
    parts = zero_partition(params, world)
    return parts[rank] if rank < len(parts) else []


#: The last few :func:`shape_census` results, by the identities of the parameters (kept alive beside them).
_RECENT_CENSUS: Dict[tuple, tuple] = {}


def shape_census(params: Sequence[Param]) -> Tuple[Tuple[int, int, int, int], ...]:
    """``(dim0, row numel, itemsize, how many)`` of ``params``, one row per distinct triple in first-seen order: what
    FSDP2's per-rank sums read of a parameter (dim 0, 1 for a scalar), so that those sums run over distinct shapes.
    The same result for the same parameter objects, a few kept."""
    key = tuple(map(id, params))
    found = _RECENT_CENSUS.get(key)
    if found is None:
        counts: Dict[Tuple[int, int, int], int] = {}
        for p in params:
            triple = (p.shape[0] if p.shape else 1, p.row_numel, p.itemsize)
            counts[triple] = counts.get(triple, 0) + 1
        found = (tuple(params), tuple((*t, n) for t, n in counts.items()))
        if len(_RECENT_CENSUS) >= _RECENT_KEPT:
            del _RECENT_CENSUS[next(iter(_RECENT_CENSUS))]
        _RECENT_CENSUS[key] = found
    return found[1]


def _chunk_rows(dim0: int, dp: int, dp_rank: int) -> Tuple[int, int]:
    """:meth:`Param.rows` of a parameter with ``dim0`` rows."""
    chunk = -(-dim0 // dp)
    return chunk, max(0, min(chunk, dim0 - dp_rank * chunk))


def dp_roles(params: Sequence[Param], plan: SNNDistributedPlan) -> List[int]:
    """The first dp rank of each run of dp ranks that hold the same shards, in order.

    Every dp rank from ``roles[i]`` up to ``roles[i + 1]`` holds what ``roles[i]`` holds, so a
    per-rank table costs one evaluation per role, not per rank: one role without sharding, a
    ZeRO owner each (at most one per parameter) and the empty rest, and under FSDP2 the ranks of
    full, partial and empty dim-0 chunks (two boundaries per parameter).
    """
    dp = plan.dp_size
    if plan.uses_fsdp:
        starts = {0}
        for dim0 in {row[0] for row in shape_census(params)}:
            chunk = -(-dim0 // dp)
            starts.update({dim0 // chunk, -(-dim0 // chunk)})
        return sorted(r for r in starts if r < dp)
    if plan.uses_zero:
        return list(range(min(dp, len(params) + 1)))
    return [0]


@functools.lru_cache(maxsize=None)
def step_bytes(optimizer: str) -> int:
    """Bytes of the per-parameter ``step`` counter (Adam family; a 0-dim float tensor), as the
    optimizer itself creates it on a one-element parameter."""
    if not OPTIMIZERS[optimizer].counts_steps:
        return 0
    param = nn.Parameter(torch.zeros(1))
    param.grad = torch.zeros(1)
    opt = OPTIMIZERS[optimizer].make([param], lr=1e-3)
    opt.step()
    return opt.state[param]["step"].element_size()


def _state(numel: int, itemsize: int, optimizer: str) -> int:
    return OPTIMIZERS[optimizer].state_tensors * numel * itemsize + step_bytes(optimizer)


def rank_bytes(params: Sequence[Param], plan: SNNDistributedPlan, rank: int, optimizer: str) -> Dict[str, int]:
    """``params_bytes``, ``grads_bytes``, ``optimizer_bytes`` of global ``rank`` (mesh order dp, tp)."""
    check_optimizer(optimizer)
    dp, dp_rank = plan.dp_size, rank // plan.tp_size
    if plan.uses_fsdp:
        padded = opt = 0
        for dim0, row_numel, itemsize, count in shape_census(params):
            chunk, real = _chunk_rows(dim0, dp, dp_rank)
            padded += count * chunk * row_numel * itemsize
            opt += count * _state(real * row_numel, itemsize, optimizer)
        return dict(params_bytes=padded, grads_bytes=padded, optimizer_bytes=opt)
    full = sum(p.numel * p.itemsize for p in params)
    owned = zero_owned(params, dp, dp_rank) if plan.uses_zero else params
    opt = sum(_state(p.numel, p.itemsize, optimizer) for p in owned)
    return dict(params_bytes=full, grads_bytes=full, optimizer_bytes=opt)


def buffer_bytes(buffers: Sequence[tuple], dtype: torch.dtype, plan: SNNDistributedPlan) -> int:
    """Bytes of one rank's ``plain_buffers`` once cast to ``dtype`` (not sharded by any mode but
    TP's channel-sharded BatchNorms)."""
    itemsize, local_shape = torch.empty((), dtype=dtype).element_size(), tp_local_shapes(plan)
    return sum(math.prod(local_shape(n, shape)) * (itemsize if floating else size)
               for n, shape, floating, size in buffers)


def optimizer_temporaries(params: Sequence[Param], plan: SNNDistributedPlan, rank: int, optimizer: str) -> int:
    """Peak scratch of a single-tensor (CPU default) optimizer step: Adam's ``sqrt`` and division
    of the largest parameter this rank updates; SGD updates in place."""
    if optimizer not in ("adam", "adamw") or not params:
        return 0
    dp, dp_rank = plan.dp_size, rank // plan.tp_size
    if plan.uses_fsdp:
        sizes = [_chunk_rows(dim0, dp, dp_rank)[1] * row_numel * itemsize
                 for dim0, row_numel, itemsize, _ in shape_census(params)]
    else:
        owned = zero_owned(params, dp, dp_rank) if plan.uses_zero else params
        sizes = [p.numel * p.itemsize for p in owned]
    return 2 * max(sizes, default=0)
