"""Activation offload (issue 33): plan-time and apply-time refusals, the estimate's host hooks restore every saved
value bit for bit, the offloaded step's device memory as torch's MemTracker counts it, and fit choosing it.

The lever itself copies to pinned host memory from CUDA ranks; this machine has no CUDA, and on CPU ranks apply
refuses it (the saved tensors are in host memory already), so no rank here runs it.
"""
import dataclasses

import pytest
import torch
from models import adam_steps_recording_spikes

import snn_explorer as se
from snn_explorer.compat import mem_tracker_class
from snn_explorer.core.levers import check_activation_offload_device, offload_hooks
from snn_explorer.core.model import detached_copy
from snn_explorer.estimator import estimate, model_profile
from snn_explorer.estimator.memory.activation_offload import (
    _to_simulated_device,
    _to_simulated_host,
    offload_seconds,
    offloaded_profile,
)
from snn_explorer.estimator.memory.step_peak import dynamic_peak
from snn_explorer.estimator.profile.step import forward_loss
from snn_explorer.estimator.timing.hardware import hardware_profile
from snn_explorer.zoo import build

GATES = se.DistributedFeatureSet(allow_cpu_offload=True, allow_activation_checkpointing=True,
                                 allow_spike_compression=True)


def _plan(zoo, mode="fsdp2", topology=None, features=GATES, **levers):
    base = se.plan(analysis=se.analyze(zoo.model), objective="speed", topology=topology or {"dp": 2},
                   batch_size=zoo.batch_size, mode=mode, features=features, options=se.PlanOptions(activation_checkpointing="none"))
    return dataclasses.replace(base, **levers)


def _simulated(model, counter=None):
    counter = counter if counter is not None else [0, 0.0]
    offload_hooks(model, lambda t: _to_simulated_host(t, counter), _to_simulated_device)
    return counter


@pytest.mark.parametrize("levers, error, match", [
    (dict(activation_offload=1), TypeError, "activation_offload must be a bool"),
    (dict(activation_offload=True, spike_compression=True), ValueError, "not combined with spike_compression"),
    (dict(activation_offload=True, activation_checkpointing="blocks"), ValueError,
     "not combined with activation_checkpointing"),
])
def test_plan_time_refusals_name_the_values(levers, error, match):
    zoo = build("mlp_all_steps")
    with pytest.raises(error, match=match):
        _plan(zoo, **levers)
    with pytest.raises(ValueError, match="allow_cpu_offload=True"):
        _plan(zoo, features=se.DistributedFeatureSet(), activation_offload=True)
    with pytest.raises(ValueError, match=r"tensor parallelism \(tp > 1\)"):
        _plan(build("mlp"), mode="tp", topology={"tp": 2}, activation_offload=True)


def test_apply_refuses_cpu_ranks_and_the_estimate_hardware_without_a_host_link():
    zoo = build("vgg")
    plan = _plan(zoo, activation_offload=True)
    check_activation_offload_device(plan, "cuda")  # where it runs
    with pytest.raises(ValueError, match="device_type='cpu'.*nothing to offload"):
        check_activation_offload_device(plan, "cpu")
    no_link = dataclasses.replace(hardware_profile("H100-SXM"), host_link_bytes_per_s=None)
    with pytest.raises(ValueError, match="host_link_bytes_per_s=None"):
        estimate(zoo.model, plan, example_input=zoo.example_input, labels=zoo.labels, hardware=no_link)
    # a GPU profile: not in its GPU trace yet, the plan is estimated on the operator-count model, and says so
    said = estimate(zoo.model, plan, example_input=zoo.example_input, labels=zoo.labels, hardware="RTX-4090-PCIe-noP2P")
    assert "not in the GPU trace" in said.verdict


