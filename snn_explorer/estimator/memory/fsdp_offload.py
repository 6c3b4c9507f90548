"""What FSDP2's CPU offload (``plan.cpu_offload``: torch's ``CPUOffloadPolicy``) saves on the device and costs.

Device memory: the sharded parameters, the sharded gradients and the optimizer state live in host memory, and the
optimizer step runs there, so they and the step's scratch leave the device's peak. What stays is FSDP2's traffic
through the device: a unit's shard is copied to the device before its all-gather (a temporary beside the
all-gather output), and each reduce-scatter output is copied back to the host (on the device only until then):
:class:`~.fsdp_timeline.FsdpTimeline` with ``offload`` replays both.

Time, for the rank of dp coordinate 0 (it holds the largest shards: dim 0 is split with the remainder first):

- host copies: per step every shard crosses the host link once per all-gather (the forward's, and the backward's
  again when the plan reshards after forward; the root is never resharded) and every sharded gradient once back,
  each parameter an operator call (``op_overhead_s``) and its bytes at the hardware's ``host_link_bytes_per_s``
  (datasheet PCIe rates, after ``efficiency``), counted as not overlapped with compute: an upper bound (torch
  copies asynchronously from pinned memory);
- the optimizer step on the host CPU (:func:`host_optimizer_seconds`): the rank's shard of parameters at the
  hardware's ``host_adam_params_per_s`` (a documented measurement, or a host's own:
  :func:`~..calibration.host_adam.this_host_adam_rate`), plus each of the step's operators dispatched at
  ``op_overhead_s`` (the same host CPU dispatches them as for the device), in place of the device's optimizer
  time, not overlapped (``optimizer.step()`` runs after the backward). Only Adam / AdamW (the rate is an Adam
  rate); a profile that states no rate is refused, never given a default.
"""
from __future__ import annotations

from typing import Any, Sequence

from .sharding import Param

__all__ = ["check_fsdp_offload_hardware", "fsdp_offload_seconds", "host_optimizer_seconds", "HOST_COLUMNS",
           "HOST_OPTIMIZERS"]

#: The per-rank columns whose bytes CPU offload keeps in host memory: the estimate's table still states them, its
#: ``peak_bytes`` (the device's) goes without them.
HOST_COLUMNS = ("params_bytes", "grads_bytes", "optimizer_bytes")
#: The optimizers whose host step :func:`host_optimizer_seconds` times (``host_adam_params_per_s`` is Adam's rate).
HOST_OPTIMIZERS = ("adam", "adamw")


def check_fsdp_offload_hardware(hardware: Any, plan: Any, optimizer: str) -> None:
    """Refuse what FSDP2's CPU offload cannot be estimated with: a hardware profile without a host link (a CPU
    device: its shards are in host memory already), the GPU trace model, a profile without the host's Adam rate,
    an ``optimizer`` (its name, as the estimate takes it; required) other than Adam / AdamW; and a pipeline plan
    (``plan()`` refuses it at plan time; kept here for plans built by hand around that check)."""
    if plan.uses_pp:
        raise ValueError(f"cpu_offload=True is not modelled for pipeline plans (mode {plan.mode!r}) yet; estimate it "
                         "on an fsdp2 / fsdp2_tp plan")
    hardware.require_host_link("cpu_offload=True", "keeps FSDP2's shards in host memory and copies them")
    if optimizer not in HOST_OPTIMIZERS:
        raise ValueError(f"cpu_offload=True steps the optimizer on the host CPU, and its time is modelled for "
                         f"{HOST_OPTIMIZERS} only (host_adam_params_per_s is an Adam rate), not optimizer="
                         f"{optimizer!r}")
    if hardware.host_adam_params_per_s is None:
        raise ValueError(f"cpu_offload=True steps the optimizer on the host CPU, and hardware {hardware.name!r} "
                         "states no host Adam rate (host_adam_params_per_s=None): give one, e.g. "
                         "dataclasses.replace(profile, host_adam_params_per_s=this_host_adam_rate()) (from "
                         "snn_explorer.estimator.calibration.host_adam) measured on the training host, or a built-in "
                         "GPU profile")


def _shard_elements(params: Sequence[Param], plan: Any) -> dict:
    """Elements of each parameter's shard on dp coordinate 0 (the padded dim-0 chunk: rank 0's rows, the most)."""
    return {p.name: p.rows(plan.dp_size, 0)[0] * p.row_numel for p in params}


def fsdp_offload_seconds(params: Sequence[Param], plan: Any, hardware: Any) -> float:
    """Seconds per step of the host copies under CPU offload: each shard to the device per all-gather, each sharded
    gradient back (see the module doc)."""
    elements = _shard_elements(params, plan)
    shard = {p.name: elements[p.name] * p.itemsize for p in params}
    gathers = {p.name: 2 if plan.reshard_after_forward and p.group else 1 for p in params}
    to_device = sum(shard[n] * gathers[n] for n in shard)
    copies = sum(gathers.values()) + len(params)
    return copies * hardware.op_overhead_s + (to_device + sum(shard.values())) / (
        hardware.host_link_bytes_per_s * hardware.efficiency)


def host_optimizer_seconds(params: Sequence[Param], plan: Any, hardware: Any, ops: float) -> float:
    """Seconds of the optimizer step on the host CPU under CPU offload: the rank's shard of parameters at the
    hardware's ``host_adam_params_per_s`` and the step's ``ops`` operators at ``op_overhead_s`` each (see the
    module doc; checked by :func:`check_fsdp_offload_hardware`)."""
    return sum(_shard_elements(params, plan).values()) / hardware.host_adam_params_per_s + ops * hardware.op_overhead_s
