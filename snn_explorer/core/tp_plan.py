"""Tensor-parallel plans as data: module path -> style name, built and checked at plan time."""
from __future__ import annotations

from typing import Dict, Mapping

from .analysis import SNNDistributedAnalysis

#: Linear styles: column-sharded (output stays sharded), row-sharded (sharded input, summed
#: output), column-sharded with the output gathered back. ``local`` marks a stateful module fed
#: by a column-sharded Linear: its state is the local shard and its input is checked.
LINEAR_STYLES = ("colwise", "rowwise", "colwise_gather")
#: Channel TP (behind ``allow_experimental_conv_tp``): output-channel / input-channel sharded
#: convolutions, and a BatchNorm between them holding its channel shard.
CONV_STYLES = ("conv_colwise", "conv_rowwise", "norm_local")
#: Fused q/k/v (behind ``allow_experimental_spikformer_tp``): the projection's rows and its
#: BatchNorm split so each rank owns whole heads of q, k and v; the attention module's
#: ``num_heads`` becomes the local head count.
FUSED_STYLES = ("qkv_colwise", "qkv_norm_local", "heads_local")
TP_STYLES = LINEAR_STYLES + CONV_STYLES + FUSED_STYLES + ("local",)


def _stateful_inside(analysis: SNNDistributedAnalysis, path: str) -> bool:
    return path in analysis.stateful_paths


def auto_tp_plan(analysis: SNNDistributedAnalysis) -> Dict[str, str]:
    """Pair the Linears of every chain column -> row; an odd last one gathers its output."""
    candidates = set(analysis.tensor_parallel_candidate_names)
    plan: Dict[str, str] = {}
    for chain in analysis.tp_chains:
        linears = [p for p in chain if p in candidates]
        for i, path in enumerate(linears):
            plan[path] = "colwise" if i % 2 == 0 else "rowwise"
        if len(linears) % 2:
            plan[linears[-1]] = "colwise_gather"
    return with_local_neurons(analysis, plan)


def head_aligned_tp_plan(analysis: SNNDistributedAnalysis) -> Dict[str, str]:
    """Attention: q/k/v column-wise so each rank owns whole heads, its neurons local, proj row-wise;
    pointwise MLPs of custom blocks paired in registration order.

    Every other chain (MLPs, heads) is paired as in :func:`auto_tp_plan`.
    """
    plan = auto_tp_plan(analysis)
    linears = set(analysis.tensor_parallel_candidate_names)
    for block in analysis.attention_blocks:
        plan.update({block.q: "colwise", block.k: "colwise", block.v: "colwise", block.proj: "rowwise"})
        plan.update({n: "local" for n in block.neurons})
    for fused in analysis.fused_attention_blocks:
        plan.update({fused.path: "heads_local", fused.qkv: "qkv_colwise",
                     fused.proj: "rowwise" if fused.proj in linears else "conv_rowwise"})
        plan.update({fused.qkv_norm: "qkv_norm_local"} if fused.qkv_norm else {})
        plan.update({fused.neuron: "local"} if fused.neuron else {})
    for chain in analysis.pointwise_chains:
        plan.update(_pair(analysis, chain, [p for p in chain if p in linears or p in _conv_names(analysis)]))
    return plan


def _conv_names(analysis: SNNDistributedAnalysis) -> set:
    return {c.name for c in analysis.conv_shapes}


def _pair(analysis: SNNDistributedAnalysis, chain, layers) -> Dict[str, str]:
    """Shard ``layers`` of ``chain`` in pairs, output- then input-sharded; what sits between a pair
    (BatchNorms, neurons) holds its shard. An odd last layer stays whole."""
    plan: Dict[str, str] = {}
    linears = set(analysis.tensor_parallel_candidate_names)
    for first, second in zip(layers[0::2], layers[1::2]):
        plan[first] = "colwise" if first in linears else "conv_colwise"
        plan[second] = "rowwise" if second in linears else "conv_rowwise"
        between = chain[chain.index(first) + 1:chain.index(second)]
        plan.update({p: "norm_local" for p in between if p in analysis.batchnorm_names})
        plan.update({p: "local" for p in between if _stateful_inside(analysis, p)})
    return plan


def conv_tp_plan(analysis: SNNDistributedAnalysis) -> Dict[str, str]:
    """Pair the convolutions of every conv chain output-channel -> input-channel; an odd last one
    stays whole. BatchNorms and neurons between a pair hold their channel shard."""
    plan: Dict[str, str] = {}
    convs = _conv_names(analysis)
    for chain in analysis.conv_chains:
        plan.update(_pair(analysis, chain, [p for p in chain if p in convs]))
    return plan


