"""Data parallelism: DistributedDataParallel over the dp sub-mesh."""
from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

# Neuron state lives in buffers and is per rank: DDP must not re-broadcast buffers each forward.
_NO_FORWARD_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, device: torch.device) -> DistributedDataParallel:
    """Wrap ``model`` in DDP over ``dp_mesh`` (parameters and buffers synced once, at wrap time)."""
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, process_group=dp_mesh.get_group(), device_ids=device_ids,
                                   **_NO_FORWARD_BUFFER_SYNC)
