"""Lever variants' profiles composed from runs cut to a few repeated blocks (estimator/profile/repeats_totals.py)
equal the whole model's runs: every estimate figure of checkpointed (every block, every 2nd, named blocks) and
spike-compressed plans, fsdp2 and tp, on a deep all-steps MLP."""
import dataclasses

import pandas as pd
import torch

import snn_explorer as se
from snn_explorer.core.block_choice import with_blocks
from snn_explorer.core.memory_levers import lever_variants
from snn_explorer.estimator import estimate
from snn_explorer.estimator.budget_fit import FIT_FEATURES
from snn_explorer.estimator.enumerate import enumerate_plans
from snn_explorer.estimator.profile import checkpointed
from snn_explorer.estimator.profile.profiling import measure_profile
from snn_explorer.estimator.profile.repeats import find_repeats
from snn_explorer.estimator.profile.repeats_totals import stride_cuts
from snn_explorer.zoo import SpikingMLP


def _plans(model, x):
    analysis = se.analyze(model, example_input=x)
    bases = [p for p in enumerate_plans(analysis, world_size=2, batch_size=4, features=FIT_FEATURES)
             if p.mode in ("fsdp2", "tp")]
    plans = [v for b in bases for v in lever_variants(b) if not v.cpu_offload]
    fsdp2 = next(b for b in bases if b.mode == "fsdp2")
    units = analysis.fsdp_unit_names
    # named blocks: early ones (composed), one deep (the pattern repeats only after it), two apart
    return plans + [with_blocks(fsdp2, names) for names in ([units[0]], [units[1], units[9]], [units[3], units[5]])]


def test_lever_variants_composed_from_cut_runs_equal_the_whole_model(monkeypatch):
    torch.manual_seed(0)
    model, x = SpikingMLP(16, (16,) * 12, 8, stepping="all_steps"), torch.rand(3, 4, 16)
    full = measure_profile(model, x, repeats=False)
    fast = measure_profile(model, x)
    assert full.composed is None and fast.composed is not None
    runs = []

    def composed(*args, **kwargs):
        total = _affine_total(*args, **kwargs)
        runs.append(total is not None)
        return total

    monkeypatch.setattr(checkpointed, "affine_total", composed)
    checked = 0
    for plan in _plans(model, x):
        want = estimate(model, plan, example_input=x, profile=full, hardware="H100-SXM")
        got = estimate(model, plan, example_input=x, profile=fast, hardware="H100-SXM")
        pd.testing.assert_frame_equal(got.per_rank, want.per_rank, check_exact=True)
        assert got.step_time_s == want.step_time_s, plan
        checked += 1
    assert checked >= 10 and sum(runs) >= 10, f"{sum(runs)} lever profiles composed from cut runs"
    # non-trivial: the levers change the figures compared
    base = _plans(model, x)[0]
    plain = estimate(model, dataclasses.replace(base, activation_checkpointing="none", spike_compression=False),
                     example_input=x, profile=fast, hardware="H100-SXM")
    levered = estimate(model, base, example_input=x, profile=fast, hardware="H100-SXM")
    assert levered.per_rank["activations_bytes"].max() < plain.per_rank["activations_bytes"].max()


_affine_total = checkpointed.affine_total


def test_stride_cuts_follow_the_checkpointing_pattern():
    model = SpikingMLP(16, (16,) * 12, 8, stepping="all_steps")
    repeats = find_repeats(model)
    assert (repeats.path, repeats.period, repeats.count) == ("net", 2, 12)
    assert stride_cuts(repeats, ()) == (2, 3, 4)
    every_2nd = [(f"net.{2 * j}", 2) for j in range(0, 12, 2)]
    assert stride_cuts(repeats, every_2nd) == (2, 4, 6)
    assert stride_cuts(repeats, [("net.14", 2)]) == (8, 9, 10)  # plain from block 8 on
    assert stride_cuts(repeats, [("net.18", 2)]) is None  # too few repeats after it to gain
    assert stride_cuts(repeats, [("net.1", 2)]) is None  # a region across two repeats: a cut would split it
    assert stride_cuts(repeats, None) is None  # time chunks
