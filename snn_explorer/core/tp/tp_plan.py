"""Tensor-parallel plans as data: module path -> style name, built and checked at plan time."""
from __future__ import annotations

from typing import Dict, Mapping, Sequence

from ..model.analysis import SNNDistributedAnalysis
from .styles import SHARDED, STYLES, TP_STYLES, style_of

__all__ = ["TP_STYLES", "auto_tp_plan", "head_aligned_tp_plan", "gated_mlp_plan", "conv_tp_plan", "default_tp_plan",
           "with_local_neurons", "check_tp_plan", "check_tied_parameters"]


def _stateful_inside(analysis: SNNDistributedAnalysis, path: str) -> bool:
    return path in analysis.stateful_paths


def auto_tp_plan(analysis: SNNDistributedAnalysis) -> Dict[str, str]:
    """Pair the Linears of every chain column -> row; an odd last one gathers its output. Gated MLPs
    and attention whose forward reads its heads from the q/k/v widths are split as torchtitan splits
    a Llama block: branches (w1, w3) and q/k/v column-wise, the Linear after them (w2, o) row-wise."""
    candidates = set(analysis.tensor_parallel_candidate_names)
    plan: Dict[str, str] = {}
    for chain in analysis.tp_chains:
        linears = [p for p in chain if p in candidates]
        for i, path in enumerate(linears):
            plan[path] = "colwise" if i % 2 == 0 else "rowwise"
        if len(linears) % 2:
            plan[linears[-1]] = "colwise_gather"
    for block in analysis.attention_blocks:
        if block.local_heads:
            plan.update({block.q: "colwise", block.k: "colwise", block.v: "colwise", block.proj: "rowwise"})
    plan.update(gated_mlp_plan(analysis))
    return with_local_neurons(analysis, plan)


def gated_mlp_plan(analysis: SNNDistributedAnalysis) -> Dict[str, str]:
    """Every gated MLP: its branches column-wise, the neurons between holding their features, its
    last Linear row-wise."""
    plan: Dict[str, str] = {}
    for mlp in analysis.gated_mlps:
        plan.update({b: "colwise" for b in mlp.branches}, **{mlp.proj: "rowwise"})
        plan.update({p: "local" for p in mlp.between if _stateful_inside(analysis, p)})
    return plan


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
    for branch in analysis.branch_attention_blocks:
        plan.update(branch_attention_plan(analysis, branch))
    return plan


def branch_attention_plan(analysis: SNNDistributedAnalysis, block) -> Dict[str, str]:
    """A spike-driven attention block by heads: each q/k/v branch conv output-channel-sharded with its
    BatchNorm and neuron local, the block computing its local heads, the projection input-sharded."""
    plan = {block.path: "heads_local", block.proj: "conv_rowwise"}
    plan.update({p: "conv_colwise" for p in block.convs})
    plan.update({p: "norm_local" if p in analysis.batchnorm_names else "local"
                 for p in block.branches + block.neurons if p not in block.convs})
    return plan


def default_tp_plan(analysis: SNNDistributedAnalysis, features) -> Dict[str, str]:
    """The TP layout a TP mode gets without an explicit plan under ``features`` (the one decision
    the planner and the Explorer share): attention by heads when its gate is on and the model has
    attention, else Linear chains paired; conv chains added under the conv gate."""
    if features.allow_experimental_spikformer_tp and has_attention(analysis):
        plan = head_aligned_tp_plan(analysis)
    else:
        plan = auto_tp_plan(analysis)
    if features.allow_experimental_conv_tp:
        plan.update(conv_tp_plan(analysis))
    return plan


def has_attention(analysis: SNNDistributedAnalysis) -> bool:
    """Whether the analysis found attention that head-aligned TP can split."""
    return bool(analysis.attention_blocks or analysis.fused_attention_blocks or analysis.branch_attention_blocks)


def has_gated_attention(analysis: SNNDistributedAnalysis) -> bool:
    """Whether the analysis found attention that only its feature gate splits by heads (all but
    attention without neurons that reads its heads from the q/k/v widths)."""
    return bool(any(not b.local_heads for b in analysis.attention_blocks) or analysis.fused_attention_blocks
                or analysis.branch_attention_blocks)


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
    for chain in analysis.conv_chains + analysis.block_conv_chains:
        plan.update(_pair(analysis, chain, [p for p in chain if p in convs]))
    return plan


def _runs(analysis: SNNDistributedAnalysis) -> list:
    """Every run of modules in known execution order (Linear, conv and pointwise chains)."""
    return (list(analysis.tp_chains) + list(analysis.conv_chains) + list(analysis.pointwise_chains)
            + list(analysis.block_conv_chains))


