"""Lever variants' profiles composed from runs cut to a few repeated blocks (estimator/profile/repeats_totals.py)
equal the whole model's runs: every estimate figure of checkpointed (every block, every 2nd, named blocks) and
spike-compressed plans (fsdp2; tp every 2nd block with compression) and activation offload (fsdp2), on a deep
all-steps MLP."""
import dataclasses

import pandas as pd
import torch

import snn_explorer as se
from snn_explorer.core.levers import activation_offload_variants, copy_without_levers, lever_variants, with_blocks
from snn_explorer.estimator import estimate
from snn_explorer.estimator.budget_fit import FIT_FEATURES
from snn_explorer.estimator.enumerate import enumerate_plans
from snn_explorer.estimator.profile import checkpointed, profiling, repeats_log
from snn_explorer.estimator.profile.profiling import measure_profile
from snn_explorer.estimator.profile.repeats import find_repeats
from snn_explorer.estimator.profile.repeats_totals import stride_cuts, strided_repeats
from snn_explorer.zoo import SpikingMLP


def _plans(model, x):
    analysis = se.analyze(model, example_input=x)
    bases = {}
    for p in enumerate_plans(analysis, world_size=2, batch_size=4, features=FIT_FEATURES):
        bases.setdefault(p.mode, copy_without_levers(p))
    fsdp2, units = bases["fsdp2"], analysis.fsdp_unit_names
    tp = [v for v in lever_variants(bases["tp"]) if v.checkpoint_every == 2 and v.spike_compression]
    # named blocks: early ones (composed), one deep (the pattern repeats only after it), two apart
    return lever_variants(fsdp2) + activation_offload_variants(fsdp2) + tp + [with_blocks(fsdp2, names)
                                         for names in ([units[0]], [units[1], units[9]], [units[3], units[5]])]


def test_lever_variants_composed_from_cut_runs_equal_the_whole_model(monkeypatch):
    monkeypatch.setattr(repeats_log, "MIN_LOG_REPEATS", 7)  # logged runs composed from 8 blocks of 2 repeats
    torch.manual_seed(0)
    model, x = SpikingMLP(16, (16,) * 16, 8, stepping="all_steps"), torch.rand(3, 4, 16)
    full = measure_profile(model, x, repeats=False)
    fast = measure_profile(model, x)
    assert full.composed is None and fast.composed is not None
    totals, logs = [], []

    def composed(*args, **kwargs):
        total = _affine_total(*args, **kwargs)
        totals.append(total is not None)
        return total

    def logged(*args, **kwargs):
        run = _cut_logged_run(*args, **kwargs)
        logs.append(run is not None and args[4] is not None)
        return run

    monkeypatch.setattr(checkpointed, "affine_total", composed)
    monkeypatch.setattr(profiling, "cut_logged_run", logged)
    plans = _plans(model, x)
    for plan in plans:
        want = estimate(model, plan, example_input=x, profile=full, hardware="H100-SXM")
        got = estimate(model, plan, example_input=x, profile=fast, hardware="H100-SXM")
        pd.testing.assert_frame_equal(got.per_rank, want.per_rank, check_exact=True)
        assert got.step_time_s == want.step_time_s, plan
    assert len(plans) >= 8 and sum(totals) >= 8 and sum(logs) >= 4, (sum(totals), sum(logs))
    # non-trivial: the levers change the figures compared
    plain = estimate(model, dataclasses.replace(plans[0], activation_checkpointing="none"), example_input=x,
                     profile=fast, hardware="H100-SXM")
    levered = estimate(model, plans[0], example_input=x, profile=fast, hardware="H100-SXM")
    assert levered.per_rank["activations_bytes"].max() < plain.per_rank["activations_bytes"].max()


_affine_total, _cut_logged_run = checkpointed.affine_total, profiling.cut_logged_run


def test_stride_cuts_follow_the_checkpointing_pattern():
    model = SpikingMLP(16, (16,) * 12, 8, stepping="all_steps")
    repeats = find_repeats(model)
    assert (repeats.path, repeats.period, repeats.count) == ("net", 2, 12)
    assert stride_cuts(repeats, ()) == (2, 3, 4)
    every_2nd = [(f"net.{2 * j}", 2) for j in range(0, 12, 2)]
    assert stride_cuts(repeats, every_2nd) == (2, 4, 6)
    strided = strided_repeats(repeats, every_2nd)  # 6 blocks of 2 repeats (4 children), each checkpointed alike
    assert (strided.start, strided.period, strided.count) == (0, 4, 6) and strided.block_keys(1) == ("4", "5", "6", "7")
    assert strided_repeats(repeats, [("net.2", 2), ("net.6", 2)]).start == 8  # plain from block 4 on
    assert stride_cuts(repeats, [("net.14", 2)]) == (8, 9, 10)  # plain from block 8 on
    assert stride_cuts(repeats, [("net.18", 2)]) is None  # too few repeats after it to gain
    assert stride_cuts(repeats, [("net.1", 2)]) is None  # a region across two repeats: a cut would split it
    assert stride_cuts(repeats, None) is None  # time chunks
