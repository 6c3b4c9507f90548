"""Pipeline stages composed from runs cut to a few repeated blocks (estimator/profile/stage_repeats.py) equal the
whole stages: every estimate figure of the pp plans of a deep all-steps MLP, and the checks that refuse."""
import dataclasses

import pandas as pd
import pytest
import torch

import snn_explorer as se
from snn_explorer.core.levers import copy_without_levers
from snn_explorer.estimator import estimate
from snn_explorer.estimator.budget_fit import FIT_FEATURES
from snn_explorer.estimator.enumerate import enumerate_plans
from snn_explorer.estimator.memory import stage_memory
from snn_explorer.estimator.profile import stage_repeats
from snn_explorer.estimator.profile.profiling import measure_profile
from snn_explorer.estimator.profile.repeats import find_repeats
from snn_explorer.estimator.timing import pipeline_time
from snn_explorer.zoo import SpikingMLP

#: The operator-count model (a CPU-device twin of the H100), whose pipeline stages are composed from cut runs; a GPU
#: profile traces the stages on meta instead.
CPU_SIDE = dataclasses.replace(se.hardware_profile("H100-SXM"), device="cpu", kernel_model=False)

_composed = stage_repeats.composed_stages


def test_pp_stages_composed_from_cut_runs_equal_the_whole_stages(monkeypatch):
    torch.manual_seed(0)
    model, x = SpikingMLP(16, (16,) * 24, 8, stepping="all_steps"), torch.rand(3, 8, 16)
    full, fast = measure_profile(model, x, repeats=False), measure_profile(model, x)
    assert full.composed is None and fast.composed is not None
    composed = {stage_memory: [], pipeline_time: []}  # the stages' bytes, their operator counts

    for module, calls in composed.items():
        def spy(*args, calls=calls, **kwargs):
            out = _composed(*args, **kwargs)
            calls.append(out is not None)
            return out

        monkeypatch.setattr(module, "composed_stages", spy)
    analysis = se.analyze(model, example_input=x)
    plans = {copy_without_levers(p) for w in (2, 4) for p in enumerate_plans(analysis, world_size=w, batch_size=8,
                                                                               features=FIT_FEATURES) if p.uses_pp}
    assert len(plans) >= 3
    for plan in plans:
        want = estimate(model, plan, example_input=x, profile=full, hardware=CPU_SIDE)
        got = estimate(model, plan, example_input=x, profile=fast, hardware=CPU_SIDE)
        pd.testing.assert_frame_equal(got.per_rank, want.per_rank, check_exact=True)
        assert got.step_time_s == want.step_time_s, plan
        assert want.per_rank["activations_bytes"].min() > 0  # non-trivial: the stages keep activations
    # the stages of 6 blocks or more composed (stage work cached per size), shorter ones run in full
    assert sum(composed[stage_memory]) >= 2 and sum(composed[pipeline_time]) >= 1, composed
    stages = [[f"net.{i}" for i in range(24)], [f"net.{i}" for i in range(24, 48)], ["net.48"]]
    calls = len(composed[pipeline_time])
    sent = [w.sent_bytes for w in pipeline_time.stage_work(fast, stages, 4, 3)]
    assert composed[pipeline_time][calls:] == [True]  # these deep stages composed
    assert sent == [w.sent_bytes for w in pipeline_time.stage_work(full, stages, 4, 3)] and min(sent) > 0


def test_block_run_finds_whole_blocks_only():
    repeats = find_repeats(SpikingMLP(16, (16,) * 12, 8, stepping="all_steps"))  # net: 12 blocks of 2 children
    paths = [f"net.{i}" for i in range(3, 25)]  # block 1 split: its second child only, then blocks 2-11, the head
    assert stage_repeats.block_run(repeats, paths) == (1, 2, 10)
    assert stage_repeats.block_run(repeats, paths[:9]) is None  # 4 whole blocks: run in full


@pytest.mark.parametrize("peak_growth, composed", [(10, True), (0, False)])
def test_a_peak_growing_slower_than_what_the_blocks_keep_is_not_extended(peak_growth, composed):
    repeats = find_repeats(SpikingMLP(16, (16,) * 12, 8, stepping="all_steps"))
    stages = [[f"net.{i}" for i in range(24)], ["net.24"]]

    def run(cut):  # stand-in figures: (kept, peak); 10 B kept per block, the peak 100 B + peak_growth per block
        blocks = len(cut[0]) // 2
        return [(10 * blocks, 100 + peak_growth * blocks), (5, 7)]

    out = stage_repeats.composed_stages(repeats, stages, run, tuple, peaks={1: (0,)})
    assert out == ([(120, 100 + peak_growth * 12), (5, 7)] if composed else None)
