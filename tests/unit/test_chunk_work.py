"""The work of time chunks of any size k up to T (estimator/timing/chunk_work.py), though the profile counts steps of
T = 2 and 3 only: on a stand-in of two Linear layers, the backward's FLOPs equal the hand count (each step's own
backward and its recompute, plus one replayed forward per step but the first of each chunk), every figure's extra
over the plain step equals steps counted at the plan's own T, and the estimated step time grows with k, also on
the host a profile was calibrated on (whose timing correction is the plain step's)."""
import dataclasses
import math
import socket

import pytest
import torch

import snn_explorer as se
from snn_explorer.core.levers import chunked, copy_without_levers
from snn_explorer.core.model import detached_copy
from snn_explorer.core.parallelize import checkpoint_time_chunks
from snn_explorer.estimator import hardware_profile
from snn_explorer.estimator.profile.checkpointed import levered_profile, unlevered
from snn_explorer.estimator.profile.profiling import model_profile
from snn_explorer.estimator.profile.step import batch_slice
from snn_explorer.estimator.timing.chunk_work import chunk_counts
from snn_explorer.estimator.timing.compute_work import counted_pass, rank_work
from snn_explorer.zoo.mlp import SpikingMLP

IN, HIDDEN, CLASSES, N = 6, 8, 3, 4
SIZES = ((8, (1, 2, 3, 4, 8)), (7, (2, 3, 4, 7)))  # (T, chunk sizes): T = 7 leaves chunks of 3 and of 1


@pytest.fixture(scope="module")
def stand_in():
    torch.manual_seed(0)
    model = SpikingMLP(IN, (HIDDEN,), CLASSES, init_gain=3.0)
    x = torch.bernoulli(torch.full((8, N, IN), 0.5))
    y = torch.randint(0, CLASSES, (N,))
    base = copy_without_levers(se.plan(analysis=se.analyze(model), objective="speed", topology={"dp": 1},
                                       batch_size=N, mode="dp",
                                       features=se.DistributedFeatureSet(allow_activation_checkpointing=True)))
    return model, x, y, base, model_profile(model, x, y)


def _counted(model, x, y, t, every=None):
    """FLOPs, bytes and operators of a step at ``t`` steps counted on the model itself (chunks of ``every``)."""
    copy_ = detached_copy(model)
    if every is not None:
        checkpoint_time_chunks(copy_, "net", every)
    xt, yt = batch_slice(x, y, N, t)
    forward, backward = counted_pass(copy_, xt, yt)
    return [float(v) for v in forward + backward]


def _work(work, t):
    return [getattr(phase, f)(N, t) for phase in (work.forward, work.backward)
            for f in ("flops", "flop_bytes", "other_bytes", "ops")]


def test_backward_flops_of_every_chunk_size_are_the_hand_count(stand_in):
    model, x, y, base, profile = stand_in
    xt, _ = batch_slice(x, y, N, 8)
    with torch.no_grad():
        assert 0 < (model.net[:2](xt[0]) > 0).float().mean() < 1  # the neurons fire (recompute replays spikes)
    forward = 2 * N * (IN * HIDDEN + HIDDEN * CLASSES)  # matrix products of one step's forward
    backward = 2 * N * IN * HIDDEN + 2 * 2 * N * HIDDEN * CLASSES  # weight gradients; input gradient of the head
    # a step's recompute stops at the last tensor its backward needs (torch's non-reentrant checkpoint): the head's
    # input, so the head's product is not run again; a replayed step runs the whole forward
    recompute = 2 * N * IN * HIDDEN
    for t, sizes in SIZES:
        for k in sizes:
            chunks = math.ceil(t / k)
            work = rank_work(levered_profile(profile, chunked(base, "net", k)), None, 1, "sgd")
            assert work.backward.flops(N, t) == t * backward + t * recompute + (t - chunks) * forward, (t, k)
            assert work.forward.flops(N, t) == t * forward


def test_extra_work_of_chunks_equals_steps_counted_at_the_plans_own_size(stand_in):
    """Every figure (FLOPs, bytes, operators) of the chunked step less the plain step's, at T = 8 and 7: from the
    profile's runs at T <= 4 against a step counted at T itself."""
    model, x, y, base, profile = stand_in
    plain = rank_work(profile, None, 1, "sgd")
    for t, sizes in SIZES:
        counted_plain = _counted(model, x, y, t)
        for k in sizes:
            work = rank_work(levered_profile(profile, chunked(base, "net", k)), None, 1, "sgd")
            extra = [a - b for a, b in zip(_work(work, t), _work(plain, t))]
            counted = [a - b for a, b in zip(_counted(model, x, y, t, k), counted_plain)]
            assert extra == pytest.approx(counted, rel=1e-9, abs=1e-6), (t, k)


def test_chunk_counts():
    assert [chunk_counts(t, 4) for t in (1, 2, 3, 4, 5, 6, 8, 9)] == \
        [(0, 1), (1, 0), (1, 0), (1, 0), (1, 1), (2, 0), (2, 0), (2, 1)]
    assert chunk_counts(5, 1) == (0, 5) and chunk_counts(7, 2) == (3, 1)


def test_estimated_step_time_grows_with_the_chunk_size(stand_in):
    model, x, y, base, _ = stand_in
    estimate_of = se.plan_estimator(model, x, y, hardware="H100-SXM")
    times = [estimate_of(chunked(base, "net", k)).step_time_s for k in (1, 2, 4, 8)]
    assert times == sorted(times) and times[1] < times[2] < times[3], times  # replays: 0, 4, 6, 7 steps


def test_on_the_calibrated_host_the_recompute_is_not_timed_away(stand_in):
    """On the host a profile was calibrated on, the measured / modelled ratio comes from the step without levers
    (timed once, kept on the plain profile), so a chunked plan keeps its recompute: slower than the plain plan, and
    growing with k. (Read from its own profile, the plain model's time over the chunked work gave every size the
    plain step's time.)"""
    model, x, y, base, profile = stand_in
    here = dataclasses.replace(hardware_profile("H100-SXM"), name="this host", device="cpu", host=socket.gethostname())
    estimate_of = se.plan_estimator(model, x, y, hardware=here)
    times = [estimate_of(base).step_time_s] + [estimate_of(chunked(base, "net", k)).step_time_s for k in (1, 2, 8)]
    assert times == sorted(times) and times[0] < times[1] < times[2] < times[3], times
    chunked_profile = levered_profile(profile, chunked(base, "net", 8))
    assert unlevered(chunked_profile) is profile and "_step_correction" not in chunked_profile.__dict__
