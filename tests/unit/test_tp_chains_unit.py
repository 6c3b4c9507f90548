"""TP of Linear chains of any length (1, 2, 3, 10) with neurons, dropout and identity between.
(The tests on gloo ranks: tests/ranks/test_tp_chains.py.)"""
import pytest
import torch
from models import TimeLoop
from torch import nn

import snn_explorer as se
from snn_explorer.zoo import lif

WIDTH = 16


def chain_model(n_linears: int, seed: int = 0) -> nn.Module:
    """Linear layers with a stateful neuron, dropout(p=0) or identity between, stepped over time."""
    torch.manual_seed(seed)
    layers = []
    between = [lambda: lif(0.8), lambda: nn.Dropout(0.0), nn.Identity]
    for i in range(n_linears):
        layers.append(nn.Linear(WIDTH, WIDTH))
        with torch.no_grad():  # strong enough that all ten layers keep spiking
            layers[-1].weight.mul_(2.0)
            layers[-1].bias.fill_(0.3)
        if i < n_linears - 1:
            layers.append(between[i % 3]())
            if i % 3:
                layers.append(lif(0.8))
    return TimeLoop(nn.Sequential(*layers, lif(0.8)))


@pytest.mark.parametrize("n", [1, 2, 3, 10])
def test_auto_plan_pairs_columns_and_rows(n):
    plan = se.plan(analysis=se.analyze(chain_model(n)), objective="memory", topology={"tp": 2}, backend="torch",
                   batch_size=4, mode="tp")
    linear = [s for s in plan.tensor_parallel_plan.values() if s != "local"]
    expected = ["colwise" if i % 2 == 0 else "rowwise" for i in range(n)]
    if n % 2:
        expected[-1] = "colwise_gather"
    assert linear == expected
