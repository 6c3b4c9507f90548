"""analyze(): walk a model and record its stateful neurons and tensor-parallel candidates."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Tuple

from torch import nn

from . import neurons
from .plans.families import fsdp_units, resolve_family
from .serialize import check_kind, dataclass_dict, tuplify

#: Modules that act feature-wise, so a feature-sharded tensor can pass through them.
ELEMENTWISE_TYPES = (
    nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.ELU,
    nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Mish, nn.Softplus,
)
CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
#: Channel-wise modules a channel-sharded activation can pass through (besides ELEMENTWISE_TYPES).
CHANNELWISE_TYPES = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)


@dataclass(frozen=True)
class LinearShape:
    """A Linear TP candidate: its path and feature counts."""

    name: str
    in_features: int
    out_features: int

    def to_dict(self) -> dict:
        return {"name": self.name, "in_features": self.in_features, "out_features": self.out_features}


@dataclass(frozen=True)
class ConvShape:
    """A convolution: its path, channel counts, groups and number of spatial dims."""

    name: str
    in_channels: int
    out_channels: int
    groups: int
    spatial_dims: int

    def to_dict(self) -> dict:
        return dataclass_dict(self, "conv")


@dataclass(frozen=True)
class AttentionBlock:
    """Multi-head attention with separate q/k/v/output Linears; ``neurons`` sit between q and proj."""

    path: str
    num_heads: int
    q: str
    k: str
    v: str
    proj: str
    neurons: Tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return dataclass_dict(self, "attention")


_QKV_NAMES = {"q": ("q", "q_linear", "q_proj", "wq"), "k": ("k", "k_linear", "k_proj", "wk"),
              "v": ("v", "v_linear", "v_proj", "wv"), "proj": ("proj", "out_proj", "o_proj", "wo", "o")}


def _attention_block(path: str, module: nn.Module, memory: Sequence[str]) -> Optional[AttentionBlock]:
    heads = getattr(module, "num_heads", None)
    if not isinstance(heads, int) or isinstance(heads, bool):
        return None
    children = dict(module.named_children())
    found = {}
    for role, names in _QKV_NAMES.items():
        name = next((n for n in names if isinstance(children.get(n), nn.Linear)), None)
        if name is None:
            return None
        found[role] = f"{path}.{name}"
    order = list(children)
    start, stop = order.index(found["q"].rpartition(".")[2]), order.index(found["proj"].rpartition(".")[2])
    neurons = tuple(f"{path}.{n}" for n in order[start:stop]
                    if any(m == f"{path}.{n}" or m.startswith(f"{path}.{n}.") for m in memory))
    return AttentionBlock(path, heads, found["q"], found["k"], found["v"], found["proj"], neurons)


@dataclass(frozen=True)
class SNNDistributedAnalysis:
    """What :func:`analyze` found in a model (plain data, JSON-serialisable).

    ``tp_chains`` lists runs of modules in known execution order (consecutive children of
    ``nn.Sequential`` containers) that hold Linear candidates separated only by feature-wise
    modules; a candidate outside such a run forms a chain of its own.
    """

    memory_module_names: Tuple[str, ...]
    tensor_parallel_candidate_names: Tuple[str, ...]
    unsupported_tensor_parallel_names: Tuple[str, ...]
    notes: Tuple[str, ...] = ()
    tensor_parallel_roots: Optional[Tuple[str, ...]] = None
    model_family: str = "generic"
    snn_libraries: Tuple[Tuple[str, str], ...] = ()
    linear_shapes: Tuple[LinearShape, ...] = ()
    tp_chains: Tuple[Tuple[str, ...], ...] = ()
    fsdp_unit_names: Tuple[str, ...] = ()
    per_feature_neuron_names: Tuple[str, ...] = ()
    attention_blocks: Tuple[AttentionBlock, ...] = ()
    batchnorm_names: Tuple[str, ...] = ()
    conv_shapes: Tuple[ConvShape, ...] = ()
    conv_chains: Tuple[Tuple[str, ...], ...] = ()

    def shape(self, name: str) -> LinearShape:
        for item in self.linear_shapes:
            if item.name == name:
                return item
        raise KeyError(f"{name!r} is not a Linear TP candidate; candidates: {self.tensor_parallel_candidate_names}")

    def conv(self, name: str) -> ConvShape:
        for item in self.conv_shapes:
            if item.name == name:
                return item
        raise KeyError(f"{name!r} is not a convolution of the model; convolutions: "
                       f"{tuple(c.name for c in self.conv_shapes)}")

    def to_dict(self) -> dict:
        return dataclass_dict(self, "analysis")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SNNDistributedAnalysis":
        data = check_kind(data, "analysis")
        objects = {
            "linear_shapes": tuple(LinearShape(**s) for s in data.pop("linear_shapes", ())),
            "attention_blocks": tuple(AttentionBlock(**{k: tuplify(v) for k, v in check_kind(b, "attention").items()})
                                      for b in data.pop("attention_blocks", ())),
            "conv_shapes": tuple(ConvShape(**check_kind(c, "conv")) for c in data.pop("conv_shapes", ())),
        }
        return cls(**{k: tuplify(v) for k, v in data.items()}, **objects)


def _validate_roots(model: nn.Module, roots: Optional[Sequence[str]]) -> Optional[Tuple[str, ...]]:
    if roots is None:
        return None
    if isinstance(roots, str):
        roots = (roots,)
    names = dict(model.named_modules())
    out = []
    for root in roots:
        if not isinstance(root, str):
            raise TypeError(f"roots must be module paths (str), got {root!r}")
        if not root:
            raise ValueError("roots contains an empty path ''; name sub-modules such as 'classifier'")
        if root not in names:
            raise KeyError(f"root {root!r} is not a module of the model; known top-level modules: "
                           f"{[n for n, _ in model.named_children()]}")
        if root not in out:
            out.append(root)
    return tuple(out)


def _under(name: str, roots: Optional[Tuple[str, ...]]) -> bool:
    return roots is None or any(name == r or name.startswith(r + ".") for r in roots)


def _inner(module: nn.Module, path: str) -> Tuple[nn.Module, str]:
    """Look through wrappers that hold exactly one module and no tensors of their own (time folding)."""
    while not isinstance(module, nn.Sequential):
        children = list(module.named_children())
        own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        if len(children) != 1 or own or neurons.is_spiking_neuron(module):
            break
        name, module = children[0]
        path = f"{path}.{name}"
    return module, path


def _kind(module: nn.Module, name: str, roots) -> str:
    """'linear' / 'conv' (candidates), 'norm', 'channelwise', 'elementwise' (incl. neurons) or 'other'."""
    if isinstance(module, nn.Linear):
        return "linear" if _under(name, roots) else "other"
    if isinstance(module, CONV_TYPES):
        return "conv" if _under(name, roots) else "other"
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return "norm"
    if isinstance(module, CHANNELWISE_TYPES):
        return "channelwise"
    if neurons.is_spiking_neuron(module) or isinstance(module, ELEMENTWISE_TYPES):
        return "elementwise"
    children = list(module.children())
    if children and all(_kind(c, name, roots) == "elementwise" for c in children):
        return "elementwise"
    return "other"


def _flatten(seq: nn.Sequential, prefix: str, roots) -> list:
    out = []
    for name, child in seq.named_children():
        child, path = _inner(child, prefix + name)
        if isinstance(child, nn.Sequential):
            out.extend(_flatten(child, path + ".", roots))
        else:
            out.append((path, _kind(child, path, roots)))
    return out


#: What a chain of each layer kind may hold between its layers.
_PASSES = {"linear": ("elementwise",), "conv": ("elementwise", "channelwise", "norm")}


def _chains(model: nn.Module, roots, layer: str, candidates: Sequence[str] = ()) -> Tuple[Tuple[str, ...], ...]:
    """Runs of ``layer`` modules (``"linear"`` or ``"conv"``) in ``nn.Sequential`` order with only
    pass-through modules between; other candidates become chains of their own."""
    modules = dict(model.named_modules())
    chains, seen = [], set()
    for name, module in modules.items():
        parent = modules.get(name.rpartition(".")[0]) if name else None
        if not isinstance(module, nn.Sequential) or isinstance(parent, nn.Sequential):
            continue
        run = []
        for path, kind in _flatten(module, name + "." if name else "", roots) + [("", "other")]:
            if kind != layer and kind not in _PASSES[layer]:
                while run and run[-1][1] != layer:
                    run.pop()
                if run:
                    chains.append(tuple(p for p, _ in run))
                    seen.update(p for p, k in run if k == layer)
                run = []
            elif kind == layer or run:
                run.append((path, kind))
    chains.extend((c,) for c in candidates if c not in seen)
    order = {n: i for i, n in enumerate(modules)}
    return tuple(sorted(chains, key=lambda c: order[c[0]]))


def _has_per_feature_state(module: nn.Module) -> bool:
    tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
    persistent = [t for n, t in tensors if n not in module._non_persistent_buffers_set]
    return any(t.numel() > 1 for t in persistent)


def analyze(model: nn.Module, *, model_family: Optional[str] = None,
            roots: Optional[Sequence[str]] = None) -> SNNDistributedAnalysis:
    """Find stateful neurons (whole model) and Linear TP candidates (under ``roots``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"analyze expects a torch.nn.Module, got {type(model).__name__}")
    roots = _validate_roots(model, roots)
    family, family_note = resolve_family(model, model_family)
    notes = [family_note] if family_note else []
    memory, libraries, per_feature, linears, unsupported, norms, convs = [], [], [], [], [], [], []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            norms.append(name)
        library = neurons.snn_library(module)
        if library and name:
            memory.append(name)
            libraries.append((name, library))
        if neurons.is_spiking_neuron(module) and _has_per_feature_state(module):
            per_feature.append(name)
        if not name or not _under(name, roots):
            continue
        if isinstance(module, nn.Linear):
            linears.append(LinearShape(name, module.in_features, module.out_features))
        elif isinstance(module, CONV_TYPES):
            unsupported.append(name)
            convs.append(ConvShape(name, module.in_channels, module.out_channels, module.groups,
                                   len(module.kernel_size)))
    if unsupported:
        notes.append(f"{len(unsupported)} conv layer(s) are not Linear TP candidates; "
                     "DistributedFeatureSet(allow_experimental_conv_tp=True) shards their channels.")
    if not linears:
        notes.append("no Linear tensor-parallel candidates found" + (f" under roots {roots}" if roots else ""))
    candidates = tuple(s.name for s in linears)
    attention = tuple(b for b in (_attention_block(n, m, memory) for n, m in model.named_modules()
                                  if n and _under(n, roots)) if b is not None)
    return SNNDistributedAnalysis(
        memory_module_names=tuple(memory),
        tensor_parallel_candidate_names=candidates,
        unsupported_tensor_parallel_names=tuple(unsupported),
        notes=tuple(notes),
        tensor_parallel_roots=roots,
        model_family=family,
        snn_libraries=tuple(libraries),
        linear_shapes=tuple(linears),
        tp_chains=_chains(model, roots, "linear", candidates),
        fsdp_unit_names=fsdp_units(model),
        per_feature_neuron_names=tuple(per_feature),
        attention_blocks=attention,
        batchnorm_names=tuple(norms),
        conv_shapes=tuple(convs),
        conv_chains=tuple(c for c in _chains(model, roots, "conv") if len(c) > 1),
    )
