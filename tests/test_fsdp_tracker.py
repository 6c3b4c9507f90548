"""fsdp2 with activation checkpointing: the estimated peak against torch's FSDPMemTracker and measure(), on 2 gloo ranks.

The model is the one the issue reported (four 512-wide Linear/LIF layers run all T = 4 steps at once, batch 4,
float32, Adam): its memory is mostly parameters and optimizer state, so FSDP2's all-gather and reshard
bookkeeping during a checkpointed unit's recompute decides the peak. One spawn runs every plan twice: under
FSDPMemTracker (a warm-up step, then the tracked step) and under measure()'s own instrumented step.
"""
import dataclasses

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_on_ranks

import snn_explorer as se
from snn_explorer import compat
from snn_explorer.estimator import estimate
from snn_explorer.estimator.measurement.plan_measurement import measure_on_rank
from snn_explorer.estimator.measurement.settings import measure_settings
from snn_explorer.zoo import reset_state
from snn_explorer.zoo.mlp import SpikingMLP

T, N, WIDTH = 4, 4, 512
GATES = se.DistributedFeatureSet(allow_activation_checkpointing=True)


def _model_and_input():
    torch.manual_seed(0)
    model = SpikingMLP(in_features=WIDTH, hidden=(WIDTH,) * 3, num_classes=WIDTH, stepping="all_steps", init_gain=2.0)
    return model, (torch.rand(T, N, WIDTH) < 0.3).float()


def _plans(model):
    base = se.plan(analysis=se.analyze(model), objective="speed", topology={"dp": 2}, batch_size=N, mode="fsdp2",
                   features=GATES, activation_checkpointing="none")
    levered = [base, dataclasses.replace(base, activation_checkpointing="blocks"),
               dataclasses.replace(base, activation_checkpointing="blocks", checkpoint_every=2)]
    return levered + [dataclasses.replace(p, memopt_level=1) for p in levered]  # memopt 1: reshard after forward


def _tracked_peak(plan) -> int:
    model, x = _model_and_input()
    runtime = se.apply(model=model, plan=plan, device_type="cpu")
    x = x[:, dist.get_rank() * plan.per_rank_batch:(dist.get_rank() + 1) * plan.per_rank_batch]
    optimizer = runtime.build_optimizer(torch.optim.Adam, lr=1e-3)

    def step():
        optimizer.zero_grad(set_to_none=True)
        runtime.module(x).pow(2).mean().backward()
        optimizer.step()
        reset_state(runtime.module)

    step()  # Adam's state exists before the tracked step, as in measure()
    tracker = compat.fsdp_mem_tracker_class()(runtime.module, optimizer)
    tracker.track_inputs((x,))
    with tracker:
        step()
        tracker.reset_mod_stats()
        compat.restart_mem_tracker_peak(tracker, x.device)
        step()
    return tracker.get_tracker_snapshot("peak")[x.device]["Total"]


def _rank_peaks():
    model, x = _model_and_input()
    plans = _plans(model)
    tracked = [_tracked_peak(p) for p in plans]
    run = measure_settings(model, plans, x, None, 1, "adam", None, 1e-3, "cpu")
    return tracked, [m["row"]["peak_bytes"] for m in measure_on_rank(model, plans, run)]


@pytest.mark.timeout(400)
def test_fsdp2_checkpointing_estimate_matches_fsdp_mem_tracker_and_measure():
    per_rank = run_on_ranks(_rank_peaks, 2, timeout=300)
    model, x = _model_and_input()
    plans = _plans(model)
    for i, plan in enumerate(plans):
        tracked = max(r[0][i] for r in per_rank)
        measured = max(r[1][i] for r in per_rank)
        est = estimate(model, plan, example_input=x, hardware="H100-SXM").peak_bytes
        label = f"memopt {plan.memopt_level} {plan.activation_checkpointing}/{plan.checkpoint_every}"
        assert abs(est - tracked) <= 0.05 * tracked, f"{label}: estimated {est}, FSDPMemTracker {tracked}"
        assert abs(est - measured) <= 0.05 * measured, f"{label}: estimated {est}, measured {measured}"
    # non-trivial: resharding after the forward lowers the tracked peak by about a unit's parameters
    assert max(r[0][3] for r in per_rank) < max(r[0][0] for r in per_rank) - WIDTH * WIDTH * 4 // 2
