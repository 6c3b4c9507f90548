"""Walking a model's structure: layer kinds, wrappers, and runs of layers in known execution order."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from ...compat import RootOnlyFxTracer, own_tensors
from . import neurons
from .walk import memo, modules_by_name

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


# ---- what a forward calls, in order ---------------------------------------------------------------

class _ChildrenAreLeaves(torch.fx.Tracer):
    """Traces only the root's forward: every sub-module call stays one node."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def is_plain_sequential(module: nn.Module) -> bool:
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


@contextmanager
def _state_kept(model: nn.Module):
    """Leaves every module's attributes, buffers and parameters as found: tracing runs the root's
    forward for real, and calls it makes on its children (a tutorial-style ``lif.init_leaky()``)
    may replace their state."""
    saved = [(m, dict(m.__dict__), dict(m._buffers), dict(m._parameters)) for m in modules_by_name(model).values()]
    try:
        yield
    finally:
        for module, attributes, buffers, parameters in saved:
            module.__dict__.clear()
            module.__dict__.update(attributes)
            for table, kept in ((module._buffers, buffers), (module._parameters, parameters)):
                table.clear()
                table.update(kept)


def forward_chain(model: nn.Module) -> Tuple[Tuple[str, ...], str]:
    """The top-level modules ``model.forward`` chains, in call order, and why not ('' when it does)."""
    return memo(("chain", id(model)), lambda: _traced_chain(model))


def _traced_chain(model: nn.Module) -> Tuple[Tuple[str, ...], str]:
    if is_plain_sequential(model):
        return tuple(name for name, _ in model.named_children()), ""
    # The root-only trace skips torch.fx's walk of every module; its graph differs from the full
    # trace's only in the names of tensor constants (get_attr nodes), which never make a chain: a
    # chain it finds is the full trace's, and a refusal's words come from the full trace.
    paths = {module: name for name, module in modules_by_name(model).items()}
    chain, problem = _chain_traced_by(model, RootOnlyFxTracer(paths))
    if problem:
        chain, problem = _chain_traced_by(model, _ChildrenAreLeaves())
    return chain, problem


def _chain_traced_by(model: nn.Module, tracer: torch.fx.Tracer) -> Tuple[Tuple[str, ...], str]:
    try:
        with _state_kept(model):
            graph = tracer.trace(model)
    except Exception as exc:  # fx cannot follow data-dependent control flow, loops over tensors, ...
        return (), f"torch.fx cannot trace its forward ({type(exc).__name__}: {str(exc).split('. ')[0][:160]})"
    previous, chain = None, []
    for node in graph.nodes:
        if node.op == "placeholder":
            if previous is not None:
                return (), "its forward takes more than one input"
            previous = node
        elif node.op == "call_module" and node.args == (previous,) and not node.kwargs:
            if node.target in chain:
                return (), f"its forward calls {node.target!r} twice"
            chain.append(node.target)
            previous = node
        elif node.op == "output" and node.args == (previous,) and chain:
            return tuple(chain), ""
        else:
            what = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", node.target)
            return (), f"its forward does {node.op} {what!r} between its modules, not only module calls in a chain"
    return (), "its forward calls no module"


def children_graph(module: nn.Module) -> Optional[torch.fx.Graph]:
    """The torch.fx graph of ``module``'s forward with every child one ``call_module`` node (None
    when fx cannot trace it), kept for the rest of the walk."""
    return memo(("children graph", id(module)), lambda: _children_graph(module))


def _children_graph(module: nn.Module) -> Optional[torch.fx.Graph]:
    try:
        with _state_kept(module):
            return _ChildrenAreLeaves().trace(module)
    except Exception:  # fx cannot follow data-dependent control flow, loops over tensors, ...
        return None