def test_host_copies_restore_training_bit_for_bit_with_spikes_firing():
    """Three Adam steps of vgg (float64) with every saved tensor through the estimate's host copy equal
    three without, to 0 difference; spikes fire (mean rate strictly between 0 and 1) and the loss moves."""
    zoo = build("vgg")
    runs = []
    for offload in (False, True):
        model = detached_copy(zoo.model).double()
        counter = _simulated(model) if offload else None
        runs.append((*adam_steps_recording_spikes(model, zoo), counter))
    (plain_losses, plain_params, rates, _), (losses, params, _, counter) = runs
    assert counter[0] > 100 and counter[1] > 0  # the saved tensors really went through the host copy
    assert 0 < sum(rates) / len(rates) < 1 and max(rates) > 0 and plain_losses[0] != plain_losses[-1]
    assert losses == plain_losses
    assert all(torch.equal(params[n], plain_params[n]) for n in plain_params)


@pytest.mark.parametrize("name", ["vgg"])
def test_offloaded_step_memory_as_torch_memtracker_counts_it(name):
    """The estimate's phases of the offloaded step (the profile's replay) against torch's MemTracker on the same
    step (a forward + backward of the rank's share with the host hooks): within 5 %, and well below the plain step."""
    zoo = build(name)
    n = zoo.batch_size // 2
    x, y = zoo.example_input[:, :n], zoo.labels[:n]
    model = detached_copy(zoo.model)
    _simulated(model)
    forward_loss(model, x, y).backward()  # warm-up: neuron state takes its size
    model.zero_grad(set_to_none=True)
    tracker = mem_tracker_class()()
    tracker.track_external(model, x)
    with tracker:
        entry = tracker.get_tracker_snapshot()[x.device]["Total"]
        forward_loss(model, x, y).backward()
    theirs = tracker.get_tracker_snapshot("peak")[x.device]["Total"] - entry
    profile = model_profile(zoo.model, zoo.example_input, zoo.labels)
    grads = sum(p.numel() * p.element_size() for p in zoo.model.parameters())  # the backward's phase is beside them
    fwd, bwd = dynamic_peak(profile, n, zoo.time_steps)[:2]
    plain = max(fwd, bwd + grads)
    fwd, bwd = dynamic_peak(offloaded_profile(profile), n, zoo.time_steps)[:2]
    ours = max(fwd, bwd + grads)
    assert abs(ours - theirs) <= 0.05 * theirs, (name, ours, theirs)
    assert ours < 0.6 * plain, (name, ours, plain)


def test_estimate_states_the_copy_time_and_fit_chooses_offload_only_by_estimate():
    # the H100's rates on the operator-count model, which prices offload (not in the GPU trace yet), on both sides
    h100 = dataclasses.replace(hardware_profile("H100-SXM"), device="cpu", kernel_model=False)
    zoo = build("vgg")
    plain_plan = _plan(zoo)
    plan = dataclasses.replace(plain_plan, activation_offload=True)
    plain, offloaded = (estimate(zoo.model, p, example_input=zoo.example_input, labels=zoo.labels, hardware=h100)
                        for p in (plain_plan, plan))
    assert offloaded.peak_bytes < 0.6 * plain.peak_bytes
    profile = offloaded_profile(model_profile(zoo.model, zoo.example_input, zoo.labels))
    copies = profile.copies(plan.per_rank_batch, zoo.time_steps)
    assert copies[0] > 0 and copies[1] > 0
    assert offloaded.step_time_s == pytest.approx(plain.step_time_s + offload_seconds(copies, offloaded.hardware))
    budget = int(plain.peak_bytes * 0.6)  # only offload fits it (the gate of the other levers closed: a faster test)
    gate = se.DistributedFeatureSet(allow_cpu_offload=True)
    found = se.fit_budget(zoo.model, zoo.example_input, budget, 2, labels=zoo.labels, hardware=h100,
                          features=gate)
    assert found.plan.activation_offload and found.estimate.peak_bytes <= budget
    assert found.table.iloc[0]["lever_time_s"] > 0  # its time cost is stated
    assert not se.fit_budget(zoo.model, zoo.example_input, plain.peak_bytes, 2, labels=zoo.labels,
                             hardware=h100, features=gate).plan.activation_offload  # not needed: not chosen
    no_link = dataclasses.replace(h100, host_link_bytes_per_s=None)
    with pytest.raises(ValueError, match="no plan .* fits"):  # not offered where it cannot be estimated
        se.fit_budget(zoo.model, zoo.example_input, budget, 2, labels=zoo.labels, hardware=no_link, features=gate)
