"""The precision vocabulary (core.precision), plan()'s choice of it, neuron state kept in fp32 under bf16
layers, and fp16's loss scaler surviving an overflow on real gloo ranks.
(The tests in one process: tests/unit/test_precision.py.)"""

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_on_ranks
from test_precision import GATE
from torch import nn


# ---- fp16: the loss scaler survives an overflow ------------------------------------------------------
def _fp16_overflow(mode, topology):
    import snn_explorer as se
    from snn_explorer.zoo import build

    zoo = build("mlp_all_steps", seed=0)
    plan = se.plan(analysis=se.analyze(zoo.model, model_family=zoo.family), objective="speed", topology=topology,
                   batch_size=zoo.batch_size, mode=mode, features=GATE, options=se.PlanOptions(precision="fp16"))
    runtime = se.apply(model=zoo.model, plan=plan, device_type="cpu")
    share, start = plan.per_rank_batch, runtime.dp_rank * plan.per_rank_batch
    x, y = zoo.example_input[:, start:start + share], zoo.labels[start:start + share]
    opt = runtime.build_optimizer(torch.optim.Adam, lr=1e-2)
    scales, taken, params_before = [], [], None
    for step in range(3):
        opt.zero_grad()
        runtime.train_step(nn.CrossEntropyLoss(), x, y)
        if step == 1 and dist.get_rank() == 1:  # an overflow on one rank only
            grad = next(p.grad for p in runtime.model.parameters() if p.grad is not None)
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")
        if step == 1:
            params_before = {k: v.clone() for k, v in runtime.full_parameters().items()}
        scales.append(runtime.scaler.scale)
        taken.append(runtime.step(opt))
        if step == 1:
            unchanged = all(torch.equal(v, params_before[k]) for k, v in runtime.full_parameters().items())
    finite = all(bool(torch.isfinite(v).all()) for v in runtime.full_parameters().values())
    return dict(scales=scales, taken=taken, unchanged=unchanged, finite=finite, scale=runtime.scaler.scale,
                skipped=runtime.scaler.skipped_steps)


@pytest.mark.parametrize("mode,topology", [("fsdp2", {"dp": 2}), ("dp", {"dp": 2}), ("tp", {"tp": 2}), ("pp", {"pp": 2})])
def test_fp16_scaler_skips_an_overflow_on_every_rank_and_lowers_the_scale(mode, topology):
    """Rank 1 alone sees an inf in step 2: every rank skips that step (the decision is all-reduced, so
    the replicas stay equal), the scale halves, no weight turns inf or NaN, and step 3 trains again."""
    for rank, res in enumerate(run_on_ranks(_fp16_overflow, 2, mode, topology, timeout=180)):
        assert res["taken"] == [True, False, True], (rank, res)
        assert res["unchanged"] and res["finite"], (rank, res)
        assert res["scales"][2] == res["scales"][1] / 2 and res["skipped"] == 1, (rank, res)