def opened_chain(module: nn.Module) -> Tuple[str, ...]:
    """The children a custom (non-Sequential) module's forward chains, in call order, when it is a
    block that only passes its input through them one after the other (``self.b(self.a(x))``, as
    spikingjelly's ``VGGBlock`` does); () for Sequentials, neurons, modules with tensors of their own
    or a forward that does anything else (proved by tracing it with torch.fx)."""
    if isinstance(module, nn.Sequential) or len(module._modules) < 2 or _holds_tensors(module) \
            or neurons.is_spiking_neuron(module) or neurons.snn_library(module):
        return ()
    chain, problem = forward_chain(module)
    return () if problem else chain


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
    return bool(own_tensors(module))
    return False


def kind(module: nn.Module, name: str, roots) -> str:
    """'linear' / 'conv' (candidates), 'norm', 'channelwise', 'elementwise' (incl. neurons) or 'other'."""
    if isinstance(module, nn.Linear):
        return "linear" if under(name, roots) else "other"
    if isinstance(module, CONV_TYPES):  # grouped convolutions mix no channels across a shard: left whole
        return "conv" if under(name, roots) and module.groups == 1 else "other"
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
    """``(path, kind)`` of a container's children in order, nested Sequentials, wrappers and chained
    blocks (:func:`opened_chain`) opened."""
    key = ("flatten", id(container), prefix, None if roots is None else tuple(roots))
    return memo(key, lambda: _flatten_children(container, list(container.named_children()), prefix, roots))


def _flatten_children(container: nn.Module, children: list, prefix: str, roots) -> list:
    out = []
    for name, child in children:
        child, path = inner(child, prefix + name)
        chain = opened_chain(child)
        if isinstance(child, nn.Sequential):
            out.extend(flatten(child, path + ".", roots))
        elif chain:  # a block whose forward chains its children: opened in call order
            out.extend(_flatten_children(child, [(n, child.get_submodule(n)) for n in chain], path + ".", roots))
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
    modules = modules_by_name(model)
    found = runs(flatten(model, "", roots), layer) if opened_chain(model) else []
    for name, module in modules.items():
        parent = modules.get(name.rpartition(".")[0]) if name else None
        if isinstance(module, nn.Sequential) and not isinstance(parent, nn.Sequential):
            found.extend(runs(flatten(module, name + "." if name else "", roots), layer))
    found = outermost(found)
    seen = {p for run in found for p in run}
    found.extend((c,) for c in candidates if c not in seen)
    order = {n: i for i, n in enumerate(modules)}
    return tuple(sorted(found, key=lambda c: order[c[0]]))


def outermost(found: Sequence[tuple]) -> list:
    """``found`` runs less repeats and runs inside a longer one (a Sequential inside an opened block
    is walked on its own too)."""
    unique = list(dict.fromkeys(found))
    return [r for r in unique if not any(len(o) > len(r) and set(r) <= set(o) for o in unique)]


#: The kinds of a residual block's channel run: conv -> BN -> neuron -> conv (-> BN (-> neuron)).
_BLOCK_RUN = ("conv", "norm", "elementwise", "conv", "norm", "elementwise")


def block_conv_chains(model: nn.Module, roots) -> Tuple[Tuple[str, ...], ...]:
    """``conv -> BN -> neuron -> conv (-> BN (-> neuron))`` among the children of custom
    (non-Sequential) modules, in registration order: the inside of SEW-ResNet-style residual blocks,
    whose forward adds the run's output to the block input. Both convs must have one group and the
    BN the first conv's channels; the run is cut after the second conv's BN and neuron."""
    modules = modules_by_name(model)
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


def paired_layers(runs_: Sequence[tuple], layers: Sequence[str]) -> Tuple[str, ...]:
    """The ``layers`` that pairing each run's layers in twos (output- then input-sharded) shards."""
    chosen = set(layers)
    out = []
    for run in runs_:
        found = [p for p in run if p in chosen]
        out.extend(found[:len(found) // 2 * 2])
    return tuple(dict.fromkeys(out))
