"""The rank tier's default hardware profile: a CPU-device twin of the datasheet profile the suite names.

The tests here compare estimates with what this machine's CPU ranks measure, so an estimate made without
``hardware=`` must predict what a CPU rank allocates (the operator-count model of the profile runs), not what a
GPU allocates (the GPU kernel model every ``cuda`` profile uses). The twin keeps the named profile's rates.
"""
import dataclasses
import os
import shutil
import tempfile

import pytest

from snn_explorer.estimator import hardware_profile
from snn_explorer.estimator.calibration.this_machine import ENV_VAR


@pytest.fixture(scope="session", autouse=True)
def cpu_side_default_hardware():
    """``$SNN_EXPLORER_HARDWARE`` pointed at a profile file of the CPU-device twin while the rank tier runs (the
    ranks it starts inherit it)."""
    named = os.environ.get(ENV_VAR, "A100-SXM-80GB")
    if named.endswith(".json"):  # a profile file chosen by the caller: left as it is
        yield named
        return
    twin = dataclasses.replace(hardware_profile(named), device="cpu", kernel_model=False,
                               name=f"{named} (CPU-device twin)")
    folder = tempfile.mkdtemp(prefix="snn-rank-tier-hw-")
    path = os.path.join(folder, "cpu_twin.json")
    twin.save(path)
    os.environ[ENV_VAR] = path
    try:
        yield path
    finally:
        os.environ[ENV_VAR] = named
        shutil.rmtree(folder, ignore_errors=True)
