"""snn_explorer.compat: every private torch name of the core and the estimator, on the code paths
that use it, and the error a torch without one of them gets. CI runs this file, with
tests/ranks/test_compat_ranks.py (the names measure() uses on real ranks), on each torch of
``compat.TESTED_TORCH`` (scripts/test.sh, scripts/test_torch_next.sh)."""
import importlib.util
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest
import snntorch
import torch
import torch.distributed as dist
from torch import nn

import snn_explorer as se
from snn_explorer import compat, compat_dcp
from snn_explorer.core.model import reset_all
from snn_explorer.estimator.instruments.fsdp_events import record
from snn_explorer.estimator.instruments.meter import StorageMeter
from snn_explorer.estimator.instruments.recorder import CollectiveRecorder
from snn_explorer.estimator.instruments.storage import state_tensor_ids
from snn_explorer.estimator.memory.sharding import Param, step_bytes
from snn_explorer.estimator.profile.step import forward_loss
from snn_explorer.estimator.timing.collectives import ddp_buckets
from snn_explorer.zoo import build

ROOT = Path(__file__).resolve().parents[2]


def _version(text):
    return tuple(int(p) for p in re.match(r"(\d+)\.(\d+)", text).groups())


def test_installed_torch_is_in_the_tested_range_that_pyproject_declares():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"torch{compat.TESTED_TORCH}"' in pyproject
    low, high = re.fullmatch(r">=([\d.]+),<([\d.]+)", compat.TESTED_TORCH).groups()
    assert _version(low) <= _version(torch.__version__) < _version(high), torch.__version__


def _break_non_persistent_set(monkeypatch):
    init = nn.Module.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.__dict__["_non_persistent_buffers_set"] = []  # a list: no longer the set torch adds names to
    monkeypatch.setattr(nn.Module, "__init__", patched)


def _break_mem_tracker(monkeypatch):
    from torch.distributed._tools.mem_tracker import MemTracker

    init = MemTracker.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        del self._peak_mem
    monkeypatch.setattr(MemTracker, "__init__", patched)


def _break_functional_collectives(monkeypatch):
    functional = types.SimpleNamespace(all_reduce=torch.ops._c10d_functional.all_reduce)  # no all_gather
    monkeypatch.setattr(torch, "ops", types.SimpleNamespace(c10d=torch.ops.c10d, _c10d_functional=functional))


#: Each case breaks one name (or its shape) as a torch release might; compat, imported afresh (or
#: asked for the MemTracker, checked on first use), must name it, its flaw and torch's version.
BREAK = {
    "torch.utils._pytree.tree_leaves": lambda mp: mp.delattr(torch.utils._pytree, "tree_leaves"),
    "torch.utils._pytree.tree_map": lambda mp: mp.setattr(torch.utils._pytree, "tree_map", lambda f, t: t),
    "torch.utils._python_dispatch.TorchDispatchMode":
        lambda mp: mp.delattr(torch.utils._python_dispatch, "TorchDispatchMode"),
    "torch.utils._python_dispatch.is_traceable_wrapper_subclass_type":
        lambda mp: mp.setattr(torch.utils._python_dispatch, "is_traceable_wrapper_subclass_type", lambda t: None),
    "torch.autograd.Variable._execution_engine.queue_callback":
        lambda mp: mp.delattr(torch.autograd.Variable, "_execution_engine"),
    "torch.nn.Module._non_persistent_buffers_set": _break_non_persistent_set,
    "torch.distributed._compute_bucket_assignment_by_size":
        lambda mp: mp.setattr(dist, "_compute_bucket_assignment_by_size", lambda *a: ([[0], [1]], [1])),
    "torch.distributed._DEFAULT_FIRST_BUCKET_BYTES": lambda mp: mp.delattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES"),
    "torch.nn.parallel.DistributedDataParallel._get_ddp_logging_data":
        lambda mp: mp.delattr(nn.parallel.DistributedDataParallel, "_get_ddp_logging_data"),
    "torch.ops.c10d._allgather_base_":
        lambda mp: mp.setattr(torch, "ops", types.SimpleNamespace(c10d=types.SimpleNamespace())),
    "torch.distributed._tools.mem_tracker.MemTracker._peak_mem": _break_mem_tracker,
    "torch.ops._c10d_functional.all_gather_into_tensor": _break_functional_collectives,
}


