"""What a module's forward does with its children's outputs, read from a torch.fx trace of that
forward alone (its children stay single calls).

- Gated MLPs: two or more Linears read one input and their outputs meet, through feature-wise
  operations only, in one Linear (``w2(silu(w1(x)) * w3(x))``, the SwiGLU of Llama-style models).
  Tensor parallelism shards the branches column-wise and the last Linear row-wise: every
  feature-wise operation between them runs on this rank's features.
- Attention whose forward reads its head count from the q/k/v widths (``view(..., -1, head_dim)``),
  so that column-sharded q/k/v give each rank whole heads without the forward knowing.
"""
from __future__ import annotations

import operator
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
from torch import fx, nn

from ..common.serialize import dataclass_dict
from .structure import children_graph, kind, under
from .walk import modules_by_name


@dataclass(frozen=True)
class GatedMLP:
    """Linears ``branches`` reading one input (in call order), combined feature-wise into ``proj``;
    ``between`` the modules on the way (activations, neurons)."""

    path: str
    branches: Tuple[str, ...]
    proj: str
    between: Tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return dataclass_dict(self, "gated_mlp")

    @property
    def parts(self) -> Tuple[str, ...]:
        return self.branches + (self.proj,) + self.between


F = nn.functional
#: Functions and tensor methods that act on each feature alone (broadcasting a scalar or a tensor of
#: the same features).
_FUNCTIONS = frozenset({
    operator.mul, operator.add, operator.sub, operator.truediv, operator.neg, torch.mul, torch.add, torch.sub,
    torch.div, torch.neg, torch.sigmoid, torch.tanh, torch.relu, torch.exp, F.silu, F.gelu, F.relu, F.sigmoid,
    F.tanh, F.leaky_relu, F.elu, F.mish, F.softplus, F.hardswish, F.hardsigmoid, F.dropout,
})
_METHODS = frozenset({"mul", "add", "sub", "div", "neg", "sigmoid", "tanh", "relu", "exp", "mul_", "add_"})
_RESHAPES = frozenset({"view", "reshape", "unflatten"})


def _feature_wise(node: fx.Node, module: nn.Module) -> bool:
    if node.op == "call_function":
        return node.target in _FUNCTIONS
    if node.op == "call_method":
        return node.target in _METHODS
    if node.op == "call_module":
        return kind(module.get_submodule(node.target), "", None) == "elementwise"
    return False


def _reach(start: fx.Node, module: nn.Module, linears: set) -> Optional[Tuple[fx.Node, set]]:
    """The one Linear call ``start``'s output reaches through feature-wise nodes only, and those
    nodes; None when it escapes elsewhere (a reshape, the output, a second Linear)."""
    seen, ends, todo = set(), set(), [start]
    while todo:
        for user in todo.pop().users:
            if user in linears and user.args == (_only_input(user),):
                ends.add(user)
            elif _feature_wise(user, module):
                if user not in seen:
                    seen.add(user)
                    todo.append(user)
            else:
                return None
    return (ends.pop(), seen) if len(ends) == 1 else None


def _only_input(node: fx.Node):
    return node.args[0] if len(node.args) == 1 and not node.kwargs else None


def _full(path: str, child: str) -> str:
    return f"{path}.{child}" if path else child


def _gated(path: str, module: nn.Module, graph: fx.Graph, candidates: frozenset) -> Tuple[GatedMLP, ...]:
    calls = [n for n in graph.nodes if n.op == "call_module"]
    once = Counter(n.target for n in calls)
    linears = {n for n in calls if once[n.target] == 1 and _full(path, n.target) in candidates
               and isinstance(_only_input(n), fx.Node)}
    by_input = defaultdict(list)
    for node in sorted(linears, key=list(graph.nodes).index):
        by_input[_only_input(node)].append(node)
    found = []
    for branches in by_input.values():
        by_end = defaultdict(list)
        for branch in branches:
            reached = _reach(branch, module, linears)
            if reached is not None:
                by_end[reached[0]].append((branch, reached[1]))
        for end, hits in by_end.items():
            mlp = _gated_of(path, module, end, hits)
            found.extend([mlp] if mlp else [])
    return tuple(found)


def _gated_of(path: str, module: nn.Module, end: fx.Node, hits: list) -> Optional[GatedMLP]:
    """The gated MLP of ``hits`` (branch, nodes) meeting in ``end``, when they are two or more of one
    width that ``end`` reads and nothing else enters their combination."""
    branches = [b for b, _ in hits]
    inside = set(branches).union(*(nodes for _, nodes in hits))
    if len(branches) < 2 or any(a not in inside for n in inside - set(branches) for a in n.all_input_nodes) \
            or _only_input(end) not in inside:
        return None
    widths = {module.get_submodule(b.target).out_features for b in branches}
    if widths != {module.get_submodule(end.target).in_features}:
        return None
    between = tuple(_full(path, n.target) for n in inside - set(branches) if n.op == "call_module")
    return GatedMLP(path, tuple(_full(path, b.target) for b in branches), _full(path, end.target),
                    tuple(sorted(between)))


def gated_mlps(model: nn.Module, roots, candidates: Sequence[str]) -> Tuple[GatedMLP, ...]:
    """Every gated MLP among the modules under ``roots`` whose forward holds two or more Linear
    ``candidates`` as direct children (proved by tracing that forward)."""
    candidates = frozenset(candidates)
    found = []
    for name, module in modules_by_name(model).items():
        if isinstance(module, nn.Sequential) or (name and not under(name, roots)):
            continue
        if sum(_full(name, c) in candidates for c in module._modules) < 3:
            continue
        graph = children_graph(module)
        found.extend(_gated(name, module, graph, candidates) if graph is not None else ())
    return tuple(found)


def _sizes(node: fx.Node) -> Optional[tuple]:
    """The target sizes of a view / reshape / unflatten node (None for any other node)."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", None)
    if node.op not in ("call_method", "call_function") or name not in _RESHAPES:
        return None
    if name == "unflatten":
        return tuple(node.args[2]) if len(node.args) > 2 and isinstance(node.args[2], (tuple, list)) else None
    rest = node.args[1:]
    return tuple(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else tuple(rest)


def heads_from_width(module: nn.Module, children: Sequence[str], head_dim: int) -> bool:
    """Whether ``module``'s forward splits each of ``children``'s outputs into heads with a
    ``view`` / ``reshape`` / ``unflatten`` whose sizes end ``-1, head_dim``: the head count comes from
    the width, so a column shard of whole heads computes those heads."""
    graph = children_graph(module)
    if graph is None:
        return False
    calls = {n.target: n for n in graph.nodes if n.op == "call_module"}
    for child in children:
        node = calls.get(child)
        if node is None or len(node.users) != 1:
            return False
        sizes = _sizes(next(iter(node.users)))
        if sizes is None or len(sizes) < 2 or tuple(sizes[-2:]) != (-1, head_dim):
            return False
    return True
