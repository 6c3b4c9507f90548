"""FSDP2's CPU offload in the step-time estimate: the optimizer step on the host CPU at the profile's Adam rate, the
host copies over its link, and the refusals (no rate, an optimizer the rate does not describe, a pipeline plan).
Estimates only (no ranks): tiny all-steps MLPs, one shared profile per model."""
import dataclasses

import pytest
import torch

import snn_explorer as se
from snn_explorer.estimator import estimate
from snn_explorer.estimator.calibration.host_adam import this_host_adam_rate
from snn_explorer.estimator.memory.fsdp_offload import check_fsdp_offload_hardware
from snn_explorer.estimator.timing.hardware import HOST_ADAM_PARAMS_PER_S, hardware_profile
from snn_explorer.zoo.mlp import SpikingMLP

T, N = 4, 4
GATES = se.DistributedFeatureSet(allow_cpu_offload=True)
H100 = hardware_profile("H100-SXM")
#: The offload's costs are priced on the operator-count model (host-memory levers are not in the GPU trace yet, so
#: on a GPU profile an offloaded plan is estimated on it while its plain twin is traced): the H100's rates on that
#: model on both sides, so a difference isolates what offload adds.
H100_OPS = dataclasses.replace(H100, device="cpu", kernel_model=False)


def _offloaded(width: int):
    torch.manual_seed(0)
    model = SpikingMLP(in_features=width, hidden=(width,) * 2, num_classes=10, stepping="all_steps")
    plan = se.plan(analysis=se.analyze(model), objective="speed", topology={"dp": 2}, batch_size=N, mode="fsdp2",
                   features=GATES, options=se.PlanOptions(cpu_offload=True))
    return model, torch.rand(T, N, width), plan


