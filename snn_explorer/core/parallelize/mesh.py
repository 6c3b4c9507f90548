"""One place that knows the device mesh: checks the process group and builds the mesh."""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..planning.plan_types import SNNDistributedPlan

DEVICE_TYPES = ("cpu", "cuda")


def default_device_type() -> str:
    """The one rule for a device nobody named: the initialised process group's (NCCL: 'cuda', else
    'cpu'); without one, 'cuda' when CUDA is available, else 'cpu'."""
    if dist.is_available() and dist.is_initialized():
        return "cuda" if "nccl" in str(dist.get_backend()).lower() else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def comm_backend_for(device_type: str) -> str:
    """The communication backend for ``device_type``: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if check_device_type(device_type) == "cuda" else "gloo"


def device_type_for(comm_backend: str) -> str:
    """The device a rank of ``comm_backend`` trains on: CUDA for NCCL, the CPU for gloo."""
    return "cuda" if comm_backend == "nccl" else "cpu"


def check_device_type(device_type: Optional[str]) -> str:
    """``device_type`` checked (None: :func:`default_device_type`)."""
    if device_type is None:
        return default_device_type()
    device_type = device_type.lower() if isinstance(device_type, str) else device_type
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device_type={device_type!r}; expected one of {DEVICE_TYPES}")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device_type='cuda' but CUDA is not available on this machine; pass device_type='cpu' "
                         "(gloo on CPU)")
    return device_type


def check_process_group(plan: SNNDistributedPlan) -> None:
    """The plan's world size must equal the initialised process group's."""
    if not plan.distributed:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(f"plan mode {plan.mode!r} runs one process, but this process group has "
                             f"{dist.get_world_size()} ranks; each would train its own copy. Plan for "
                             f"world_size={dist.get_world_size()} (e.g. dp) or run a {plan.mode!r} plan on one process")
        return
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"mode {plan.mode!r} needs torch.distributed initialised with "
                           f"{plan.world_size} rank(s); run it through snn_explorer.launcher or torchrun")
    if dist.get_world_size() != plan.world_size:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks but the plan's topology "
                         f"{dict(plan.topology.dims)} needs world_size={plan.world_size}")


def check_mesh(mesh: DeviceMesh, plan: SNNDistributedPlan) -> None:
    """A user's ``device_mesh`` must have the plan's dim names, in order, and shape."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch DeviceMesh or None, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names is not None else None
    shape = tuple(mesh.mesh.shape)
    if names != plan.mesh_dim_names or shape != plan.mesh_shape:
        given = "no mesh_dim_names" if names is None else f"mesh_dim_names={names}"
        raise ValueError(f"device_mesh has {given} and shape {shape} ({int(mesh.mesh.numel())} ranks), but the plan "
                         f"needs mesh_dim_names={plan.mesh_dim_names} and shape {plan.mesh_shape} "
                         f"(world_size={plan.world_size}; e.g. init_device_mesh(device_type, "
                         f"{plan.mesh_shape}, mesh_dim_names={plan.mesh_dim_names}), or pass device_mesh=None)")


def check_mesh_type(mesh) -> Optional[DeviceMesh]:
    """``mesh`` if it is None or a DeviceMesh, else TypeError."""
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh (or None to build "
                        f"the plan's), got {type(mesh).__name__}: {mesh!r:.80}")
    return mesh


def build_mesh(plan: SNNDistributedPlan, device_type: str, mesh: Optional[DeviceMesh] = None) -> Optional[DeviceMesh]:
    """The plan's named mesh (None for mode 'none'); a given ``mesh`` is checked and used."""
    if check_mesh_type(mesh) is not None:
        check_mesh(mesh, plan)
        return mesh
    if not plan.distributed:
        return None
    return init_device_mesh(device_type, plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)


def local_device(device_type: str) -> torch.device:
    """This rank's device: its own GPU under CUDA (``LOCAL_RANK``), else the CPU."""
    if device_type == "cuda":
        index = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")