def _fresh_compat():
    """snn_explorer/compat.py executed anew as its own module (the package keeps its compat)."""
    spec = importlib.util.spec_from_file_location("compat_probe", compat.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.mem_tracker_class()
    return module


def test_fresh_compat_passes_on_this_torch():
    assert _fresh_compat().TESTED_TORCH == compat.TESTED_TORCH


@pytest.mark.parametrize("name", list(BREAK))
def test_a_missing_or_changed_name_raises_naming_it_and_the_torch_version(name, monkeypatch):
    BREAK[name](monkeypatch)
    with pytest.raises(ImportError) as err:
        _fresh_compat()
    assert type(err.value).__name__ == "TorchCompatError"
    message = str(err.value)
    assert name in message and f"torch {torch.__version__}" in message and compat.TESTED_TORCH in message, message


def test_a_fresh_interpreter_fails_at_import_naming_the_name():
    code = "import torch.distributed as d; del d._compute_bucket_assignment_by_size; import snn_explorer.estimator"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("snn_explorer.compat.TorchCompatError: ") and "_compute_bucket_assignment_by_size" in last
    assert f"torch {torch.__version__}" in last, last


def test_require_names_what_is_missing():
    with pytest.raises(compat.TorchCompatError, match=r"torch\.nn\.no_such_name.*it is missing") as err:
        compat._require("torch.nn", "no_such_name")
    assert f"torch {torch.__version__}" in str(err.value)
    with pytest.raises(compat.TorchCompatError, match="no_such_module does not import"):
        compat._require("torch.no_such_module", "x")


# --- the names on the code paths that use them ------------------------------------------------

def test_fsdp_record_marks_forward_backward_and_its_end():
    """fsdp_timeline: pytree over hook arguments, and the end of the backward queued on autograd's engine."""
    zoo = build("mlp")
    units = tuple(n for n, m in zoo.model.named_modules() if isinstance(m, nn.Linear))
    assert len(units) == 3
    meter = StorageMeter()
    meter.track(list(zoo.model.parameters()) + [zoo.example_input])
    with meter, record(zoo.model, units, meter) as log:
        forward_loss(zoo.model, zoo.example_input, zoo.labels).backward()
    kinds = [k for k, *_ in log.events]
    assert kinds.count("end_backward") == 1 and kinds[-1] == "end_backward", kinds
    marks = [(k, w) for k, w, *_ in log.events]
    for unit in units:
        assert ("pre_forward", unit) in marks and ("pre_backward", unit) in marks, unit
    for unit in units[1:]:  # their inputs need a gradient: a post-backward through pytree-mapped arguments
        assert ("post_backward", unit) in marks, unit


def test_storage_meter_counts_allocations_and_lets_dtensor_desugar(one_rank):
    from torch.distributed.tensor import DeviceMesh, Replicate, distribute_tensor

    meter = StorageMeter()
    with meter:
        big = torch.ones(1000)
        del big
    assert meter.peak == 4000 and meter.current == 0
    dt = distribute_tensor(torch.ones(256), DeviceMesh("cpu", [0]), [Replicate()])
    with StorageMeter() as meter:
        out = dt * 2  # a DTensor op: the meter counts the local multiply's output
    assert isinstance(out, torch.distributed.tensor.DTensor) and bool((out.to_local() == 2).all())
    assert meter.peak >= 1024 and meter.current >= 1024


def test_neuron_state_is_the_non_persistent_buffers():
    lif = snntorch.Leaky(beta=0.9, init_hidden=True)
    model = nn.Sequential(nn.Linear(4, 4), lif)
    model(torch.ones(2, 4) * 5)
    assert lif.mem.abs().sum() > 0
    assert reset_all(model) == 1
    assert lif.mem.abs().sum() == 0
    assert "mem" in compat.non_persistent_buffer_names(lif)
    assert id(lif.mem) in state_tensor_ids(model)
    assert se.analyze(model).per_feature_neuron_names == ()  # its 8-element mem is state, not a per-feature beta
    per_feature = nn.Sequential(nn.Linear(4, 4), snntorch.Leaky(beta=torch.full((4,), 0.9), init_hidden=True))
    per_feature(torch.ones(2, 4))
    assert se.analyze(per_feature).per_feature_neuron_names == ("1",)


def test_adam_step_counter_bytes_are_the_optimizers_own():
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    opt = torch.optim.AdamW([p])
    opt.step()
    assert step_bytes("adamw") == opt.state[p]["step"].element_size() > 0
    assert step_bytes("sgd") == 0


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo group in this process (DDP, c10d ops and DTensor need one)."""
    if dist.is_initialized():  # left by an earlier test: usable only if it is a one-rank group
        assert dist.get_world_size() == 1, f"this process already has a {dist.get_world_size()}-rank group"
        yield dist.group.WORLD
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def test_ddp_buckets_are_those_ddp_hands_its_comm_hook(one_rank):
    """The estimator's bucket assignment against DDP's own buckets, after DDP rebuilt them in
    the order the gradients became ready (3 MiB of gradients: several buckets)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 600), nn.Tanh(), nn.Linear(600, 500), nn.Tanh(), nn.Linear(500, 300))
    ready = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, n=name: ready.append(n))
    ddp = nn.parallel.DistributedDataParallel(model)
    hooked = []

    def hook(group, bucket):
        hooked.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return allreduce_hook(group, bucket)
    ddp.register_comm_hook(one_rank, hook)
    for _ in range(3):
        del ready[:], hooked[:]
        ddp(torch.randn(2, 300)).square().mean().backward()
    params = [Param(n, tuple(p.shape), 4) for n, p in model.named_parameters()]
    assert len(hooked) > 1
    assert ddp_buckets(params, ready) == hooked
    assert compat.ddp_rebuilt_bucket_sizes(ddp) == hooked


