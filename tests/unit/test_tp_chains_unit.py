"""TP of Linear chains of any length (1, 2, 3, 10) with neurons, dropout and identity between.
(The tests on gloo ranks: tests/ranks/test_tp_chains.py.)"""
import pytest
from test_tp_chains import chain_model

import snn_explorer as se


@pytest.mark.parametrize("n", [1, 2, 3, 10])
def test_auto_plan_pairs_columns_and_rows(n):
    plan = se.plan(analysis=se.analyze(chain_model(n)), objective="memory", topology={"tp": 2}, backend="torch",
                   batch_size=4, mode="tp")
    linear = [s for s in plan.tensor_parallel_plan.values() if s != "local"]
    expected = ["colwise" if i % 2 == 0 else "rowwise" for i in range(n)]
    if n % 2:
        expected[-1] = "colwise_gather"
    assert linear == expected
