"""Where a plan's ranks sit: the size of each collective's group, whether it crosses nodes, how
many ranks share a host and how much they slow each other."""
from __future__ import annotations

from ...core import SNNDistributedPlan
from ...core.common import Collective
from .hardware import HardwareProfile


def _stride(plan: SNNDistributedPlan, mesh_dim: str) -> int:
    """Rank distance between neighbours of a ``mesh_dim`` group (mesh order pp, dp, tp: tp innermost)."""
    return {"tp": 1, "dp": plan.tp_size}.get(mesh_dim, plan.tp_size * plan.dp_size)


def spans_nodes(plan: SNNDistributedPlan, mesh_dim: str, hw: HardwareProfile, size: int = 0) -> bool:
    """Whether a ``mesh_dim`` group (of ``size`` ranks; default the whole dim) crosses nodes."""
    if hw.ranks_per_node is None:
        return False
    size = size or group_size(plan, mesh_dim, "")
    return (size - 1) * _stride(plan, mesh_dim) + 1 > hw.ranks_per_node


def group_size(plan: SNNDistributedPlan, mesh_dim: str, kind: str) -> int:
    """Ranks taking part: a pipeline send joins two neighbouring stages, any other collective the dim."""
    if mesh_dim == "pp":
        return 2 if kind == Collective.SEND else plan.pp_size
    return plan.tp_size if mesh_dim == "tp" else plan.dp_size


def ranks_on_host(plan: SNNDistributedPlan, hw: HardwareProfile) -> int:
    """How many of the plan's ranks share one host (all of them on a profile without nodes)."""
    return min(plan.world_size, hw.ranks_per_node or plan.world_size)


def host_sharing(plan: SNNDistributedPlan, hw: HardwareProfile) -> float:
    """How much slower each rank runs when the plan's ranks on one host share its cores (calibrated)."""
    return hw.sharing(ranks_on_host(plan, hw))
