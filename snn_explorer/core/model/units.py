"""A model's pipeline units: the modules its ``forward`` calls one after the other.

A model can be cut into pipeline stages when its ``forward`` calls its top-level modules one after
the other, each on the previous one's output (an ``nn.Sequential``, or a module whose forward is
``self.c(self.b(self.a(x)))``); nested ``nn.Sequential`` children are cut further. Those modules,
in order, are the model's *pipeline units*. Analysis reports them; planning lays stages over them.
"""
from __future__ import annotations

from typing import Sequence, Tuple

from torch import nn

from .structure import forward_chain, is_plain_sequential
from .walk import modules_by_name, named_parameters_all

#: What torch.fx says when a forward iterates over a traced tensor (``for x_t in x``) or ranges over its
#: length (``range(x.shape[0])``): in an SNN, the loop over time steps.
TIME_LOOP_SIGNS = ("Proxy object cannot be iterated", "'Proxy' object cannot be interpreted as an integer")
TIME_LOOP_HINT = (": the forward loops over the time steps of its input, which torch.fx cannot follow (a loop "
                  "over a tensor has no fixed length). A pipeline stage takes the whole [T, N, ...] input: move "
                  "the time loop into the layers (multi-step neurons such as spikingjelly step_mode='m', or a "
                  "module stepping a single-step neuron over dim 0, stateless layers applied to time folded "
                  "into the batch) and write the model as an nn.Sequential or a forward "
                  "self.c(self.b(self.a(x))); or choose a mode without pp (dp, fsdp2, tp)")


def pipeline_units(model: nn.Module) -> Tuple[Tuple[str, ...], str]:
    """The paths of the model's pipeline units and, when it has none, why (else '')."""
    chain, problem = forward_chain(model)
    if problem:
        return (), problem + (TIME_LOOP_HINT if any(sign in problem for sign in TIME_LOOP_SIGNS) else "")
    return tuple(_opened(model, modules_by_name(model), "", chain)), ""


def _opened(root: nn.Module, modules: dict, prefix: str, chain: Sequence[str]) -> list:
    """The units of ``chain`` (paths under the module at ``prefix`` in ``root``, whose path -> module
    table is ``modules``), each plain non-empty nn.Sequential opened into its own units."""
    units = []
    for name in chain:
        path = prefix + name
        module = modules.get(path)  # the walk's path -> module table, else (a repeated module) the lookup
        module = root.get_submodule(path) if module is None else module
        if is_plain_sequential(module) and len(module):
            units.extend(_opened(root, modules, path + ".", forward_chain(module)[0]))
        else:
            units.append(path)
    return units



def trainable_units(model: nn.Module, units: Sequence[str]) -> Tuple[str, ...]:
    """The ``units`` (module paths) that hold a parameter requiring grad."""
    holders = set()  # every module path above a trainable parameter
    for name, param in named_parameters_all(model):
        if param.requires_grad:
            parts = name.split(".")
            holders.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return tuple(u for u in units if u in holders)
