"""FSDP2: ``fully_shard`` the plan's units, then the root, over the dp sub-mesh."""
from __future__ import annotations

import re
import warnings
from typing import Optional, Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

#: Norm layers with running statistics: FSDP2's param_dtype casts their weights but not their statistics.
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def apply_fsdp2(model: nn.Module, dp_mesh: DeviceMesh, units: Sequence[str], reshard_after_forward: bool,
                cpu_offload: bool = False, mp_policy: Optional[MixedPrecisionPolicy] = None) -> None:
    """Shard parameters, gradients and optimizer state of each unit (and the root) over ``dp_mesh``;
    ``cpu_offload`` keeps the shards in CPU memory (``CPUOffloadPolicy``); ``mp_policy`` sets the dtypes it
    all-gathers and reduce-scatters in (``mixed_precision.fsdp_policy``)."""
    _quiet_view_warning(model, units)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    mp_policy = mp_policy or MixedPrecisionPolicy()
    norms = [n for n, m in model.named_modules() if isinstance(m, _BATCH_NORMS)]
    if mp_policy.param_dtype is not None and norms:
        raise ValueError(f"FSDP2 with param_dtype={mp_policy.param_dtype} would cast the BatchNorm weights of {norms[:3]} "
                         "while their running statistics stay fp32, which torch's batch_norm refuses; use mode 'dp' "
                         "or 'tp' for mixed precision on this model, or precision='fp32'")
    for path in units:
        fully_shard(model.get_submodule(path), mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                    offload_policy=offload, mp_policy=mp_policy)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, offload_policy=offload,
                mp_policy=mp_policy)


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
