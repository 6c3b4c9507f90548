"""Data parallelism: DistributedDataParallel over the dp sub-mesh."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, device: torch.device) -> DistributedDataParallel:
    """Wrap ``model`` in DDP. Buffers are not re-broadcast each forward: neuron state is per rank."""
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, process_group=dp_mesh.get_group(), device_ids=device_ids,
                                   broadcast_buffers=False)