def _is_layer(analysis: SNNDistributedAnalysis, path: str) -> bool:
    return path in analysis.tensor_parallel_candidate_names or path in _conv_names(analysis)


def with_local_neurons(analysis: SNNDistributedAnalysis, plan: Mapping[str, str]) -> Dict[str, str]:
    """Add ``local`` for stateful modules (and ``norm_local`` for BatchNorms) that a sharded layer
    output reaches along a chain before the next layer."""
    out = dict(plan)
    for mlp in analysis.gated_mlps:
        if out.get(mlp.branches[0]) == "colwise":
            out.update({p: "local" for p in mlp.between if p not in out and _stateful_inside(analysis, p)})
    for run in _runs(analysis):
        sharded = False
        for path in run:
            if _is_layer(analysis, path):
                sharded = path in out and STYLES.get(out[path]) is not None and STYLES[out[path]].gives == SHARDED
            elif sharded and path not in out and path in analysis.batchnorm_names:
                out[path] = "norm_local"
            elif sharded and path not in out and _stateful_inside(analysis, path):
                out[path] = "local"
    return out


def check_tp_plan(analysis: SNNDistributedAnalysis, plan: Mapping[str, str], tp_size: int,
                  features=None) -> None:
    """Raise ValueError for a plan that cannot compute: unknown paths or styles, a style on another
    layer kind or without its gate (when ``features`` is given), sizes ``tp_size`` does not divide,
    shardings that do not line up along a chain or an attention block, and tied parameters it would
    split."""
    if not plan:
        raise ValueError("tensor_parallel_plan is empty; give at least one 'path': 'colwise'/'rowwise' entry")
    for path, name in plan.items():
        style = style_of(name, path)
        style.check(analysis, path, tp_size)
        if features is not None:
            style.check_gate(path, features)
    _check_attention(analysis, plan, tp_size)
    _check_gated(analysis, plan)
    for run in _flow_runs(analysis, plan):
        _check_flow(analysis, plan, run)
    check_tied_parameters(analysis, plan)


def _attention_parts(analysis: SNNDistributedAnalysis) -> set:
    parts = set()
    for b in analysis.attention_blocks:
        parts.update((b.q, b.k, b.v, b.proj) + b.neurons)
    for f in analysis.fused_attention_blocks:
        parts.update(p for p in (f.path, f.qkv, f.proj, f.qkv_norm, f.neuron) if p)
    for b in analysis.branch_attention_blocks:
        parts.update((b.path, b.proj) + b.branches + b.neurons)
    for g in analysis.gated_mlps:
        parts.update(g.parts)
    return parts


def _check_gated(analysis: SNNDistributedAnalysis, plan: Mapping[str, str]) -> None:
    """A gated MLP is split with every branch 'colwise' and its last Linear 'rowwise', or not at all."""
    for g in analysis.gated_mlps:
        got = {p: plan.get(p) for p in g.branches + (g.proj,)}
        shards = [p for p, s in got.items() if s in STYLES and SHARDED in (STYLES[s].takes, STYLES[s].gives)]
        want = dict({b: "colwise" for b in g.branches}, **{g.proj: "rowwise"})
        if shards and got != want:
            raise ValueError(f"gated MLP {g.path!r}: {list(g.branches)} read one input and are combined feature-wise "
                             f"into {g.proj!r}, so it is split with all of {want} (or none of them sharded); got {got}")


def _check_attention(analysis: SNNDistributedAnalysis, plan: Mapping[str, str], tp_size: int) -> None:
    """Attention is split by whole heads or not at all: q, k, v colwise with proj rowwise (or none
    of them sharded); a fused block with all its parts in their head styles (or none)."""
    for b in analysis.attention_blocks:
        got = {p: plan.get(p) for p in (b.q, b.k, b.v, b.proj)}
        shards = [p for p, s in got.items() if s in STYLES and SHARDED in (STYLES[s].takes, STYLES[s].gives)]
        if shards and got != {b.q: "colwise", b.k: "colwise", b.v: "colwise", b.proj: "rowwise"}:
            raise ValueError(f"attention {b.path!r} is split by heads only with q, k, v 'colwise' and proj 'rowwise' "
                             f"(or none of them sharded: 'colwise_gather' or absent); got {got}")
        if shards and b.num_heads % tp_size:
            raise ValueError(f"tp={tp_size} does not divide {b.path}.num_heads={b.num_heads}; "
                             "head-aligned attention TP gives each rank whole heads")
        kv_heads = analysis.shape(b.k).out_features * b.num_heads // analysis.shape(b.q).out_features
        if shards and kv_heads % tp_size:
            raise ValueError(f"tp={tp_size} does not divide the {kv_heads} k/v heads of {b.path} ({b.k!r} has "
                             f"{analysis.shape(b.k).out_features} features); head-aligned attention TP gives each "
                             "rank whole k/v heads")
    for f in analysis.fused_attention_blocks:
        proj = "rowwise" if f.proj in analysis.tensor_parallel_candidate_names else "conv_rowwise"
        want = {f.path: "heads_local", f.qkv: "qkv_colwise", f.proj: proj}
        want.update({f.qkv_norm: "qkv_norm_local"} if f.qkv_norm else {})
        got = {p: plan.get(p) for p in want}
        if any(got.values()) and got != want:
            raise ValueError(f"fused attention {f.path!r} is split by heads only with all of {want}; got {got}")
    for b in analysis.branch_attention_blocks:
        want = branch_attention_plan(analysis, b)
        got = {p: plan.get(p) for p in want}
        if any(got.values()) and got != want:
            raise ValueError(f"attention {b.path!r} is split by heads only with all of {want}; got {got}")


