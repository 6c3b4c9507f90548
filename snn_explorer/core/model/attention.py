"""Attention blocks and pointwise MLPs that head-aligned tensor parallelism can split."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from torch import nn

from ...compat import plain_attribute
from ..common.serialize import dataclass_dict
from .dataflow import heads_from_width
from .structure import NORM_TYPES, flatten, runs, under
from .walk import modules_by_name


@dataclass(frozen=True)
class AttentionBlock:
    """Multi-head attention with separate q/k/v/output Linears; ``neurons`` sit between q and proj.

    ``local_heads``: the block holds no neurons and its traced forward reads the head count from the
    q/k/v widths (:func:`~snn_explorer.core.model.dataflow.heads_from_width`), so splitting it by heads
    needs no feature gate (as a Llama-style attention is split).
    """

    path: str
    num_heads: int
    q: str
    k: str
    v: str
    proj: str
    neurons: Tuple[str, ...] = ()
    local_heads: bool = False

    def to_dict(self) -> dict:
        return dataclass_dict(self, "attention")


_QKV_NAMES = {"q": ("q", "q_linear", "q_proj", "wq"), "k": ("k", "k_linear", "k_proj", "wk"),
              "v": ("v", "v_linear", "v_proj", "wv"), "proj": ("proj", "out_proj", "o_proj", "wo", "o")}


def _attention_block(path: str, module: nn.Module, memory: Sequence[str]) -> Optional[AttentionBlock]:
    heads = plain_attribute(module, "num_heads")
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
    width = children[found["q"].rpartition(".")[2]].out_features
    local = not neurons and heads > 0 and width % heads == 0 and heads_from_width(
        module, [found[r].rpartition(".")[2] for r in ("q", "k", "v")], width // heads)
    return AttentionBlock(path, heads, found["q"], found["k"], found["v"], found["proj"], neurons, local)


@dataclass(frozen=True)
class FusedAttentionBlock:
    """Attention whose q, k and v come from one fused projection laid out ``[3, heads, head_dim]``.

    ``qkv`` and ``proj`` are Linears or pointwise (kernel 1) Conv1d; ``qkv_norm`` a BatchNorm on
    the fused output; ``neuron`` the stateful module fed by it.
    """

    path: str
    num_heads: int
    qkv: str
    proj: str
    qkv_norm: Optional[str] = None
    neuron: Optional[str] = None

    def to_dict(self) -> dict:
        return dataclass_dict(self, "fused_attention")


def _num_heads(module: nn.Module) -> Optional[int]:
    heads = plain_attribute(module, "num_heads")
    return heads if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0 else None


def is_pointwise(module: nn.Module) -> bool:
    """A Linear, or a Conv1d with kernel 1 and one group: a per-position feature map."""
    if isinstance(module, nn.Linear):
        return True
    return (isinstance(module, nn.Conv1d) and module.kernel_size == (1,) and module.groups == 1
            and module.stride == (1,) and module.padding == (0,) and module.dilation == (1,))


def _width(module: nn.Module) -> Tuple[int, int]:
    return (module.in_features, module.out_features) if isinstance(module, nn.Linear) else \
        (module.in_channels, module.out_channels)


def _fused_block(path: str, module: nn.Module, memory: Sequence[str]) -> Optional[FusedAttentionBlock]:
    heads = _num_heads(module)
    if heads is None:
        return None
    qkv = proj = norm = neuron = None
    for name, sub in module.named_modules(prefix=path):
        if qkv is None:
            if is_pointwise(sub) and _width(sub)[1] == 3 * _width(sub)[0]:
                qkv, dim = name, _width(sub)[0]
        elif is_pointwise(sub):
            if _width(sub) == (dim, dim):
                proj = name
            break
        elif norm is None and neuron is None and isinstance(sub, NORM_TYPES) \
                and sub.num_features == 3 * dim:
            norm = name
        elif neuron is None and name in memory:
            neuron = name
    if qkv is None or proj is None or dim % heads:
        return None
    return FusedAttentionBlock(path, heads, qkv, proj, norm, neuron)


def attention_blocks(model: nn.Module, roots, memory: Sequence[str]) -> Tuple[AttentionBlock, ...]:
    """Attention with separate q/k/v/proj Linears under ``roots``."""
    found = (_attention_block(n, m, memory) for n, m in modules_by_name(model).items() if n and under(n, roots))
    return tuple(b for b in found if b is not None)


def fused_attention_blocks(model: nn.Module, roots, memory: Sequence[str]) -> Tuple[FusedAttentionBlock, ...]:
    """Attention with one fused q/k/v projection under ``roots`` (spikingjelly's Spikformer)."""
    found = []
    for name, module in modules_by_name(model).items():
        if name and under(name, roots) and _attention_block(name, module, memory) is None:
            block = _fused_block(name, module, memory)
            if block is not None and not any(block.path.startswith(b.path + ".") for b in found):
                found.append(block)
    return tuple(found)


def pointwise_chains(model: nn.Module, roots) -> Tuple[Tuple[str, ...], ...]:
    """Runs of pointwise layers among the children of custom (non-Sequential) modules, taken in
    registration order: the MLPs of Spikformer-style blocks. Used only behind the spikformer gate,
    which trusts that order."""
    modules = modules_by_name(model)
    found = []
    for name, module in modules.items():
        if isinstance(module, nn.Sequential) or _num_heads(module) is not None or not module._modules:
            continue
        sequence = flatten(module, name + "." if name else "", roots)
        layer = lambda path, kind: kind in ("linear", "conv") and is_pointwise(modules[path]) and under(path, roots)
        found.extend(run for run in runs(sequence, "pointwise", layer)
                     if sum(1 for p in run if layer(p, "linear" if isinstance(modules[p], nn.Linear) else "conv")) > 1)
    return tuple(found)


@dataclass(frozen=True)
class BranchAttentionBlock:
    """Spike-driven attention with one branch per q, k, v (a 1x1 conv, then an optional BatchNorm
    and neuron, as children ``q_conv``, ``q_bn``, ``q_lif``) and a 1x1 conv projection ``proj``.

    ``branches`` holds every module of the q, k and v branches in registration order; ``neurons``
    the block's other children (neurons on the attention output, which holds this rank's heads). Any
    other child (a Softmax, a Linear mixing heads) makes the block unrecognised.
    """

    path: str
    num_heads: int
    convs: Tuple[str, str, str]
    branches: Tuple[str, ...]
    proj: str
    neurons: Tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return dataclass_dict(self, "branch_attention")


def _is_one_by_one(module: nn.Module) -> bool:
    """A Conv1d/2d with kernel 1, one group, stride 1, no padding: a per-position channel map."""
    return (isinstance(module, (nn.Conv1d, nn.Conv2d)) and set(module.kernel_size) == {1} and module.groups == 1
            and set(module.stride) == {1} and set(module.padding) == {0} and set(module.dilation) == {1})


def _holds_state(path: str, memory: Sequence[str]) -> bool:
    return any(m == path or m.startswith(path + ".") for m in memory)


def _branch(path: str, children: dict, role: str, memory: Sequence[str]) -> Optional[Tuple[str, ...]]:
    """The ``role_*`` children: a 1x1 conv first, then only BatchNorms over its channels and neurons."""
    names = [n for n in children if n.startswith(role + "_")]
    if not names or not _is_one_by_one(children[names[0]]):
        return None
    width = children[names[0]].out_channels
    for name in names[1:]:
        sub, full = children[name], f"{path}.{name}"
        norm = isinstance(sub, NORM_TYPES) and sub.num_features == width
        if not norm and not _holds_state(full, memory):
            return None
    return tuple(f"{path}.{n}" for n in names)


def _branch_block(path: str, module: nn.Module, memory: Sequence[str]) -> Optional[BranchAttentionBlock]:
    heads = _num_heads(module)
    if heads is None:
        return None
    children = dict(module.named_children())
    found = {role: _branch(path, children, role, memory) for role in ("q", "k", "v", "proj")}
    if any(b is None for b in found.values()):
        return None
    convs = tuple(found[r][0] for r in ("q", "k", "v"))
    widths = {children[c.rpartition(".")[2]].out_channels for c in convs}
    proj = children[found["proj"][0].rpartition(".")[2]]
    claimed = {p.rpartition(".")[2] for b in found.values() for p in b}
    rest = [f"{path}.{n}" for n in children if n not in claimed]
    if any(not _holds_state(p, memory) for p in rest):
        return None
    if len(widths) != 1 or proj.in_channels not in widths or widths.pop() % heads:
        return None
    branches = tuple(p for r in ("q", "k", "v") for p in found[r])
    return BranchAttentionBlock(path, heads, convs, branches, found["proj"][0], tuple(rest))


def branch_attention_blocks(model: nn.Module, roots, memory: Sequence[str]) -> Tuple[BranchAttentionBlock, ...]:
    """Spike-driven attention with q/k/v branches of 1x1 conv + BatchNorm + neuron under ``roots``."""
    found = (_branch_block(n, m, memory) for n, m in modules_by_name(model).items() if n and under(n, roots))
    return tuple(b for b in found if b is not None)