def test_recorder_sees_the_base_gather_and_scatter_ops(one_rank):
    recorder = CollectiveRecorder()
    with recorder:
        out = torch.empty(8)
        dist.all_gather_into_tensor(out, torch.ones(8))
        dist.reduce_scatter_tensor(torch.empty(8), torch.ones(8))
    assert [e[2:] for e in recorder.events] == [("all_gather", "forward", 32), ("reduce_scatter", "forward", 32)]
    assert {r["mesh_dim"] for r in recorder.table({"dp": one_rank})} == {"dp"}
    assert compat.resolve_process_group(one_rank.group_name) is one_rank  # a group known by name only


_FAKE_GROUP_PROBE = """
import torch, torch.distributed as dist
from snn_explorer import compat_fake
from snn_explorer.estimator.instruments.recorder import CollectiveRecorder
with compat_fake.fake_process_group(3, 512):
    print(dist.get_rank(), dist.get_world_size())
    recorder = CollectiveRecorder()
    with recorder:
        dist.all_gather_into_tensor(torch.empty(512 * 4), torch.ones(4))
    print([e[2:] for e in recorder.events])
print(dist.is_initialized())
"""


def test_fake_process_group_plays_one_rank_of_any_world_and_records_its_collectives():
    """In a fresh interpreter: this module's one-rank gloo group is the default group of this one."""
    out = subprocess.run([sys.executable, "-c", _FAKE_GROUP_PROBE], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:3] == ["3 512", "[('all_gather', 'forward', 8192)]", "False"], out.stdout


def test_mem_tracker_peak_restarts_from_the_current_memory():
    tracker = compat.mem_tracker_class()()
    cpu = torch.device("cpu")
    base = torch.ones(4)
    tracker.track_external(base)
    with tracker:
        big = torch.ones(1 << 18)
        del big
        before = tracker.get_tracker_snapshot("peak")[cpu]["Total"]
        compat.restart_mem_tracker_peak(tracker, cpu)
        small = torch.ones(16)
    after = tracker.get_tracker_snapshot("peak")[cpu]["Total"]
    assert before >= 1 << 20 > after >= small.numel() * 4