def _flow_runs(analysis: SNNDistributedAnalysis, plan: Mapping[str, str]) -> list:
    """The runs whose sharding must line up: every chain not inside a longer one or an attention
    block, and each sharded layer of the plan that no chain holds, on its own."""
    attention = _attention_parts(analysis)
    runs = [r for r in dict.fromkeys(_runs(analysis)) if not set(r) <= attention]
    runs = [r for r in runs if not any(len(o) > len(r) and set(r) <= set(o) for o in runs)]
    seen = {p for r in runs for p in r} | attention
    return runs + [(p,) for p in plan if p not in seen]


def _check_flow(analysis: SNNDistributedAnalysis, plan: Mapping[str, str], run) -> None:
    """Walk ``run`` in order: each module must get the sharding its style takes, a sharded output
    may reach only modules that hold shards, and the run must end whole."""
    state, source = "whole", None
    for path in run:
        name = plan.get(path)
        if name is None:
            if state == SHARDED and (_is_layer(analysis, path) or path in analysis.batchnorm_names):
                raise ValueError(f"{path!r} gets the sharded output of {source!r} ({plan[source]!r}) but is not in "
                                 "the tensor_parallel_plan; shard it input-wise ('rowwise' / 'conv_rowwise', "
                                 "BatchNorms 'norm_local') or make the earlier layer 'colwise_gather'")
            continue
        style = STYLES[name]
        if style.takes != state:
            got = f"the sharded output of {source!r} ({plan[source]!r})" if state == SHARDED else "a whole input"
            raise ValueError(f"tensor_parallel_plan[{path!r}]={name!r} needs a {style.takes} input but gets {got} "
                             f"along {list(run)}; pair each 'colwise' with a following 'rowwise' (or gather it "
                             "with 'colwise_gather')")
        if style.gives == SHARDED and style.takes != SHARDED:
            source = path
        state = style.gives
    if state == SHARDED:
        raise ValueError(f"the output of {source!r} ({plan[source]!r}) leaves {list(run)} sharded, so what follows "
                         "would compute on this rank's shard only; end the chain with a 'rowwise' layer or make "
                         f"{source!r} 'colwise_gather'")


def check_tied_parameters(analysis: SNNDistributedAnalysis, plan: Mapping[str, str] = None,
                          fsdp_units: Sequence[str] = ()) -> None:
    """Raise ValueError if a TP plan would shard a parameter shared by several modules (TP would
    untie it) or FSDP2 units would put its users in different units."""
    plan = plan or {}
    for group in analysis.shared_parameter_groups:
        sharded = [p for p in group if _sharded_by(plan, p)]
        if sharded:
            raise ValueError(f"parameters {list(group)} are one tied parameter, and the tensor_parallel_plan shards "
                             f"{sharded} (TP would untie them and they would train apart); leave their modules out "
                             "of the TP plan")
        units = {_unit_of(fsdp_units, p) for p in group}
        if fsdp_units and len(units) > 1:
            raise ValueError(f"parameters {list(group)} are one tied parameter, but fall in different FSDP2 units "
                             f"{sorted(units)}; FSDP2 shards a tied parameter only within one unit")


def _sharded_by(plan: Mapping[str, str], param: str) -> bool:
    owner, _, leaf = param.rpartition(".")
    style = STYLES.get(plan.get(owner))
    return style is not None and leaf in style.split


def _unit_of(units: Sequence[str], param: str) -> str:
    """The innermost FSDP2 unit holding ``param`` ('' = the root)."""
    parts = param.split(".")
    return next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in units), "")