def with_local_neurons(analysis: SNNDistributedAnalysis, plan: Mapping[str, str]) -> Dict[str, str]:
    """Add ``local`` for stateful modules between a ``colwise`` Linear and the next Linear."""
    out = dict(plan)
    candidates = set(analysis.tensor_parallel_candidate_names)
    for chain in analysis.tp_chains:
        sharded = False
        for path in chain:
            if path in candidates:
                sharded = out.get(path) == "colwise"
            elif sharded and _stateful_inside(analysis, path) and path not in out:
                out[path] = "local"
    return out


def check_tp_plan(analysis: SNNDistributedAnalysis, plan: Mapping[str, str], tp_size: int) -> None:
    """Raise ValueError for unknown paths or styles, and for sizes ``tp_size`` does not divide."""
    if not plan:
        raise ValueError("tensor_parallel_plan is empty; give at least one 'path': 'colwise'/'rowwise' entry")
    candidates = set(analysis.tensor_parallel_candidate_names)
    for block in analysis.attention_blocks:
        if plan.get(block.q) == "colwise" and block.num_heads % tp_size:
            raise ValueError(f"tp={tp_size} does not divide {block.path}.num_heads={block.num_heads}; "
                             "head-aligned attention TP gives each rank whole heads")
    for path, style in plan.items():
        if style not in TP_STYLES:
            raise ValueError(f"tensor_parallel_plan[{path!r}]={style!r} is not a TP style; expected one of {TP_STYLES}")
        if style == "local":
            if not _stateful_inside(analysis, path):
                raise ValueError(f"tensor_parallel_plan[{path!r}]='local' names no stateful neuron module; "
                                 f"stateful modules: {analysis.memory_module_names}")
            blocked = [n for n in analysis.per_feature_neuron_names if n == path or n.startswith(path + ".")]
            if blocked:
                raise ValueError(f"neuron {blocked[0]!r} has per-feature parameters and cannot take a "
                                 "column-sharded input; leave the Linear before it out of the TP plan")
            continue
        if style in CONV_STYLES:
            _check_channel_style(analysis, path, style, tp_size)
            continue
        if style in FUSED_STYLES:
            _check_fused_style(analysis, path, style, tp_size)
            continue
        if path not in candidates:
            raise ValueError(f"tensor_parallel_plan key {path!r} is not a tensor-parallel candidate; "
                             f"candidates: {analysis.tensor_parallel_candidate_names}")
        shape = analysis.shape(path)
        dim, size = ("in_features", shape.in_features) if style == "rowwise" else ("out_features", shape.out_features)
        if size % tp_size:
            raise ValueError(f"tp={tp_size} does not divide {path}.{dim}={size} ({style} splits {dim}); "
                             f"pick a tp size that divides {size} or leave {path!r} out of the TP plan")


def _check_channel_style(analysis: SNNDistributedAnalysis, path: str, style: str, tp_size: int) -> None:
    if style == "norm_local":
        if path not in analysis.batchnorm_names:
            raise ValueError(f"tensor_parallel_plan[{path!r}]='norm_local' names no BatchNorm; "
                             f"BatchNorms: {analysis.batchnorm_names}")
        return
    conv = analysis.conv(path)
    if conv.groups != 1:
        raise ValueError(f"{path} has groups={conv.groups}; channel TP supports groups=1 convolutions only")
    dim, size = ("in_channels", conv.in_channels) if style == "conv_rowwise" else ("out_channels", conv.out_channels)
    if size % tp_size:
        raise ValueError(f"tp={tp_size} does not divide {path}.{dim}={size} ({style} splits {dim}); "
                         f"pick a tp size that divides {size} or leave {path!r} out of the TP plan")


def _check_fused_style(analysis: SNNDistributedAnalysis, path: str, style: str, tp_size: int) -> None:
    role = {"heads_local": "path", "qkv_colwise": "qkv", "qkv_norm_local": "qkv_norm"}[style]
    block = next((b for b in analysis.fused_attention_blocks if getattr(b, role) == path), None)
    if block is None:
        raise ValueError(f"tensor_parallel_plan[{path!r}]={style!r} names no fused q/k/v attention part; fused "
                         f"attention blocks: {tuple(b.path for b in analysis.fused_attention_blocks)}")
    if block.num_heads % tp_size:
        raise ValueError(f"tp={tp_size} does not divide {block.path}.num_heads={block.num_heads}; "
                         "head-aligned attention TP gives each rank whole heads")
