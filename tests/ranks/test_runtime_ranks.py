"""Runtime helpers: data loading over the dp coordinate, output preparation, optimizer choice.
(The tests in one process: tests/unit/test_runtime.py.)"""
import torch
from distributed_harness import run_on_ranks
from torch.utils.data import TensorDataset

import snn_explorer as se

N_SAMPLES = 16


def _loader_rank():
    from snn_explorer.zoo import build

    zoo = build("mlp")
    plan = se.plan(analysis=se.analyze(zoo.model), objective="memory", topology={"dp": 2, "tp": 2},
                   backend="torch", batch_size=4)
    runtime = se.apply(model=zoo.model, plan=plan, device_type="cpu")
    loader = runtime.prepare_dataloader(TensorDataset(torch.arange(N_SAMPLES)), shuffle=True)
    epochs = []
    for epoch in range(2):
        runtime.set_epoch(epoch)
        epochs.append([batch[0].tolist() for batch in loader])
    return dict(dp_rank=runtime.dp_rank, tp_rank=runtime.tp_rank, epochs=epochs, mode=plan.mode,
                optimizer=type(runtime.build_optimizer()).__name__)


def test_dataloader_splits_over_dp_and_tp_peers_share_samples():
    results = run_on_ranks(_loader_rank, 4, timeout=90)
    assert {r["mode"] for r in results} == {"fsdp2_tp"}
    by_dp = {}
    for r in results:
        by_dp.setdefault(r["dp_rank"], []).append(r)
    assert sorted(by_dp) == [0, 1]
    for peers in by_dp.values():
        assert sorted(p["tp_rank"] for p in peers) == [0, 1]
        assert peers[0]["epochs"] == peers[1]["epochs"], "tensor-parallel peers must see the same samples"
    for epoch in range(2):
        seen = [s for dp in (0, 1) for batch in by_dp[dp][0]["epochs"][epoch] for s in batch]
        assert sorted(seen) == list(range(N_SAMPLES)), "dp ranks must cover the dataset exactly once"
        assert all(len(b) == 2 for b in by_dp[0][0]["epochs"][epoch]), "global batch 4 / dp 2 per rank"
    assert by_dp[0][0]["epochs"][0] != by_dp[0][0]["epochs"][1], "set_epoch must reshuffle"


def _zero_rank():
    from snn_explorer.zoo import build

    zoo = build("mlp")
    plan = se.plan(analysis=se.analyze(zoo.model), objective="speed", topology={"dp": 2}, backend="torch",
                   batch_size=8)
    runtime = se.apply(model=zoo.model, plan=plan, device_type="cpu")
    return type(runtime.build_optimizer(torch.optim.SGD, lr=0.1)).__name__, plan.optimizer_strategy


def test_zero_plan_builds_zero_redundancy_optimizer():
    assert run_on_ranks(_zero_rank, 2, timeout=60) == [("ZeroRedundancyOptimizer", "zero")] * 2
