"""Walking a model's structure: layer kinds, wrappers, and runs of layers in known execution order."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

from torch import nn

from . import neurons

#: Modules that act feature-wise, so a feature-sharded tensor can pass through them.
ELEMENTWISE_TYPES = (
    nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.ELU,
    nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Mish, nn.Softplus,
)
CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
#: BatchNorm layers (the public classes; not torch's private ``_BatchNorm`` base).
NORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
#: Channel-wise modules a channel-sharded activation can pass through (besides ELEMENTWISE_TYPES).
CHANNELWISE_TYPES = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)


def under(name: str, roots: Optional[Tuple[str, ...]]) -> bool:
    return roots is None or any(name == r or name.startswith(r + ".") for r in roots)


def inner(module: nn.Module, path: str) -> Tuple[nn.Module, str]:
    """Look through wrappers that hold exactly one module and no tensors of their own (time folding)."""
    while not isinstance(module, nn.Sequential):
        children = list(module.named_children())
        if len(children) != 1 or _holds_tensors(module) or neurons.is_spiking_neuron(module):
            break
        name, module = children[0]
        path = f"{path}.{name}"
    return module, path


def _holds_tensors(module: nn.Module) -> bool:
    """Whether ``module`` has parameters or buffers of its own."""
    for _ in module.parameters(recurse=False):
        return True
    for _ in module.buffers(recurse=False):
        return True
    return False


def kind(module: nn.Module, name: str, roots) -> str:
    """'linear' / 'conv' (candidates), 'norm', 'channelwise', 'elementwise' (incl. neurons) or 'other'."""
    if isinstance(module, nn.Linear):
        return "linear" if under(name, roots) else "other"
    if isinstance(module, CONV_TYPES):
        return "conv" if under(name, roots) else "other"
    if isinstance(module, NORM_TYPES):
        return "norm"
    if isinstance(module, CHANNELWISE_TYPES):
        return "channelwise"
    if neurons.is_spiking_neuron(module) or isinstance(module, ELEMENTWISE_TYPES):
        return "elementwise"
    children = list(module.children())
    if children and all(kind(c, name, roots) == "elementwise" for c in children):
        return "elementwise"
    return "other"


def flatten(container: nn.Module, prefix: str, roots) -> list:
    """``(path, kind)`` of a container's children in order, nested Sequentials and wrappers opened."""
    out = []
    for name, child in container.named_children():
        child, path = inner(child, prefix + name)
        if isinstance(child, nn.Sequential):
            out.extend(flatten(child, path + ".", roots))
        else:
            out.append((path, kind(child, path, roots)))
    return out


#: What a run of each layer kind may hold between its layers.
_PASSES = {"linear": ("elementwise",), "conv": ("elementwise", "channelwise", "norm"),
           "pointwise": ("elementwise", "norm")}


def runs(sequence: Sequence[tuple], layer: str, is_layer=None) -> list:
    """Maximal runs of layers in ``(path, kind)`` ``sequence`` with only pass-through kinds between.

    ``is_layer(path, kind)`` decides what counts as a layer (default: ``kind == layer``).
    """
    is_layer = is_layer or (lambda _path, k: k == layer)
    found, run = [], []
    for path, k in list(sequence) + [("", "other")]:
        if is_layer(path, k) or (run and k in _PASSES[layer]):
            run.append((path, is_layer(path, k)))
            continue
        while run and not run[-1][1]:
            run.pop()
        if run:
            found.append(tuple(p for p, _ in run))
        run = []
    return found


def chains(model: nn.Module, roots, layer: str, candidates: Sequence[str] = ()) -> Tuple[Tuple[str, ...], ...]:
    """Runs of ``layer`` modules (``"linear"`` or ``"conv"``) in ``nn.Sequential`` order with only
    pass-through modules between; other ``candidates`` become chains of their own."""
    modules = dict(model.named_modules())
    found = []
    for name, module in modules.items():
        parent = modules.get(name.rpartition(".")[0]) if name else None
        if isinstance(module, nn.Sequential) and not isinstance(parent, nn.Sequential):
            found.extend(runs(flatten(module, name + "." if name else "", roots), layer))
    seen = {p for run in found for p in run}
    found.extend((c,) for c in candidates if c not in seen)
    order = {n: i for i, n in enumerate(modules)}
    return tuple(sorted(found, key=lambda c: order[c[0]]))


#: The kinds of a residual block's channel run: conv -> BN -> neuron -> conv (-> BN (-> neuron)).
_BLOCK_RUN = ("conv", "norm", "elementwise", "conv", "norm", "elementwise")


def block_conv_chains(model: nn.Module, roots) -> Tuple[Tuple[str, ...], ...]:
    """``conv -> BN -> neuron -> conv (-> BN (-> neuron))`` among the children of custom
    (non-Sequential) modules, in registration order: the inside of SEW-ResNet-style residual blocks,
    whose forward adds the run's output to the block input. Both convs must have one group and the
    BN the first conv's channels; the run is cut after the second conv's BN and neuron."""
    modules = dict(model.named_modules())
    found = []
    for name, module in modules.items():
        if isinstance(module, nn.Sequential) or not module._modules or hasattr(module, "num_heads"):
            continue
        sequence = flatten(module, name + "." if name else "", roots)
        start = 0
        while start < len(sequence):
            run = _block_run(modules, sequence[start:start + len(_BLOCK_RUN)])
            found.extend([run] if run else [])
            start += len(run) or 1
    return tuple(found)


def _block_run(modules: dict, window: Sequence[tuple]) -> Tuple[str, ...]:
    kinds = [k for _, k in window]
    length = next((n for n in range(len(kinds), 3, -1) if tuple(kinds[:n]) == _BLOCK_RUN[:n]), 0)
    if not length:
        return ()
    first, norm, _, second = (modules[p] for p, _ in window[:4])
    if first.groups != 1 or second.groups != 1 or norm.num_features != first.out_channels \
            or second.in_channels != first.out_channels:
        return ()
    return tuple(p for p, _ in window[:length])