def _shard_elements(model) -> int:
    """Elements of dp rank 0's shards: each parameter's dim 0 cut in 2, the remainder first (from the shapes)."""
    return sum(-(-p.shape[0] // 2) * p[0].numel() for p in model.parameters())


def _step(model, x, plan, **hardware) -> float:
    return estimate(model, plan, example_input=x, hardware=dataclasses.replace(H100_OPS, **hardware)).step_time_s


def test_the_host_optimizer_step_grows_with_the_parameters_at_the_host_rate():
    """Halving the host's Adam rate adds the rank's shard elements / rate, on two widths whose parameter counts
    differ (the host's step replaces the device's optimizer time, so the difference isolates it)."""
    added = {}
    for width in (32, 96):
        model, x, plan = _offloaded(width)
        rate = 1e6  # slow enough that the host step is a visible part of the step
        slow, fast = (_step(model, x, plan, host_adam_params_per_s=r) for r in (rate, 2 * rate))
        assert slow - fast == pytest.approx(_shard_elements(model) / (2 * rate), rel=1e-9), width
        added[width] = slow - fast
        plain = estimate(model, dataclasses.replace(plan, cpu_offload=False), example_input=x, hardware=H100_OPS)
        # on the documented rate the host's step (and the copies) cost more than the device's step: fit_budget's
        # pruning rests on no lever making a step faster
        assert _step(model, x, plan) > plain.step_time_s, width
    assert added[96] > 5 * added[32] > 0  # ~ 9x the elements in the hidden layers


def _offload_adds(model, x, plan, **hardware) -> float:
    """Step time ``plan`` offloaded adds to it without offload (host copies, host optimizer step for the device's)."""
    return _step(model, x, plan, **hardware) - _step(model, x, dataclasses.replace(plan, cpu_offload=False), **hardware)


def test_the_host_copies_cost_their_bytes_over_the_host_link_and_an_operator_each():
    """Each shard crosses the link once per all-gather (twice where resharded: every unit but the root) and each
    sharded gradient once back; halving the link's rate adds those bytes once more (float32, from the shapes).
    Each such copy is one operator: the time offload adds grows by (gathers + 1) * parameters * op_overhead_s
    from op_overhead_s = 0 (the host optimizer's operators replace the device's, the same count)."""
    model, x, plan = _offloaded(32)
    for memopt in (0, 1):
        p = dataclasses.replace(plan, memopt_level=memopt)
        link = H100.host_link_bytes_per_s
        slow, fast = (_step(model, x, p, host_link_bytes_per_s=r) for r in (link, 2 * link))
        gathers = 1 + memopt * 1  # SpikingMLP's parameters are all in units (the root holds none)
        want = (gathers + 1) * _shard_elements(model) * 4 / (2 * link * H100.efficiency)
        assert slow - fast == pytest.approx(want, rel=1e-9), memopt
        op = 1e-5
        ops = _offload_adds(model, x, p, op_overhead_s=op) - _offload_adds(model, x, p, op_overhead_s=0.0)
        assert ops == pytest.approx((gathers + 1) * len(list(model.parameters())) * op, rel=1e-9), memopt


def test_offload_refuses_a_profile_without_the_host_rate_and_other_optimizers():
    model, x, plan = _offloaded(32)
    with pytest.raises(ValueError, match="host_adam_params_per_s=None.*this_host_adam_rate"):
        estimate(model, plan, example_input=x, hardware=dataclasses.replace(H100, host_adam_params_per_s=None))
    with pytest.raises(ValueError, match=r"\('adam', 'adamw'\) only.*optimizer='sgd'"):
        estimate(model, plan, example_input=x, hardware=H100, optimizer="sgd")
    estimate(model, plan, example_input=x, hardware=H100, optimizer="adamw")
    assert H100.host_adam_params_per_s == HOST_ADAM_PARAMS_PER_S  # the documented rate, on every built-in GPU


def test_the_estimators_pipeline_refusal_holds_for_plans_built_around_plan_time():
    """plan() refuses cpu_offload with pipeline stages; the estimator's own check refuses a pipeline plan too."""
    model = SpikingMLP(in_features=8, hidden=(8, 8, 8), num_classes=4, stepping="all_steps")
    pp = se.plan(analysis=se.analyze(model), objective="speed", topology={"pp": 2}, batch_size=N, mode="pp")
    with pytest.raises(ValueError, match="not modelled for pipeline plans"):
        check_fsdp_offload_hardware(H100, pp, "adam")
    with pytest.raises(ValueError, match="needs .*not mode='pp'"):
        dataclasses.replace(pp, cpu_offload=True, experimental_features=GATES)


def test_this_hosts_adam_rate_is_a_positive_rate():
    rate = this_host_adam_rate(numel=1 << 12, tensors=2, repeats=1)
    assert 1e5 < rate < 1e12
    with pytest.raises(ValueError, match="numel"):
        this_host_adam_rate(numel=0)


def test_offload_combines_with_spike_compression():
    """FSDP2's CPU offload with spikes saved as bits (a lever pair fit_budget searches): spikes fire, so compression
    lowers the saved bytes; the pair's device peak is below each lever's alone and each lever's added time adds."""
    torch.manual_seed(0)
    model = SpikingMLP(in_features=32, hidden=(32, 32), num_classes=10, stepping="all_steps", init_gain=2.0)
    x = (torch.rand(8, N, 32) < 0.5).float()
    gates = se.DistributedFeatureSet(allow_cpu_offload=True, allow_spike_compression=True)
    plan = se.plan(analysis=se.analyze(model), objective="speed", topology={"dp": 2}, batch_size=N, mode="fsdp2",
                   features=gates)
    plain, off, packed, both = (estimate(model, dataclasses.replace(plan, **kw), example_input=x, hardware=H100_OPS)
                                for kw in ({}, dict(cpu_offload=True), dict(spike_compression=True),
                                           dict(cpu_offload=True, spike_compression=True)))
    saved = lambda e: int(e.per_rank["activations_bytes"].iloc[0])  # noqa: E731
    assert saved(packed) == saved(both) < saved(plain) == saved(off)
    assert both.peak_bytes < min(off.peak_bytes, packed.peak_bytes)
    assert both.step_time_s - plain.step_time_s == pytest.approx(
        (off.step_time_s - plain.step_time_s) + (packed.step_time_s - plain.step_time_s), rel=1e-9)


def test_fit_says_why_it_did_not_search_cpu_offload():
    """A profile with a host link but no host Adam rate: fit_budget searches no FSDP2 CPU offload and says why."""
    model, x, _ = _offloaded(16)
    hardware = dataclasses.replace(H100_OPS, host_adam_params_per_s=None)
    found = se.fit_budget(model, x, 10 ** 9, 2, hardware=hardware)
    assert "host_adam_params_per_s=None" in found.infeasible["+offload (FSDP2 CPU offload)"]
    assert not found.table["levers"].str.contains(r"\+offload(?!:)").any()
    assert "+offload (FSDP2 CPU offload)" not in se.fit_budget(model, x, 10 ** 9, 2, hardware=H100_OPS).infeasible
    on_gpu = se.fit_budget(model, x, 10 ** 9, 2, hardware=H100).infeasible  # not in the GPU trace yet: said so
    assert "GPU trace" in on_gpu["+offload (FSDP2 CPU offload)"] and "GPU trace" in on_gpu["+offload (activations to host)"]
