"""analyze(): walk a model and record its stateful neurons and tensor-parallel candidates."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping, Optional, Sequence, Tuple

from torch import nn

from ...compat import non_persistent_buffer_names, own_tensors
from ..common.serialize import check_keys, check_kind, dataclass_dict, string_tuple, tuplify
from ..common.young_objects import new_objects_collected
from . import neurons
from .attention import (
    AttentionBlock,
    BranchAttentionBlock,
    FusedAttentionBlock,
    attention_blocks,
    branch_attention_blocks,
    fused_attention_blocks,
    pointwise_chains,
)
from .dataflow import GatedMLP, gated_mlps
from .families import fsdp_units, resolve_family
from .layouts import DataLayout, detect_layout, layout_of
from .structure import (
    CONV_TYPES,
    NORM_TYPES,
    block_conv_chains,
    chains,
    paired_layers,
    under,
)
from .units import pipeline_units, trainable_units
from .walk import modules_by_name, named_parameters_all, one_walk, trainable_count

#: Analysis fields that hold module paths, and those that hold tuples of them (chains, (path, library)).
_PATHS = ("memory_module_names", "tensor_parallel_candidate_names", "unsupported_tensor_parallel_names", "notes",
          "fsdp_unit_names", "per_feature_neuron_names", "batchnorm_names", "pipeline_units")
#: Path fields that may be None (unknown: an analysis saved before the field existed, or no roots given).
_OPTIONAL_PATHS = ("tensor_parallel_roots", "trainable_units")
_PATH_TUPLES = ("snn_libraries", "tp_chains", "conv_chains", "pointwise_chains", "block_conv_chains", "state_kinds")



@dataclass(frozen=True)
class LinearShape:
    """A Linear TP candidate: its path and feature counts."""

    name: str
    in_features: int
    out_features: int

    def to_dict(self) -> dict:
        return dataclass_dict(self, "linear")


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
class SNNDistributedAnalysis:
    """What :func:`analyze` found in a model (plain data, JSON-serialisable).

    ``shared_parameter_groups`` lists the paths of each parameter that several modules share (tied
    weights), each group in ``named_parameters`` order. ``tp_chains`` lists runs of modules in known execution order (consecutive children of
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
    fused_attention_blocks: Tuple[FusedAttentionBlock, ...] = ()
    pointwise_chains: Tuple[Tuple[str, ...], ...] = ()
    #: conv -> BN -> neuron -> conv runs inside residual blocks (registration order; the conv gate trusts it)
    block_conv_chains: Tuple[Tuple[str, ...], ...] = ()
    branch_attention_blocks: Tuple[BranchAttentionBlock, ...] = ()
    shared_parameter_groups: Tuple[Tuple[str, ...], ...] = ()
    trainable_parameters: Optional[int] = None  # elements of the parameters that require grad (None: unknown)
    #: snntorch neurons whose membrane the model's forward passes explicitly (init_hidden=False)
    explicit_state_names: Tuple[str, ...] = ()
    #: the modules forward chains, in order, that pipeline stages are cut from (see core.pipeline_plan),
    #: and why there are none ('' when there are)
    pipeline_units: Tuple[str, ...] = ()
    pipeline_problem: str = ""
    #: the pipeline units holding parameters that require grad (None: unknown, an older analysis)
    trainable_units: Optional[Tuple[str, ...]] = None
    #: (path, kind) of each stateful module: "neuron" or "dropout mask" (an old analysis without it: all neurons)
    state_kinds: Tuple[Tuple[str, str], ...] = ()
    #: where N and T sit in the model's input and output (None: not stated, no example input given)
    #: and how that was found ("given", or detected from an example input: see core.layouts)
    data_layout: Optional[DataLayout] = None
    data_layout_how: str = ""
    #: Linears reading one input, combined feature-wise into one Linear (SwiGLU), from the traced forward
    gated_mlps: Tuple[GatedMLP, ...] = ()

    @cached_property
    def neuron_names(self) -> Tuple[str, ...]:
        """The stateful modules that are neurons: :attr:`memory_module_names` less dropout masks
        (which are reset too, but are no neurons)."""
        kinds = dict(self.state_kinds)
        return tuple(n for n in self.memory_module_names if kinds.get(n, neurons.NEURON) == neurons.NEURON)

    @cached_property
    def _by_name(self) -> dict:
        return {item.name: item for item in self.linear_shapes + self.conv_shapes}

    @cached_property
    def stateful_paths(self) -> frozenset:
        """Paths of the stateful modules and of every module that contains one."""
        paths = set()
        for name in self.memory_module_names:
            parts = name.split(".")
            paths.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        return frozenset(paths)

    def shape(self, name: str) -> LinearShape:
        item = self._by_name.get(name)
        if not isinstance(item, LinearShape):
            raise KeyError(f"{name!r} is not a Linear TP candidate; candidates: {self.tensor_parallel_candidate_names}")
        return item

    def conv(self, name: str) -> ConvShape:
        item = self._by_name.get(name)
        if not isinstance(item, ConvShape):
            raise KeyError(f"{name!r} is not a convolution of the model; convolutions: "
                           f"{tuple(c.name for c in self.conv_shapes)}")
        return item

    def to_dict(self) -> dict:
        return dataclass_dict(self, "analysis")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SNNDistributedAnalysis":
        data = check_kind(data, "analysis")
        check_keys(data, "analysis", _PATHS[:3], tuple(f.name for f in dataclasses.fields(cls)))
        for name in _PATHS + _OPTIONAL_PATHS:
            if name in data:
                data[name] = string_tuple("analysis", name, data[name], optional=name in _OPTIONAL_PATHS)
        count = data.get("trainable_parameters")
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
            raise TypeError(f"analysis.trainable_parameters must be a non-negative int or None, got {count!r}")
        for name in _PATH_TUPLES:
            if name in data:
                data[name] = tuple(string_tuple("analysis", name + "[]", item)
                                   for item in string_tuple_list("analysis", name, data[name]))
        objects = {
            "data_layout": _optional_layout(data.pop("data_layout", None)),
            "linear_shapes": tuple(LinearShape(**check_kind(s, "linear")) for s in data.pop("linear_shapes", ())),
            "attention_blocks": tuple(AttentionBlock(**{k: tuplify(v) for k, v in check_kind(b, "attention").items()})
                                      for b in data.pop("attention_blocks", ())),
            "conv_shapes": tuple(ConvShape(**check_kind(c, "conv")) for c in data.pop("conv_shapes", ())),
            "fused_attention_blocks": tuple(FusedAttentionBlock(**check_kind(b, "fused_attention"))
                                            for b in data.pop("fused_attention_blocks", ())),
            "branch_attention_blocks": tuple(
                BranchAttentionBlock(**{k: tuplify(v) for k, v in check_kind(b, "branch_attention").items()})
                for b in data.pop("branch_attention_blocks", ())),
            "gated_mlps": tuple(GatedMLP(**{k: tuplify(v) for k, v in check_kind(g, "gated_mlp").items()})
                                for g in data.pop("gated_mlps", ())),
        }
        return cls(**{k: tuplify(v) for k, v in data.items()}, **objects)


def _optional_layout(value: Any) -> Optional[DataLayout]:
    return None if value is None else layout_of(value)


def string_tuple_list(owner: str, name: str, value: Any) -> list:
    """``value`` if it is a list (or tuple) of items, else TypeError (the items are checked by the caller)."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{owner}.{name} must be a list of lists of strings, got {type(value).__name__}")
    return list(value)


def _validate_roots(model: nn.Module, roots: Optional[Sequence[str]]) -> Optional[Tuple[str, ...]]:
    if roots is None:
        return None
    if isinstance(roots, str):
        roots = (roots,)
    names = modules_by_name(model)
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


def _has_per_feature_state(module: nn.Module) -> bool:
    state = non_persistent_buffer_names(module)
    persistent = [t for n, t in own_tensors(module) if n not in state]
    return any(t.numel() > 1 for t in persistent)


def shared_parameters(model: nn.Module) -> Tuple[Tuple[str, ...], ...]:
    """Groups of parameter paths that name one shared (tied) parameter."""
    groups = {}
    for name, param in named_parameters_all(model):
        groups.setdefault(id(param), []).append(name)
    return tuple(tuple(g) for g in groups.values() if len(g) > 1)


def _conv_note(convs: Sequence[str], paired: Sequence[str]) -> list:
    """What the conv gate would shard: exactly the convolutions its plan pairs, the rest named whole."""
    if not convs:
        return []
    whole = [c for c in convs if c not in paired]
    text = f"{len(convs)} conv layer(s) are not Linear TP candidates; "
    if paired:
        text += (f"DistributedFeatureSet(allow_experimental_conv_tp=True) shards the channels of {len(paired)} "
                 f"of them ({len(paired) // 2} output-/input-channel pair(s) along conv chains)")
    else:
        text += "channel TP shards none of them"
    if whole:
        text += (f"; {len(whole)} stay whole ({', '.join(whole[:4])}{', ...' if len(whole) > 4 else ''}): not "
                 "paired in a chain of groups=1 convolutions with only BatchNorms, neurons, pooling or "
                 "elementwise modules between")
    return [text + "."]


def _layout(model: nn.Module, example_input, labels, data_layout) -> Tuple[Optional[DataLayout], str, list]:
    """The data layout, how it was found and its note: given, detected from ``example_input`` (and
    ``labels``), or None when neither is given."""
    if example_input is None:
        if data_layout is None:
            return None, "", []
        layout = layout_of(data_layout)
        return layout, f"{layout.name}: given", [f"data layout {layout}: given."]
    layout, how = detect_layout(model, example_input, neurons.reset_all, labels, data_layout=data_layout,
                                assume="time_major")
    return layout, how, [f"data layout {layout}; {how}."]


@dataclass
class _Scan:
    """What one walk over a model's modules finds (see :func:`_scan`)."""

    memory: list = field(default_factory=list)  # stateful modules
    libraries: list = field(default_factory=list)  # (path, snn library)
    kinds: list = field(default_factory=list)  # (path, state kind)
    per_feature: list = field(default_factory=list)  # neurons with per-feature state
    norms: list = field(default_factory=list)  # BatchNorm-like layers
    linears: list = field(default_factory=list)  # LinearShape under the roots
    convs: list = field(default_factory=list)  # ConvShape under the roots
    convs_named: list = field(default_factory=list)  # their paths


def _scan(model: nn.Module, roots) -> _Scan:
    """Stateful modules, norms and per-feature neurons of the whole model; Linears and convs under ``roots``."""
    scan = _Scan()
    for name, module in modules_by_name(model).items():
        if isinstance(module, NORM_TYPES):
            scan.norms.append(name)
        library = neurons.snn_library(module)
        if library and name:
            scan.memory.append(name)
            scan.libraries.append((name, library))
            scan.kinds.append((name, neurons.state_kind(module)))
        if neurons.is_spiking_neuron(module) and _has_per_feature_state(module):
            scan.per_feature.append(name)
        if not name or not under(name, roots):
            continue
        if isinstance(module, nn.Linear):
            scan.linears.append(LinearShape(name, module.in_features, module.out_features))
        elif isinstance(module, CONV_TYPES):
            scan.convs_named.append(name)
            scan.convs.append(ConvShape(name, module.in_channels, module.out_channels, module.groups,
                                        len(module.kernel_size)))
    return scan


def _explicit_state_note(explicit: Sequence[str]) -> list:
    if not explicit:
        return []
    return [f"{', '.join(explicit)}: snntorch neuron(s) with init_hidden=False; the model's forward passes "
            "their membrane explicitly (spk, mem = lif(x, mem)), so their state lives in forward's local "
            "variables, not in the module: nothing to reset between batches if forward starts it "
            "fresh (mem = lif.init_leaky()), and it is sharded with the activations that carry it."]


def analyze(model: nn.Module, *, model_family: Optional[str] = None, roots: Optional[Sequence[str]] = None,
            example_input=None, labels=None, data_layout=None) -> SNNDistributedAnalysis:
    """Find stateful neurons (whole model) and Linear TP candidates (under ``roots``); with an
    ``example_input`` batch (and its ``labels``) also where N and T sit in the model's input and
    output (:func:`~snn_explorer.core.model.layouts.detect_layout`; a given ``data_layout`` is checked)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"analyze expects a torch.nn.Module, got {type(model).__name__}")
    roots = _validate_roots(model, roots)
    with new_objects_collected() as collect:  # its temporaries die young (deep models: no full collections)
        try:
            layout, layout_how, notes = _layout(model, example_input, labels, data_layout)
            with one_walk():
                return _analysis(model, model_family, roots, layout, layout_how, notes)
        finally:
            collect()


def _analysis(model: nn.Module, model_family, roots, layout, layout_how, notes) -> SNNDistributedAnalysis:
    """:func:`analyze` after its checks and the layout's detection (inside one structure walk)."""
    family, family_note = resolve_family(model, model_family)
    notes += [family_note] if family_note else []
    scan = _scan(model, roots)
    memory, linears, unsupported = scan.memory, scan.linears, scan.convs_named
    explicit = neurons.explicit_state_neurons(model)
    notes.extend(_explicit_state_note(explicit))
    if not linears:
        notes.append("no Linear tensor-parallel candidates found" + (f" under roots {roots}" if roots else ""))
    candidates = tuple(s.name for s in linears)
    linear_chains = chains(model, roots, "linear", candidates)
    conv_runs = tuple(c for c in chains(model, roots, "conv") if len(c) > 1)
    in_runs = {p for c in conv_runs for p in c}  # a residual-block run already inside a conv chain is paired there
    block_runs = tuple(b for b in block_conv_chains(model, roots) if not {p for p in b if p in unsupported} <= in_runs)
    notes.extend(_conv_note(unsupported, paired_layers(conv_runs + block_runs, unsupported)))
    units, unit_problem = pipeline_units(model)
    gated = gated_mlps(model, roots, candidates)
    in_gated = {p for g in gated for p in g.parts}
    return SNNDistributedAnalysis(
        memory_module_names=tuple(memory),
        tensor_parallel_candidate_names=candidates,
        unsupported_tensor_parallel_names=tuple(unsupported),
        notes=tuple(notes),
        tensor_parallel_roots=roots,
        model_family=family,
        snn_libraries=tuple(scan.libraries),
        linear_shapes=tuple(linears),
        tp_chains=linear_chains,
        fsdp_unit_names=fsdp_units(model),
        per_feature_neuron_names=tuple(scan.per_feature),
        attention_blocks=attention_blocks(model, roots, memory),
        batchnorm_names=tuple(scan.norms),
        conv_shapes=tuple(scan.convs),
        conv_chains=conv_runs,
        fused_attention_blocks=fused_attention_blocks(model, roots, memory),
        pointwise_chains=tuple(c for c in pointwise_chains(model, roots)
                               if c not in linear_chains and not in_gated & set(c)),
        block_conv_chains=block_runs,
        branch_attention_blocks=branch_attention_blocks(model, roots, memory),
        shared_parameter_groups=shared_parameters(model),
        trainable_parameters=trainable_count(model),
        explicit_state_names=explicit,
        state_kinds=tuple(scan.kinds),
        pipeline_units=units,
        pipeline_problem=unit_problem,
        trainable_units=trainable_units(model, units),
        data_layout=layout,
        data_layout_how=layout_how,
        gated_mlps=gated,
    )
