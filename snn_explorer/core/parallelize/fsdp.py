"""FSDP2: ``fully_shard`` the plan's units, then the root, over the dp sub-mesh."""
from __future__ import annotations

from typing import Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard


def apply_fsdp2(model: nn.Module, dp_mesh: DeviceMesh, units: Sequence[str], reshard_after_forward: bool) -> None:
    """Shard parameters, gradients and optimizer state of each unit (and the root) over ``dp_mesh``."""
    for path in units:
        fully_shard(model.get_submodule(path), mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
