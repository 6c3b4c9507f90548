"""Data parallelism: DistributedDataParallel over the dp sub-mesh."""
from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from .mixed_precision import ddp_reduce_hook

# Neuron state lives in buffers and is per rank: DDP must not re-broadcast buffers each forward.
_NO_FORWARD_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, device: torch.device,
              reduce_dtype: Optional[torch.dtype] = None) -> DistributedDataParallel:
    """Wrap ``model`` in DDP over ``dp_mesh`` (parameters and buffers synced once, at wrap time); with a
    ``reduce_dtype`` other than the gradients' own, each bucket is all-reduced in it."""
    device_ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, process_group=dp_mesh.get_group(), device_ids=device_ids,
                                  **_NO_FORWARD_BUFFER_SYNC)
    grad_dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    if reduce_dtype is not None and grad_dtypes != {reduce_dtype}:
        ddp.register_comm_hook(dp_mesh.get_group(), ddp_reduce_hook(reduce_dtype))
    return ddp
