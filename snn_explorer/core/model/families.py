"""Model families: resolving a family from a name or the model's structure, and its FSDP2 units."""
from __future__ import annotations

from typing import Optional, Tuple

from torch import nn

from .walk import holds_parameters, modules_by_name

GENERIC = "generic"
VGG = "cifar10dvs_vgg"
SPIKFORMER = "spikformer"

#: Known families. Names given by users are matched by prefix (``"spikformer_ti"`` -> spikformer).
FAMILIES = (GENERIC, VGG, SPIKFORMER)

_PREFIXES = (
    ("spikformer", SPIKFORMER),
    ("cifar10dvs_vgg", VGG),
    ("cifar10_dvs_vgg", VGG),
    ("dvs_vgg", VGG),
    ("dvsvgg", VGG),
    ("vgg", VGG),
    ("generic", GENERIC),
    ("mlp", GENERIC),
)


def _from_name(name: str) -> Optional[str]:
    key = name.strip().lower().replace("-", "_")
    for prefix, family in _PREFIXES:
        if key.startswith(prefix):
            return family
    return None


def _from_structure(model: nn.Module) -> Optional[str]:
    """The family of the first class name (in module order) that names one besides the generic one."""
    for name in dict.fromkeys(type(module).__name__ for module in modules_by_name(model).values()):
        family = _from_name(name)
        if family not in (None, GENERIC):
            return family
    return None


def resolve_family(model: Optional[nn.Module], name: Optional[str]) -> Tuple[str, Optional[str]]:
    """Return ``(family, note)``: from ``name`` by prefix, else from class names in ``model``."""
    if name is not None:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"model_family must be a non-empty string or None, got {name!r}")
        family = _from_name(name)
        if family is None:
            return GENERIC, f"model_family={name!r} is not a known family {FAMILIES}; using the generic path."
        return family, None
    if model is not None:
        family = _from_structure(model)
        if family is not None:
            return family, f"model family {family!r} inferred from the model's class names."
    return GENERIC, None


#: Containers without a ``forward`` of their own: never an FSDP2 unit, their items are.
CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def fsdp_units(model: nn.Module) -> Tuple[str, ...]:
    """Module paths to ``fully_shard`` before the root, in ``named_modules`` order.

    The parameter-holding children of the root, descending through a root that holds a single
    container (``model.net``), and splitting ``nn.Sequential`` children of the root whose items
    are blocks into those items (each block of a transformer, each stage of a VGG). A unit is
    always a module that runs: ``nn.ModuleList`` / ``nn.ModuleDict`` of any length, nested or
    not, stand for their items.
    """
    children = [(n, c) for n, c in model.named_children() if holds_parameters(c)]
    if len(children) == 1 and next(iter(children[0][1].children()), None) is not None:
        name, child = children[0]
        children = [(f"{name}.{n}", c) for n, c in child.named_children() if holds_parameters(c)]
    return tuple(unit for path, child in children for unit in _units_of(path, child))


def _units_of(path: str, module: nn.Module) -> Tuple[str, ...]:
    """``module`` at ``path`` as FSDP2 units: itself, or its items when it is a container to split."""
    split = isinstance(module, CONTAINERS) or (isinstance(module, nn.Sequential) and len(module) > 1
                                               and _splittable(module))
    if not split:
        return (path,)
    return tuple(unit for name, child in module.named_children() if holds_parameters(child)
                 for unit in (_units_of(f"{path}.{name}", child) if isinstance(child, CONTAINERS) else (f"{path}.{name}",)))


def _splittable(container: nn.Module) -> bool:
    """A container is split into its items when those items are blocks (modules with children)."""
    return any(next(iter(c.children()), None) is not None for c in container.children())
