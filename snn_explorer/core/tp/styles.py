"""Tensor-parallel styles: one class per style of a plan, in one registry (:data:`STYLES`).

A plan keeps style *names* (``tensor_parallel_plan: {path: name}``, plain JSON); whatever needs to
know what a name means asks its style here: the layer kind it applies to and the feature gate it
needs, its plan-time check, how it applies on a TP mesh, each tensor's local shape and which
indices a TP rank holds, the collectives one call issues, how the estimator's TP replica cuts the
module, and the Explorer's label. Adding a style is adding a class here.
"""
from __future__ import annotations

from typing import List, Mapping, Optional, Sequence, Tuple

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ..common.collectives import Collective
from . import channel_styles

#: Sharding of a module's input or output over the tp group.
WHOLE, SHARDED = "whole", "sharded"
CONV_GATE, SPIKFORMER_GATE = "allow_experimental_conv_tp", "allow_experimental_spikformer_tp"

#: Layer kinds a style applies to, as an error message names them.
KINDS = {
    "linear": "a Linear TP candidate",
    "conv": "a convolution (Conv1d/2d/3d)",
    "batchnorm": "a BatchNorm",
    "neuron": "a stateful neuron module",
    "attention": "an attention module (fused q/k/v, or q/k/v conv branches)",
    "qkv": "the fused q/k/v projection of an attention module",
    "qkv_norm": "the BatchNorm on a fused q/k/v projection",
}
_NORM_TENSORS = {"weight": 0, "bias": 0, "running_mean": 0, "running_var": 0}


def layer_kinds(analysis, path: str) -> frozenset:
    """The layer kinds (:data:`KINDS`) the analysis found at ``path``."""
    kinds = set()
    if path in analysis.tensor_parallel_candidate_names:
        kinds.add("linear")
    if any(c.name == path for c in analysis.conv_shapes):
        kinds.add("conv")
    if path in analysis.batchnorm_names:
        kinds.add("batchnorm")
    if path in analysis.stateful_paths:
        kinds.add("neuron")
    for block in analysis.fused_attention_blocks:
        kinds.update(kind for kind, role in (("attention", block.path), ("qkv", block.qkv),
                                             ("qkv_norm", block.qkv_norm)) if role == path)
    if any(b.path == path for b in analysis.branch_attention_blocks):
        kinds.add("attention")
    return frozenset(kinds)


def heads_block_of(analysis, path: str):
    """The attention block that ``path`` is the module (fused or branch attention), fused projection or
    norm of (None if none)."""
    fused = (b for b in analysis.fused_attention_blocks if path in (b.path, b.qkv, b.qkv_norm))
    return next(fused, None) or next((b for b in analysis.branch_attention_blocks if b.path == path), None)


