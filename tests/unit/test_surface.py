"""The public surface: one device rule, a clear error for a foreign DeviceMesh, verbs named for what they do,
two names for the two backends."""
from __future__ import annotations

import datetime
import re
import tempfile

import pytest
import torch
import torch.distributed as dist
from models import MLP
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import snn_explorer as se
from snn_explorer.core.parallelize import comm_backend_for, default_device_type


@pytest.fixture
def one_rank_group():
    """A private 1-rank gloo process group (skipped when the test process already has one)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        try:
            yield
        finally:
            dist.destroy_process_group()


def dp1_plan():
    """A distributed (mesh-building) plan on one rank."""
    return se.SNNDistributedPlan(mode="dp", objective="speed", topology={"dp": 1}, batch_size=2)


def test_default_device_without_a_group_is_cuda_when_available():
    assert default_device_type() == ("cuda" if torch.cuda.is_available() else "cpu")
    assert comm_backend_for("cpu") == "gloo"
    with pytest.raises(ValueError, match="'tpu'"):
        comm_backend_for("tpu")


def test_apply_and_explorer_apply_share_the_default(one_rank_group):
    """Under a gloo group both pick the CPU without being told (formerly apply: cuda, Explorer: cpu)."""
    assert default_device_type() == "cpu"
    runtime = se.apply(model=MLP(), plan=dp1_plan())
    assert runtime.device == torch.device("cpu") and runtime.mesh.device_type == "cpu"
    ex = se.Explorer(MLP())
    runtime = ex.apply(dp1_plan())
    assert runtime.device == torch.device("cpu") and runtime.mesh.device_type == "cpu"


def test_apply_with_a_mesh_without_dim_names_names_what_the_plan_needs(one_rank_group):
    mesh = DeviceMesh("cpu", torch.arange(1))
    assert mesh.mesh_dim_names is None
    with pytest.raises(ValueError) as info:
        se.apply(model=MLP(), plan=dp1_plan(), device_mesh=mesh)
    message = str(info.value)
    assert "no mesh_dim_names" in message and "mesh_dim_names=('dp',)" in message, message
    assert "shape (1,)" in message and "Cannot slice" not in message


def test_apply_with_other_dim_names_names_both(one_rank_group):
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("data",))
    with pytest.raises(ValueError, match=re.escape("mesh_dim_names=('data',)") + ".*" +
                       re.escape("needs mesh_dim_names=('dp',)")):
        se.apply(model=MLP(), plan=dp1_plan(), device_mesh=mesh)
    good = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    assert se.apply(model=MLP(), plan=dp1_plan(), device_mesh=good).mesh is good


def test_apply_refuses_a_mesh_that_is_not_a_device_mesh(one_rank_group):
    with pytest.raises(TypeError, match="got tuple"):
        se.apply(model=MLP(), plan=dp1_plan(), device_type="cpu", device_mesh=(1,))


def test_explorer_add_plan_adds_make_plan_does_not():
    ex = se.Explorer(MLP(), batch_size=4)
    made = ex.make_plan(topology={"dp": 2})
    assert ex.plans == []
    added = ex.add_plan(topology={"dp": 2})
    assert added == made and ex.plans == [made]
    pure = se.plan(analysis=ex.analysis, objective="speed", topology={"dp": 2}, batch_size=4)
    assert pure == made and ex.plans == [made]  # se.plan is pure


def test_explorer_plan_is_a_deprecated_alias_of_add_plan():
    ex = se.Explorer(MLP(), batch_size=4)
    with pytest.warns(DeprecationWarning, match="add_plan"):
        p = ex.plan(topology={"dp": 2})
    assert ex.plans == [p]


def test_neuron_backend_and_comm_backend_are_two_names():
    ex = se.Explorer(MLP(), batch_size=4, neuron_backend="inductor")
    assert ex.make_plan(topology={"dp": 2}).neuron_backend == "inductor"
    with pytest.warns(DeprecationWarning, match="neuron_backend"):
        old = se.Explorer(MLP(), batch_size=4, backend="inductor")
    assert old.neuron_backend == "inductor"
    with pytest.raises(ValueError, match=r"neuron_backend='gloo'.*neuron compute backend"):
        se.Explorer(MLP(), neuron_backend="gloo")
    with pytest.raises(ValueError, match=r"comm_backend='torch'"):
        se.launch(print, nprocs=1, comm_backend="torch")
    with pytest.warns(DeprecationWarning, match="comm_backend"), pytest.raises(ValueError, match="'mpi'"):
        se.launch(print, nprocs=1, backend="mpi")
