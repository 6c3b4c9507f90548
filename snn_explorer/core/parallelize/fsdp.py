"""FSDP2: ``fully_shard`` the plan's units, then the root, over the dp sub-mesh.

Under a half-precision plan FSDP2 gathers the parameters in the compute dtype
(``MixedPrecisionPolicy.param_dtype``). A normalisation layer with running statistics (BatchNorm and
its subclasses, InstanceNorm) cannot compute with bf16 / fp16 weights beside its fp32 statistics
(torch's ``batch_norm``: "expected scalar type"), so each one that holds parameters becomes an FSDP2
unit of its own that gathers them in their own dtype (fp32 masters) (:func:`fsdp_units_of`, :func:`.mixed_precision.fsdp_norm_policy`):
it then runs as under plain autocast (the single process, dp, tp), on its half-precision input with
fp32 weights and statistics.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import FrozenSet, Sequence, Tuple

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

from ...compat import NORM_BASE
from ..common.precision import FP32, Precision, fsdp_norm_problem
from .mixed_precision import fsdp_norm_policy, fsdp_policy


def norm_layer_paths(model: nn.Module) -> Tuple[str, ...]:
    """Paths of ``model``'s normalisation layers with running statistics (torch's ``_NormBase``: every
    BatchNorm, spikingjelly's included, and InstanceNorm) that hold parameters of their own."""
    return tuple(name for name, module in model.named_modules()
                 if name and isinstance(module, NORM_BASE) and next(module.parameters(recurse=False), None) is not None)


@dataclass(frozen=True)
class FsdpUnits:
    """The modules FSDP2 shards under a plan before the root, in the order ``fully_shard`` takes them
    (the norm units first: they are leaves), and the units that gather in their own dtype, not the compute dtype."""

    paths: Tuple[str, ...]
    fp32: FrozenSet[str] = frozenset()


def fsdp_units_of(units: Sequence[str], norm_paths: Sequence[str], precision: Precision) -> FsdpUnits:
    """The FSDP2 units of a plan with ``units`` and ``precision`` on a model with these norm layers
    (:func:`norm_layer_paths`): under a precision that gathers in half precision, each norm layer
    is a unit of its own, gathered in its own dtype (fp32); otherwise ``units`` as they are."""
    if precision.param_dtype is None or not norm_paths:
        return FsdpUnits(tuple(units))
    norms = tuple(norm_paths)
    return FsdpUnits(norms + tuple(u for u in units if u not in norms), frozenset(norms))


def apply_fsdp2(model: nn.Module, dp_mesh: DeviceMesh, units: Sequence[str], reshard_after_forward: bool,
                cpu_offload: bool = False, precision: Precision = FP32) -> FsdpUnits:
    """Shard parameters, gradients and optimizer state of each unit (and the root) over ``dp_mesh``;
    ``cpu_offload`` keeps the shards in CPU memory (``CPUOffloadPolicy``); ``precision`` sets the dtypes
    it all-gathers and reduce-scatters in (:func:`.mixed_precision.fsdp_policy`; norm layers their own
    fp32 units). Returns the units it sharded."""
    problem = fsdp_norm_problem(precision, True, ("",) if isinstance(model, NORM_BASE) else ())
    if problem:
        raise ValueError(problem)
    chosen = fsdp_units_of(units, norm_layer_paths(model), precision)
    _quiet_view_warning(model, chosen.paths)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    policy, norm_policy = fsdp_policy(precision), fsdp_norm_policy(precision)
    for path in chosen.paths:
        fully_shard(model.get_submodule(path), mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                    offload_policy=offload, mp_policy=norm_policy if path in chosen.fp32 else policy)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, offload_policy=offload,
                mp_policy=policy)
    return chosen


def _quiet_view_warning(model: nn.Module, units: Sequence[str]) -> None:
    """Silence FSDP2's "returned a view tensor" warning for the units chosen here, in spikingjelly models.

    spikingjelly's multi-step layers (``SeqToANNContainer``, ``layer.Linear`` in step mode ``m``)
    return their output as a ``view`` of the time-flattened result, so FSDP2 warns, for every
    unit (and the root) whose output comes from one, that an in-place op on that output would skip
    its pre-backward hook. The hazard is in code that runs after the unit: spikingjelly's neurons
    and snn_explorer's runtime never modify it in place (the equivalence tests check the
    gradients); do not write ``out += ...`` on a spikingjelly model's output under FSDP2.
    Models without spikingjelly layers keep the warning.
    """
    if not any(type(m).__module__.startswith("spikingjelly") for m in model.modules()):
        return
    names = sorted({type(model.get_submodule(u)).__name__ for u in ("", *units)})
    pattern = "|".join(re.escape(n) for n in names)
    warnings.filterwarnings("ignore", message=rf"FSDP2-wrapped module \((FSDP)?({pattern})\) returned a view tensor")
