"""What FSDP2's CPU offload (``plan.cpu_offload``: torch's ``CPUOffloadPolicy``) saves on the device and costs.

Device memory: the sharded parameters, the sharded gradients and the optimizer state live in host memory, and the
optimizer step runs there, so they and the step's scratch leave the device's peak. What stays is FSDP2's traffic
through the device: a unit's shard is copied to the device before its all-gather (a temporary beside the
all-gather output), and each reduce-scatter output is copied back to the host (on the device only until then):
:class:`~.fsdp_timeline.FsdpTimeline` with ``offload`` replays both.

Time: per step every shard crosses the host link once per all-gather (the forward's, and the backward's again when
the plan reshards after forward; the root is never resharded) and every sharded gradient once back, each parameter
an operator call (``op_overhead_s``) and its bytes at the hardware's ``host_link_bytes_per_s`` (datasheet PCIe
rates, after ``efficiency``), counted as not overlapped with compute: an upper bound (torch copies
asynchronously from pinned memory). The optimizer step is timed as the device runs it: a host CPU's rate is not in
the hardware profile, so the time of the step on the host is not modelled (a lower bound for that part).
"""
from __future__ import annotations

from typing import Any, Sequence

from .sharding import Param

__all__ = ["check_fsdp_offload_hardware", "fsdp_offload_seconds", "HOST_COLUMNS"]

#: The per-rank columns whose bytes CPU offload keeps in host memory: the estimate's table still states them, its
#: ``peak_bytes`` (the device's) goes without them.
HOST_COLUMNS = ("params_bytes", "grads_bytes", "optimizer_bytes")


def check_fsdp_offload_hardware(hardware: Any, plan: Any) -> None:
    """Refuse a hardware profile FSDP2's CPU offload cannot be estimated on: no host link (a CPU device: its shards
    are in host memory already), or the GPU trace model; and a pipeline plan (neither modelled yet)."""
    if plan.uses_pp:
        raise ValueError(f"cpu_offload=True is not modelled for pipeline plans (mode {plan.mode!r}) yet; estimate it "
                         "on an fsdp2 / fsdp2_tp plan")
    hardware.require_host_link("cpu_offload=True", "keeps FSDP2's shards in host memory and copies them")


def fsdp_offload_seconds(params: Sequence[Param], plan: Any, hardware: Any, dp_rank: int = 0) -> float:
    """Seconds per step of ``dp_rank``'s host copies under CPU offload: each shard to the device per all-gather,
    each sharded gradient back (see the module doc)."""
    dp = plan.dp_size
    shard = {p.name: p.rows(dp, dp_rank)[0] * p.row_numel * p.itemsize for p in params}
    gathers = {p.name: 2 if plan.reshard_after_forward and p.group else 1 for p in params}
    to_device = sum(shard[n] * gathers[n] for n in shard)
    copies = sum(gathers.values()) + len(params)
    return copies * hardware.op_overhead_s + (to_device + sum(shard.values())) / (
        hardware.host_link_bytes_per_s * hardware.efficiency)
