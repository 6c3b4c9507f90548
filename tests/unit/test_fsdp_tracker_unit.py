"""FSDP2's CPU offload (CPUOffloadPolicy, CUDA ranks only): refused where it cannot run or be estimated.
(The estimated peak against torch's FSDPMemTracker and measure() on 2 gloo ranks, fsdp2 with activation
checkpointing and the offloaded bounds: tests/ranks/test_fsdp_tracker.py.)"""
import dataclasses

import pytest
from test_fsdp_tracker import _model_and_input, _plans

from snn_explorer.core.levers import check_cpu_offload_device
from snn_explorer.estimator import estimate
from snn_explorer.estimator.timing.hardware import hardware_profile

T, N, WIDTH = 4, 4, 512


def test_cpu_offload_refusals():
    """Refused where it cannot run or be estimated (its step time: tests/unit/test_fsdp_offload_time.py)."""
    model, x = _model_and_input()
    hardware = hardware_profile("H100-SXM")
    plan = _plans(model)[0]
    offloaded = dataclasses.replace(plan, cpu_offload=True)
    with pytest.raises(ValueError, match="host_link_bytes_per_s=None.*nothing to offload"):
        estimate(model, offloaded, example_input=x, hardware=dataclasses.replace(hardware, host_link_bytes_per_s=None))
    said = estimate(model, offloaded, example_input=x, hardware="RTX-4090-PCIe-noP2P").verdict
    assert "not in the GPU trace" in said  # estimated, and said how
    with pytest.raises(ValueError, match="device_type='cpu'.*nothing to offload"):
        check_cpu_offload_device(offloaded, "cpu")
    check_cpu_offload_device(offloaded, "cuda")
