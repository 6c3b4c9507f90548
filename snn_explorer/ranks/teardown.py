"""Ending a rank's process groups in order, so that no c10d thread outlives them.

``destroy_process_group`` only unregisters the groups: a ``DeviceMesh`` keeps its groups in its
own registry, and every FSDP2 / TP parameter (a DTensor) holds its mesh, so after it the gloo
worker threads (``pt_gloo_runloop``), gloo's socket loop (``gloo_tcp_loop``) and, on the rank that
serves it, the store's thread (``pt_tcpstore_uv``) live on for as long as the model does. A
process that then exits normally destroys those C++ objects, threads still running, during
interpreter teardown. :func:`end_process_groups` destroys the groups and collects what still
holds them (torch's DTensor caches too) while the interpreter is whole, and says which c10d threads are left, if any.
"""
from __future__ import annotations

import gc
import os
from typing import List

import torch.distributed as dist

from ..compat import clear_dtensor_mesh_caches

#: Name prefixes (as ``/proc/<pid>/task/*/comm`` shows them) of the threads c10d and gloo start:
#: ``pt_gloo_runloop``, ``gloo_tcp_loop``, ``pt_tcpstore_uv``, NCCL's ``pt_nccl_*``.
C10D_THREAD_PREFIXES = ("pt_gloo", "gloo_", "pt_tcpstore", "pt_nccl")


def c10d_threads() -> List[str]:
    """Names of this process's live c10d / gloo threads, sorted (Linux ``/proc``; empty without it)."""
    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return names
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as fh:
                name = fh.read().strip()
        except OSError:  # the thread ended while listing
            continue
        if name.startswith(C10D_THREAD_PREFIXES):
            names.append(name)
    return sorted(names)


def end_process_groups(barrier: bool = False) -> List[str]:
    """Destroy every process group of this process (the default one, DeviceMesh sub-groups and
    ``new_group`` groups alike) after a ``barrier`` on the world if asked (every rank has finished
    its collectives, so the rank serving the store does not close it under a peer), then collect
    the garbage that still holds them, so their C++ destructors join their threads now.

    Call it after dropping the references to the model and runtime. Returns the c10d threads still
    alive: empty unless a live object still holds a group (a DTensor parameter's mesh).
    """
    if dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
    clear_dtensor_mesh_caches()  # torch's DTensor caches hold meshes, and through them the groups
    gc.collect()
    return c10d_threads()
