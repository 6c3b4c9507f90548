"""Checkpoints across precisions on real gloo ranks: what a bf16 or fp16 run saves are its fp32 master
weights and fp32 optimizer state, which a plan of any precision and mode loads exactly; an fp16 run's
loss scaler (scale, growth tracker, skipped steps) travels with them to an fp16 plan.
(The tests in one process: tests/unit/test_precision_checkpoint.py.)"""
import torch
import torch.distributed as dist
from distributed_harness import run_on_ranks
from test_precision_checkpoint import GATE
from torch import nn

from snn_explorer.core.parallelize import LossScaler

FRESH = LossScaler().state_dict()


def _runtime(mode, topology, precision):
    import snn_explorer as se
    from snn_explorer.zoo import build

    zoo = build("mlp_all_steps", seed=0)
    plan = se.plan(analysis=se.analyze(zoo.model, model_family=zoo.family), objective="speed", topology=topology,
                   batch_size=zoo.batch_size, mode=mode, features=se.DistributedFeatureSet(**GATE), options=se.PlanOptions(precision=precision))
    runtime = se.apply(model=zoo.model, plan=plan, device_type="cpu")
    share, start = plan.per_rank_batch, runtime.dp_rank * plan.per_rank_batch
    return runtime, runtime.build_optimizer(torch.optim.Adam, lr=1e-2), (
        zoo.example_input[:, start:start + share], zoo.labels[start:start + share])


def _train(runtime, optimizer, batch, steps, overflow_at=None):
    """``steps`` steps; at ``overflow_at`` rank 1 alone gets an inf gradient (an fp16 overflow)."""
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        losses.append(float(runtime.train_step(nn.CrossEntropyLoss(), *batch)))
        if step == overflow_at and dist.get_rank() == 1:
            grad = next(p.grad for p in runtime.model.parameters() if p.grad is not None)
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")
        runtime.step(optimizer)
    runtime.reset_state()
    return losses


def _optimizer_state(runtime, optimizer):
    local = getattr(optimizer, "optim", optimizer)
    return dict(dtypes={str(v.dtype) for s in local.state.values() for k, v in s.items() if k != "step"},
                steps={float(s["step"]) for s in local.state.values()})


def _resumed(path, mode, topology, precision):
    runtime, optimizer, batch = _runtime(mode, topology, precision)
    loaded = runtime.load_checkpoint(path, optimizer=optimizer)
    params = runtime.full_parameters()
    out = dict(params=params, scaler=runtime.scaler and runtime.scaler.state_dict(),
               restored=loaded.scaler_restored, saved_precision=loaded.plan.precision.name,
               optimizer=_optimizer_state(runtime, optimizer))
    out["next_loss"] = _train(runtime, optimizer, batch, 1)[0]  # and it trains on
    out["finite"] = all(bool(torch.isfinite(v).all()) for v in runtime.full_parameters().values())
    return out


def _compare(saved, resumed):
    """The resumed run's parameters against the saved ones: exactly equal, fp32 (not sent back)."""
    params = resumed.pop("params")
    resumed["equal"] = all(torch.equal(params[k], v) for k, v in saved.items()) and set(params) == set(saved)
    resumed["dtypes"] = {str(v.dtype) for v in params.values()}
    return resumed


def _across_precisions(root):
    out = {}
    # fp16 FSDP2, three steps, the second overflowing on rank 1: the scaler halves and counts one skip
    runtime, optimizer, batch = _runtime("fsdp2", {"dp": 2}, "fp16")
    initial = runtime.full_parameters()
    out["fp16_losses"] = _train(runtime, optimizer, batch, 3, overflow_at=1)
    out["fp16_scaler"] = runtime.scaler.state_dict()
    saved = runtime.full_parameters()
    out["moved"] = not any(torch.equal(saved[k], v) for k, v in initial.items())
    runtime.save_checkpoint(f"{root}/fp16", optimizer=optimizer, step=3)
    for mode, topology, precision in (("dp", {"dp": 2}, "bf16"), ("tp", {"tp": 2}, "fp32"),
                                      ("dp", {"dp": 2}, "fp16"), ("pp", {"pp": 2}, "bf16")):
        out[f"fp16->{mode}/{precision}"] = _compare(saved, _resumed(f"{root}/fp16", mode, topology, precision))
    # the reverse: bf16 DDP saved, resumed in fp16 (a fresh scaler) and fp32 FSDP2
    runtime, optimizer, batch = _runtime("dp", {"dp": 2}, "bf16")
    _train(runtime, optimizer, batch, 2)
    saved = runtime.full_parameters()
    runtime.save_checkpoint(f"{root}/bf16", optimizer=optimizer, step=2)
    for mode, topology, precision in (("tp", {"tp": 2}, "fp16"), ("fsdp2", {"dp": 2}, "fp32")):
        out[f"bf16->{mode}/{precision}"] = _compare(saved, _resumed(f"{root}/bf16", mode, topology, precision))
    return out


def test_checkpoints_hold_fp32_masters_and_the_loss_scaler_across_precisions(tmp_path):
    """fp16 FSDP2 (after a skipped overflow step) saved -> dp bf16, tp fp32, dp fp16, pp bf16; bf16 DDP saved ->
    tp fp16, fsdp2 fp32: every plan loads the saved fp32 weights bit for bit, Adam's state in fp32 at the saved
    step count, and trains on; only the fp16 plan takes the saved scaler (scale halved, one skip), an fp16 plan
    resuming a bf16 checkpoint starts a fresh scaler."""
    results = run_on_ranks(_across_precisions, 2, str(tmp_path), timeout=300)
    for rank, res in enumerate(results):
        assert res["moved"], "training did not change the weights: nothing to compare"
        scaler = res["fp16_scaler"]
        assert scaler == dict(scale=FRESH["scale"] / 2, clean_steps=1, skipped_steps=1), (rank, scaler)
        for key in ("fp16->dp/bf16", "fp16->tp/fp32", "fp16->dp/fp16", "fp16->pp/bf16",
                    "bf16->tp/fp16", "bf16->fsdp2/fp32"):
            got = res[key]
            assert got["equal"] and got["dtypes"] == {"torch.float32"}, (rank, key, got)
            assert got["optimizer"]["dtypes"] == {"torch.float32"}, (rank, key, got)
            # Adam counts the skipped fp16 step as not taken: 2 of 3 steps; the bf16 run took 2
            assert got["optimizer"]["steps"] == {2.0}, (rank, key, got)
            assert got["finite"] and got["next_loss"] == got["next_loss"], (rank, key, got)
        assert res["fp16->dp/fp16"]["scaler"] == scaler and res["fp16->dp/fp16"]["restored"], rank
        assert res["fp16->dp/bf16"]["scaler"] is None and not res["fp16->dp/bf16"]["restored"], rank
        assert res["bf16->tp/fp16"]["scaler"] == FRESH and not res["bf16->tp/fp16"]["restored"], rank
        assert res["fp16->tp/fp32"]["saved_precision"] == "fp16", rank