class TPStyle:
    """What one style name of a plan means. Subclasses set the attributes and override what differs."""

    name = ""
    kind = ""  #: the layer kind (KINDS) it applies to
    gates: Tuple[str, ...] = ()  #: DistributedFeatureSet gates, one of which must be on (none: no gate)
    label = ""  #: the Explorer's "sharded_dim" text
    takes = WHOLE  #: the sharding its input must have
    gives = WHOLE  #: the sharding of its output
    split: Mapping[str, int] = {}  #: tensor (parameter / buffer) name -> the dim split over tp
    cut = ""  #: how the estimator's replica cuts the module: "outputs", "inputs", "norm", "heads" or ""
    reduces_input_grad = False  #: backward: all-reduce of the input gradient
    reduces_output = False  #: forward: all-reduce of the partial output
    gathers_output = False  #: forward: all-gather of the sharded output

    def __repr__(self) -> str:
        return f"<TP style {self.name!r} for {KINDS[self.kind]}>"

    @property
    def shards_parameters(self) -> bool:
        return bool(self.split)

    @property
    def wraps_calls(self) -> bool:
        """Whether each call of the module goes through a torch ``ParallelStyle``'s hooks and DTensor
        (False for a style that leaves the module as it is, running on its input's local shard)."""
        return self.parallel_style() is not None

    # ---- plan time
    def check(self, analysis, path: str, tp_size: int) -> None:
        """Raise ValueError unless ``path`` is of this style's layer kind and ``tp_size`` divides it."""
        problem = self.kind_problem(analysis, path)
        if problem:
            raise ValueError(problem)
        self.check_sizes(analysis, path, tp_size)

    def check_gate(self, path: str, features) -> None:
        """Raise ValueError if the style is gated and ``features`` (a DistributedFeatureSet) has no gate on."""
        if self.gates and not any(getattr(features, g) for g in self.gates):
            need = " or ".join(f"{g}=True" for g in self.gates)
            raise ValueError(f"tensor_parallel_plan[{path!r}]={self.name!r} is experimental; it needs "
                             f"DistributedFeatureSet({need})")

    def sizes(self, analysis, path: str) -> Tuple[Tuple[str, str, int], ...]:
        """``(module path, attribute, size)`` of each size that ``tp`` must divide."""
        return ()

    def check_sizes(self, analysis, path: str, tp_size: int) -> None:
        for owner, attr, size in self.sizes(analysis, path):
            if size % tp_size:
                raise ValueError(f"tp={tp_size} does not divide {owner}.{attr}={size} ({self.name} splits {attr}); "
                                 f"pick a tp size that divides {size} or leave {path!r} out of the TP plan")

    def kind_problem(self, analysis, path: str) -> str:
        """Why the module at ``path`` is not of this style's layer kind ('' when it is)."""
        kinds = layer_kinds(analysis, path)
        if self.kind in kinds:
            return ""
        if not kinds:
            return (f"tensor_parallel_plan key {path!r} is not a tensor-parallel candidate; candidates: "
                    f"{analysis.tensor_parallel_candidate_names}")
        head = f"tensor_parallel_plan[{path!r}]={self.name!r} applies to {KINDS[self.kind]}"
        fits = [s.name for s in STYLES.values() if s.kind in kinds]
        return f"{head}, but {path!r} is {' and '.join(KINDS[k] for k in sorted(kinds))}; styles for it: {fits}"

    # ---- on the ranks
    def apply(self, module, mesh) -> None:
        """Shard ``module`` in place on the 1-D ``mesh`` (a torch ParallelStyle through parallelize_module)."""

        style = self.parallel_style()
        if style is not None:
            parallelize_module(module, mesh, style)

    def parallel_style(self):
        """The torch ``ParallelStyle`` that shards the module (None: nothing to shard)."""
        return None

    def sharded_width(self, module) -> Optional[Tuple[int, int]]:
        """``(full width, dim)`` of the sharded output of a layer of this style (None when whole)."""
        return None

    # ---- shapes, collectives (estimator, Explorer)
    def local_shape(self, leaf: str, shape: Sequence[int], tp: int) -> Tuple[int, ...]:
        """The shape of the module's tensor ``leaf`` (of full ``shape``) on one of ``tp`` ranks."""
        shape, dim = tuple(shape), self.split.get(leaf)
        if dim is None or len(shape) <= dim:
            return shape
        return shape[:dim] + (shape[dim] // tp,) + shape[dim + 1:]

    def held(self, leaf: str, shape: Sequence[int], tp: int, tp_rank: int) -> Optional[Tuple[int, List[int]]]:
        """``(dim, indices)``: the model's indices along ``dim`` that TP rank ``tp_rank`` holds, in the
        order of its local tensor; None when the tensor is whole on every rank."""
        dim = self.split.get(leaf)
        if dim is None or tp <= 1 or len(shape) <= dim:
            return None
        size = shape[dim] // tp
        return dim, list(range(tp_rank * size, (tp_rank + 1) * size))

    def collectives(self, module_profile, n: int, t: int, itemsize: int) -> List[Tuple[str, str, int, int]]:
        """``(kind, phase, count, bytes)`` of one step's calls of the module (a profile's ModuleProfile)."""
        calls, out = round(module_profile.calls(n, t)), []
        out_bytes = round(module_profile.out_elems(n, t)) * itemsize
        if self.reduces_output:
            out.append((Collective.ALL_REDUCE, "forward", calls, out_bytes))
        if self.gathers_output:
            out.append((Collective.ALL_GATHER, "forward", calls, out_bytes))
        if self.reduces_input_grad and module_profile.input_requires_grad:
            out.append((Collective.ALL_REDUCE, "backward", calls, round(module_profile.in_elems(n, t)) * itemsize))
        return out


class Colwise(TPStyle):
    name, kind, label = "colwise", "linear", "out_features"
    gives, split, cut, reduces_input_grad = SHARDED, {"weight": 0, "bias": 0}, "outputs", True

    def sizes(self, analysis, path):
        return ((path, "out_features", analysis.shape(path).out_features),)

    def parallel_style(self):
        return ColwiseParallel()

    def sharded_width(self, module):
        return module.out_features, -1


class ColwiseGather(Colwise):
    name, label, gives, gathers_output = "colwise_gather", "out_features (output gathered)", WHOLE, True

    def parallel_style(self):
        return ColwiseParallel(output_layouts=Replicate())

    def sharded_width(self, module):
        return None


class Rowwise(TPStyle):
    name, kind, label = "rowwise", "linear", "in_features"
    takes, split, cut, reduces_output = SHARDED, {"weight": 1}, "inputs", True

    def sizes(self, analysis, path):
        return ((path, "in_features", analysis.shape(path).in_features),)

    def parallel_style(self):
        return RowwiseParallel()


class _Channels(TPStyle):
    kind, gates = "conv", (CONV_GATE, SPIKFORMER_GATE)

    attr = ""

    def sizes(self, analysis, path):
        return ((path, self.attr, getattr(analysis.conv(path), self.attr)),)

    def check_sizes(self, analysis, path, tp_size):
        conv = analysis.conv(path)
        if conv.groups != 1:
            raise ValueError(f"{path} has groups={conv.groups}; channel TP supports groups=1 convolutions only")
        super().check_sizes(analysis, path, tp_size)


class ConvColwise(_Channels):
    name, label = "conv_colwise", "out_channels"
    gives, split, cut, reduces_input_grad = SHARDED, {"weight": 0, "bias": 0}, "outputs", True

    attr = "out_channels"

    def parallel_style(self):
        return channel_styles.ConvColwiseParallel()

    def sharded_width(self, module):
        return module.out_channels, -1 - len(module.kernel_size)


class ConvRowwise(_Channels):
    name, label = "conv_rowwise", "in_channels"
    takes, split, cut, reduces_output = SHARDED, {"weight": 1}, "inputs", True

    attr = "in_channels"

    def parallel_style(self):
        return channel_styles.ConvRowwiseParallel()


class NormLocal(TPStyle):
    name, kind, gates, label = "norm_local", "batchnorm", (CONV_GATE, SPIKFORMER_GATE), "channels"
    takes, gives, split, cut = SHARDED, SHARDED, _NORM_TENSORS, "norm"

    def parallel_style(self):
        return channel_styles.NormLocalParallel()


class _Heads(TPStyle):
    """Fused q/k/v attention: each rank owns whole heads of q, k and v."""

    gates = (SPIKFORMER_GATE,)

    def sizes(self, analysis, path):
        block = heads_block_of(analysis, path)
        return ((block.path, "num_heads", block.num_heads),)

    def check_sizes(self, analysis, path, tp_size):
        block = heads_block_of(analysis, path)
        if block.num_heads % tp_size:
            raise ValueError(f"tp={tp_size} does not divide {block.path}.num_heads={block.num_heads}; "
                             "head-aligned attention TP gives each rank whole heads")

    def held(self, leaf, shape, tp, tp_rank):
        if leaf not in self.split or tp <= 1 or not shape:
            return None

        local = shape[0] // tp
        return 0, channel_styles.head_aligned_rows(shape[0] // 3, tp)[tp_rank * local:(tp_rank + 1) * local].tolist()


class QkvColwise(_Heads):
    name, kind, label = "qkv_colwise", "qkv", "q/k/v outputs (whole heads)"
    gives, split, cut, reduces_input_grad = SHARDED, {"weight": 0, "bias": 0}, "outputs", True

    def parallel_style(self):
        return channel_styles.FusedQkvColwiseParallel()

    def sharded_width(self, module):
        if hasattr(module, "out_features"):
            return module.out_features, -1
        return module.out_channels, -1 - len(module.kernel_size)


class QkvNormLocal(_Heads):
    name, kind, label = "qkv_norm_local", "qkv_norm", "q/k/v channels (whole heads)"
    takes, gives, split, cut = SHARDED, SHARDED, _NORM_TENSORS, "norm"

    def parallel_style(self):
        return channel_styles.FusedQkvNormParallel()


class HeadsLocal(_Heads):
    name, kind, label, cut = "heads_local", "attention", "num_heads", "heads"

    def parallel_style(self):
        return channel_styles.HeadsLocalParallel()


class Local(TPStyle):
    name, kind, label = "local", "neuron", "neuron state (features)"
    takes, gives = SHARDED, SHARDED

    def check_sizes(self, analysis, path, tp_size):
        blocked = [n for n in analysis.per_feature_neuron_names if n == path or n.startswith(path + ".")]
        if blocked:
            raise ValueError(f"neuron {blocked[0]!r} has per-feature parameters and cannot take a "
                             "column-sharded input; leave the Linear before it out of the TP plan")


#: Every style, by the name plans store.
STYLES = {s.name: s for s in (Colwise(), Rowwise(), ColwiseGather(), ConvColwise(), ConvRowwise(), NormLocal(),
                              QkvColwise(), QkvNormLocal(), HeadsLocal(), Local())}
TP_STYLES = tuple(STYLES)


def style_of(name, path: str = "?") -> TPStyle:
    """The style called ``name`` (the value of ``tensor_parallel_plan[path]``); ValueError if none."""
    style = STYLES.get(name) if isinstance(name, str) else None
    if style is None:
        raise ValueError(f"tensor_parallel_plan[{path!r}]={name!r} is not a TP style; expected one of {TP_STYLES}")
    return style