def test_pipeline_compute_order_is_torchs_for_every_schedule():
    """Each schedule's per-rank order, read from torch: every rank runs a forward and a backward (or
    input and weight backwards) of each of its stages for every micro-batch, 1F1B in its known order."""
    from snn_explorer.core.planning import SCHEDULES

    for name, schedule in SCHEDULES.items():
        virtual = 2 if schedule.multi_stage else 1
        orders = schedule.rank_actions(2, 4, virtual)
        for rank, actions in orders.items():
            kinds = ("F", "I", "W") if schedule.splits_backward else ("F", "B")
            want = sorted((k, s, m) for k in kinds for s in schedule.rank_stages(rank, 2, virtual) for m in range(4))
            assert sorted(actions) == want, (name, rank)
    one = SCHEDULES["1f1b"].rank_actions(2, 4)
    assert one[1] == [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1), ("F", 1, 2), ("B", 1, 2), ("F", 1, 3),
                      ("B", 1, 3)]


def test_is_view_tells_a_view_from_its_copy():
    from snn_explorer import compat

    out = nn.Linear(5, 2)(torch.rand(3, 4, 5))  # a Linear over [T, N, F] returns a view of a 2-D result
    assert compat.is_view(out) and not compat.is_view(out.clone()) and not compat.is_view(torch.rand(2))


def test_uncompiled_returns_the_module_inside_torch_compile():
    from snn_explorer import compat

    model = torch.nn.Linear(2, 2)
    compiled = torch.compile(model)
    assert compat.uncompiled(compiled) is model and compat.uncompiled(model) is model


# --- checkpoint metadata read without running code (issue 35) -----------------------------------
class _RunsCommand:
    """Unpickled with plain pickle, this creates ``marker`` (as a shell command would)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def _dcp_folder(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "dcp"
    state = {"w": torch.randn(3, 4), "d": torch.zeros(2, dtype=torch.float64), "rng": torch.get_rng_state()}
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return folder, state


def test_dcp_metadata_of_this_torch_reads_through_the_restricted_unpickler(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder, state = _dcp_folder(tmp_path)
    metadata = compat_dcp.read_dcp_metadata(folder / ".metadata")
    assert {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items()} == \
        {k: tuple(v.shape) for k, v in state.items()}
    assert metadata.state_dict_metadata["d"].properties.dtype == torch.float64
    into = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(into, storage_reader=compat_dcp.SafeFileSystemReader(str(folder)), no_dist=True)
    assert all(torch.equal(into[k], state[k]) for k in state)


def test_a_metadata_pickle_naming_a_command_is_refused_before_it_runs(tmp_path):
    import pickle

    marker = tmp_path / "ran"
    evil = tmp_path / "evil.metadata"
    evil.write_bytes(pickle.dumps(_RunsCommand(marker)))
    with pytest.raises(compat_dcp.UnsafeCheckpointError, match=r"names posix\.system, which is not a class of DCP"):
        compat_dcp.read_dcp_metadata(evil)
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError):  # the error is an UnpicklingError for callers that catch those
        compat_dcp.read_dcp_metadata(evil)


def test_metadata_with_bytes_entries_or_foreign_storage_is_refused(tmp_path):
    import dataclasses
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    folder, _ = _dcp_folder(tmp_path)
    metadata = compat_dcp.read_dcp_metadata(folder / ".metadata")
    bytes_entry = dataclasses.replace(metadata, state_dict_metadata={**metadata.state_dict_metadata,
                                                                     "w": BytesStorageMetadata()})
    (tmp_path / "bytes.metadata").write_bytes(pickle.dumps(bytes_entry))
    with pytest.raises(compat_dcp.UnsafeCheckpointError, match="BytesStorageMetadata"):
        compat_dcp.read_dcp_metadata(tmp_path / "bytes.metadata")
    index, info = next(iter(metadata.storage_data.items()))
    away = dataclasses.replace(metadata, storage_data={index: dataclasses.replace(info, relative_path="../x.distcp")})
    (tmp_path / "away.metadata").write_bytes(pickle.dumps(away))
    with pytest.raises(compat_dcp.UnsafeCheckpointError, match=r"points at storage '\.\./x\.distcp', not a \.distcp file"):
        compat_dcp.read_dcp_metadata(tmp_path / "away.metadata")
