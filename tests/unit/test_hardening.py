"""Issue 19 hardening: exported jobs others cannot subvert, inputs refused early, scale, side effects.
(The tests on gloo ranks: tests/ranks/test_hardening_ranks.py.)"""
from __future__ import annotations

import os
import pickle
import stat

import pytest

from snn_explorer import analyze, plan
from snn_explorer.launcher import ExportOptions, export_job, split_keywords
from snn_explorer.launcher.job import main as job_main
from snn_explorer.zoo import build


@pytest.fixture(scope="module")
def mlp():
    zoo = build("mlp")
    p = plan(analysis=analyze(zoo.model), objective="speed", topology={"dp": 2}, backend="torch", batch_size=8)
    return zoo, p


def step(runtime, step, batch, state):
    return 0.0


def _export(mlp, path, **kw):
    zoo, p = mlp
    return export_job(p, step, path, model=zoo.model, **split_keywords(ExportOptions, kw))


# ---- export_job: the job directory and its files ---------------------------------------------------


def test_export_files_are_private(mlp, tmp_path):
    job = _export(mlp, tmp_path / "job")
    modes = {name: stat.S_IMODE(os.stat(os.path.join(job.path, name)).st_mode) for name in os.listdir(job.path)}
    assert modes == {"plan.json": 0o600, "payload.pkl": 0o600, "run.py": 0o700, "command.sh": 0o700,
                     "job.sbatch": 0o700}
    assert stat.S_IMODE(os.stat(job.path).st_mode) & 0o077 == 0  # a fresh directory: the owner's only


def test_export_refuses_a_directory_others_can_write(mlp, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(PermissionError, match=r"job directory .*shared.* writable by other users \(mode drwxrwxrwx\)"):
        _export(mlp, shared)
    assert os.listdir(shared) == []  # nothing written


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory that belongs to another user")
def test_export_refuses_a_directory_of_another_user(mlp, tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(PermissionError, match=r"belongs to .*not to the running user"):
        _export(mlp, theirs)


def test_export_replaces_a_planted_symlink_instead_of_writing_through_it(mlp, tmp_path):
    job_dir, victim = tmp_path / "job", tmp_path / "victim.txt"
    job_dir.mkdir(mode=0o700)
    victim.write_text("precious")
    for name in ("plan.json", "payload.pkl", "command.sh"):
        os.symlink(victim, job_dir / name)
    job = _export(mlp, job_dir)
    assert victim.read_text() == "precious"
    for name in ("plan.json", "payload.pkl", "command.sh"):
        assert not os.path.islink(job_dir / name) and os.path.getsize(job_dir / name) > 0
    assert job.plan_file == str(job_dir / "plan.json")


def test_export_refuses_a_symlinked_job_directory(mlp, tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    os.symlink(real, tmp_path / "link")
    with pytest.raises(PermissionError, match="is a symlink"):
        _export(mlp, tmp_path / "link")


class _Trap:
    """Unpickling it creates a marker file: proof that a payload was (not) loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("how", ["writable-payload", "writable-dir", "symlink"])
def test_job_refuses_a_payload_others_could_have_written(mlp, tmp_path, how):
    job = _export(mlp, tmp_path / "job")
    marker = tmp_path / "unpickled"
    bad = os.path.join(job.path, "bad.pkl")
    with open(bad, "wb") as fh:
        fh.write(pickle.dumps(_Trap(marker)))
    os.chmod(bad, 0o600)
    payload = bad
    if how == "writable-payload":
        os.chmod(bad, 0o666)
        pattern = r"payload .*bad\.pkl.* is writable by other users"
    elif how == "writable-dir":
        os.chmod(job.path, 0o777)
        pattern = r"the directory of (plan file|payload) .* writable by other users"
    else:
        payload = os.path.join(job.path, "link.pkl")
        os.symlink(bad, payload)
        pattern = r"payload .*link\.pkl.* is a symlink"
    with pytest.raises(PermissionError, match=pattern):
        job_main(job.script, ["--payload", payload])
    assert not marker.exists()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a file to another user")
def test_job_refuses_a_payload_of_another_user(mlp, tmp_path):
    job = _export(mlp, tmp_path / "job")
    os.chown(job.payload_file, 65534, 65534)
    with pytest.raises(PermissionError, match=r"payload .* belongs to .*not to the running user"):
        job_main(job.script, [])


# ---- export_job: values written into shell scripts -----------------------------------------------------


@pytest.mark.parametrize("field", ["partition", "job_name", "time_limit"])
@pytest.mark.parametrize("value", ["gpu\ntouch /tmp/pwned", "gpu\r", "a\x00b", "x\x1b[2J"])
def test_control_characters_in_script_values_are_refused(mlp, tmp_path, field, value):
    with pytest.raises(ValueError, match=rf"{field}=.* contains the control character"):
        _export(mlp, tmp_path / "job", **{field: value})
    assert not (tmp_path / "job").exists() or os.listdir(tmp_path / "job") == []


@pytest.mark.parametrize("kwargs, match", [
    ({"steps": -5}, r"steps=-5 must be a positive int"), ({"steps": 0}, r"steps=0"),
    ({"port": 0}, r"port=0 must be an int in 1\.\.65535"), ({"port": "29500; rm"}, r"port='29500; rm'"),
    ({"nnodes": True}, r"nnodes=True"), ({"gpus_per_node": -1}, r"gpus_per_node=-1"),
    ({"job_name": ""}, r"job_name='' must be a non-empty string"),
])
def test_bad_export_values_are_refused(mlp, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _export(mlp, tmp_path / "job", **kwargs)


# ---- bad inputs: one clear error at the entry point ------------------------------------------------------

import json  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from snn_explorer import Explorer, SNNDistributedAnalysis, SNNDistributedPlan, SNNDistributedTopology, apply  # noqa: E402
from snn_explorer.core.common import MAX_WORLD_SIZE  # noqa: E402
from snn_explorer.estimator import enumerate_plans, estimate  # noqa: E402
from snn_explorer.estimator.memory.sharding import Param, rank_bytes, zero_partition  # noqa: E402


class Pair(nn.Module):
    """Returns a tuple, as some user models do."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 4)

    def forward(self, x):
        return self.fc(x), x


class Noted(Pair):
    """Returns a tuple that is not all tensors."""

    def forward(self, x):
        return self.fc(x), "note"


def _frozen_mlp():
    model = build("mlp").model
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _deep(depth):
    root = cur = []
    for _ in range(depth):
        cur.append([])
        cur = cur[0]
    return root


@pytest.fixture(scope="module")
def zoo_plan():
    zoo = build("mlp")
    return zoo, plan(analysis=analyze(zoo.model), objective="speed", topology={"dp": 2}, backend="torch",
                     batch_size=8)


def _est(zoo_plan, **kw):
    zoo, p = zoo_plan
    model = kw.pop("model", zoo.model)
    return estimate(model, kw.pop("plan", p), example_input=kw.pop("x", zoo.example_input), **kw)


def _plan_dict(zoo_plan, **changes):
    data = zoo_plan[1].to_dict()
    data.update(changes)
    return {k: v for k, v in data.items() if v is not _DROP}


_DROP = object()
X = build("mlp").example_input  # [8, 8, 64]

ESTIMATE_CASES = [
    ({"x": X[..., :63]}, ValueError, r"does not run on example_input of shape \(8, 8, 63\)"),
    ({"x": X[0]}, ValueError, r"example_input has shape \(8, 64\); expected \[T, N, features\.\.\.\]"),
    ({"x": X.to("meta")}, ValueError, r"example_input is on the meta device"),
    ({"x": X.tolist()}, TypeError, r"example_input must be a torch\.Tensor .* got list"),
    ({"x": X.numpy()}, TypeError, r"example_input must be a torch\.Tensor .* got ndarray"),
    ({"x": X.clone().requires_grad_()}, ValueError, r"example_input requires grad"),
    ({"x": X[:0]}, ValueError, r"shape \(0, 8, 64\) is empty \(T=0\)"),
    ({"x": X[:, :0]}, ValueError, r"shape \(8, 0, 64\) is empty \(N=0\)"),
    ({"time_steps": 0}, ValueError, r"time_steps=0 must be a positive int"),
    ({"time_steps": -3}, ValueError, r"time_steps=-3 must be a positive int"),
    ({"time_steps": 2.7}, ValueError, r"time_steps=2\.7 must be a positive int"),
    ({"time_steps": True}, ValueError, r"time_steps=True"),
    ({"dtype": "float32"}, TypeError, r"dtype='float32' must be a floating-point torch\.dtype.*torch\.float32"),
    ({"dtype": torch.int64}, TypeError, r"dtype=torch\.int64"),
    ({"memory_budget": -1}, ValueError, r"memory_budget=-1 must be a finite positive number"),
    ({"memory_budget": "1GB"}, ValueError, r"memory_budget='1GB'"),
    ({"labels": torch.zeros(3, dtype=torch.long)}, ValueError, r"labels of shape \(3,\) do not match .* N=8"),
    ({"labels": [0] * 8}, TypeError, r"labels must be a torch\.Tensor"),
    ({"plan": {"mode": "dp"}}, TypeError, r"plan must be an SNNDistributedPlan .* got dict"),
    ({"model": None}, TypeError, r"model must be a torch\.nn\.Module, got NoneType"),
    ({"model": Noted()}, TypeError, r"the model returned a tuple of Tensor, str; expected a tensor, or a tuple"),
    ({"model": nn.Sequential(nn.ReLU())}, ValueError, r"no trainable parameters"),
    ({"model": _frozen_mlp()}, ValueError, r"no trainable parameters"),
]


@pytest.mark.parametrize("kwargs, exc, pattern", ESTIMATE_CASES, ids=[str(i) for i in range(len(ESTIMATE_CASES))])
def test_estimate_refuses_bad_inputs(zoo_plan, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _est(zoo_plan, **kwargs)


def test_absurd_time_steps_are_refused_before_running(zoo_plan):
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"time_steps=100000000 with 4 samples per rank.* (GiB|kernels)"):
        _est(zoo_plan, time_steps=10 ** 8)
    assert time.monotonic() - start < 10  # nothing of that size was allocated


PLAN_JSON_CASES = [
    ({"topology": _DROP}, ValueError, r"serialised plan lacks the key\(s\) \['topology'\]"),
    ({"mode": _DROP}, ValueError, r"lacks the key\(s\) \['mode'\]"),
    ({"bogus": 1}, ValueError, r"serialised plan has unknown key\(s\) \['bogus'\]"),
    ({"rationale": "abc"}, TypeError, r"SNNDistributedPlan\.rationale must be a list of strings, got str: 'abc'"),
    ({"notes": [1]}, TypeError, r"notes must hold strings only, got int"),
    ({"fsdp_units": "net"}, TypeError, r"fsdp_units must be a list of strings"),
    ({"tensor_parallel_roots": "net"}, TypeError, r"tensor_parallel_roots must be a list of strings or None"),
    ({"rationale": _deep(50_000)}, TypeError, r"rationale must hold strings only, got list"),
    ({"topology": {"dims": {"dp": 2}, "world_size": 2, "extra": 1}}, ValueError,
     r"serialised topology has unknown key\(s\) \['extra'\]"),
    ({"topology": {"world_size": 2}}, ValueError, r"serialised topology lacks the key 'dims'"),
    ({"topology": {"dims": {"dp": 10 ** 18}}}, ValueError, r"more than the largest supported world size"),
    ({"topology": "dp=2"}, TypeError, r"serialised topology must be a mapping"),
]


@pytest.mark.parametrize("changes, exc, pattern", PLAN_JSON_CASES, ids=[str(i) for i in range(len(PLAN_JSON_CASES))])
def test_plan_json_is_checked(zoo_plan, changes, exc, pattern):
    with pytest.raises(exc, match=pattern):
        SNNDistributedPlan.from_dict(_plan_dict(zoo_plan, **changes))


def test_plan_json_round_trips_and_deep_text_is_a_value_error(zoo_plan):
    from snn_explorer.core.common import loads

    p = zoo_plan[1]
    assert SNNDistributedPlan.from_dict(loads(json.dumps(p.to_dict()))) == p
    with pytest.raises(ValueError, match="nested too deeply"):
        loads('{"rationale": ' + "[" * 50_000 + "]" * 50_000 + "}")


@pytest.mark.parametrize("changes, exc, pattern", [
    ({"memory_module_names": _DROP}, ValueError, r"serialised analysis lacks the key\(s\) \['memory_module_names'\]"),
    ({"surprise": 1}, ValueError, r"has unknown key\(s\) \['surprise'\]"),
    ({"tensor_parallel_roots": "net"}, TypeError, r"analysis\.tensor_parallel_roots must be a list of strings"),
    ({"fsdp_unit_names": "net"}, TypeError, r"analysis\.fsdp_unit_names must be a list of strings"),
    ({"tp_chains": "net"}, TypeError, r"analysis\.tp_chains must be a list of lists"),
    ({"tp_chains": ["net"]}, TypeError, r"analysis\.tp_chains\[\] must be a list of strings"),
    ({"trainable_parameters": -1}, TypeError, r"trainable_parameters must be a non-negative int"),
])
def test_analysis_json_is_checked(changes, exc, pattern):
    data = analyze(build("mlp").model).to_dict()
    data.update(changes)
    data = {k: v for k, v in data.items() if v is not _DROP}
    with pytest.raises(exc, match=pattern):
        SNNDistributedAnalysis.from_dict(data)


@pytest.mark.parametrize("world_size, pattern", [
    (0, r"world_size=0 must be a positive int"), (-2, r"world_size=-2"), (True, r"world_size=True"),
    (2.0, r"world_size=2\.0"), (MAX_WORLD_SIZE + 1, rf"world_size={MAX_WORLD_SIZE + 1} is above the largest"),
])
def test_enumerate_plans_world_size(world_size, pattern):
    with pytest.raises(ValueError, match=pattern):
        enumerate_plans(analyze(build("mlp").model), world_size=world_size, batch_size=8)


def test_runtime_and_apply_refuse_wrong_kinds(zoo_plan):
    zoo = zoo_plan[0]
    single = plan(analysis=analyze(zoo.model), objective="speed", topology=1, backend="torch", batch_size=8)
    with pytest.raises(TypeError, match=r"device_mesh must be a torch\.distributed\.device_mesh\.DeviceMesh .* "
                                        r"got list: \[0, 1\]"):
        apply(model=build("mlp").model, plan=zoo_plan[1], device_type="cpu", device_mesh=[0, 1])
    runtime = apply(model=build("mlp").model, plan=single, device_type="cpu")
    loss = nn.CrossEntropyLoss()
    with pytest.raises(TypeError, match=r"labels must be a torch\.Tensor, got list"):
        runtime.forward_loss(loss, zoo.example_input, zoo.labels.tolist())
    with pytest.raises(TypeError, match=r"inputs must be a torch\.Tensor, got ndarray"):
        runtime.forward_loss(loss, zoo.example_input.numpy(), zoo.labels)
    with pytest.raises(ValueError, match=r"labels of shape \(3,\) do not match outputs"):
        runtime.forward_loss(loss, zoo.example_input, zoo.labels[:3])
    pair = apply(model=Pair(), plan=plan(analysis=analyze(Pair()), objective="speed", topology=1, backend="torch",
                                         batch_size=8), device_type="cpu")
    noted = apply(model=Noted(), plan=plan(analysis=analyze(Noted()), objective="speed", topology=1, backend="torch",
                                           batch_size=8), device_type="cpu")
    with pytest.raises(TypeError, match=r"the model returned a tuple of Tensor, str; expected a tensor"):
        noted.forward_loss(loss, zoo.example_input, zoo.labels)
    with pytest.raises(ValueError, match=r"output=2 picks no element of the model's 2 outputs"):
        pair.forward_loss(loss, zoo.example_input, zoo.labels, output=2)


@pytest.mark.parametrize("kwargs, exc, pattern", [
    ({"example_input": X[0]}, ValueError, r"example_input has shape \(8, 64\)"),
    ({"example_input": X.tolist()}, TypeError, r"example_input must be a torch\.Tensor"),
    ({"example_input": X[:, :0]}, ValueError, r"N=0"),
    ({"example_input": X, "time_steps": 0}, ValueError, r"time_steps=0 must be a positive int"),
    ({"example_input": X, "batch_size": -8}, ValueError, r"batch_size=-8 must be a positive int"),
])
def test_explorer_refuses_bad_inputs(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        Explorer(build("mlp").model, **kwargs)


# ---- models: mixed dtypes, nothing to train ------------------------------------------------------


class MixedPrecision(nn.Module):
    """A float32 layer feeding a float64 one: apply runs it as it is, so must estimate."""

    def __init__(self):
        super().__init__()
        self.low = nn.Linear(64, 32)
        self.high = nn.Linear(32, 10).double()

    def forward(self, x):
        return self.high(torch.relu(self.low(x)).double()).float()


def test_estimate_of_a_mixed_dtype_model(zoo_plan):
    model = MixedPrecision()
    single = plan(analysis=analyze(model), objective="speed", topology=1, backend="torch", batch_size=8)
    out = apply(model=MixedPrecision(), plan=single, device_type="cpu").model(X)
    assert out.shape == (8, 8, 10) and out.dtype == torch.float32
    est = estimate(model, zoo_plan[1], example_input=X)
    expected = sum(p.numel() * p.element_size() for p in model.parameters())
    assert expected == (64 * 32 + 32) * 4 + (32 * 10 + 10) * 8
    assert est.per_rank["params_bytes"].tolist() == [expected, expected]
    assert model.high.weight.dtype == torch.float64  # the caller's model is not cast
    from snn_explorer.estimator import measure

    measured = measure(model, single, example_input=X, steps=1)  # one rank, in this process
    assert measured.per_rank["params_bytes"].tolist() == [expected]


def test_a_model_without_trainable_parameters_is_not_offered_dp():
    analysis = analyze(_frozen_mlp())
    assert analysis.trainable_parameters == 0
    chosen = plan(analysis=analysis, objective="speed", topology={"dp": 2}, backend="torch", batch_size=8)
    assert chosen.mode != "dp" and "no trainable parameters" in chosen.notes[-1]
    with pytest.raises(ValueError, match=r"mode='dp' cannot be applied: the model has no trainable parameters"):
        plan(analysis=analysis, objective="speed", topology={"dp": 2}, backend="torch", batch_size=8, mode="dp")
    found = enumerate_plans(analysis, world_size=2, batch_size=8)
    assert sorted(p.mode for p in found) == ["fsdp2", "tp"]
    assert "no trainable parameters" in found.infeasible["dp dp=2"]
    assert SNNDistributedAnalysis.from_dict(analysis.to_dict()) == analysis


# ---- scale: cost by rank role, not by rank ---------------------------------------------------------


def _greedy(params, world):
    """ZeroRedundancyOptimizer's greedy partition, written out over every rank."""
    sizes, parts = [0] * world, [[] for _ in range(world)]
    for p in sorted(params, key=lambda p: p.numel, reverse=True):
        r = sizes.index(min(sizes))
        parts[r].append(p)
        sizes[r] += p.numel
    return parts


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8, 64])
def test_zero_partition_matches_the_greedy_over_every_rank(world):
    params = [Param(f"p{i}", (n,), 4) for i, n in enumerate([7, 3, 3, 9, 1, 12, 5, 5])]
    parts = zero_partition(params, world)
    full = _greedy(params, world)
    assert parts == full[:len(parts)] and all(not rest for rest in full[len(parts):])


@pytest.mark.parametrize("objective, topology", [("speed", {"dp": 8}), ("memory", {"dp": 8}),
                                                 ("memory", {"dp": 4, "tp": 2}), ("speed", {"dp": 7})])
def test_per_rank_table_equals_rank_by_rank(objective, topology):
    zoo = build("mlp", batch_size=56)
    p = plan(analysis=analyze(zoo.model), objective=objective, topology=topology, backend="torch", batch_size=56)
    est = estimate(zoo.model, p, example_input=zoo.example_input)
    from snn_explorer.estimator.memory.sharding import local_params
    from snn_explorer.estimator.profile.profiling import model_profile

    prof = model_profile(zoo.model, zoo.example_input)
    params = local_params(prof.params, p, prof.param_itemsizes)
    for rank in range(p.world_size):
        row = est.per_rank.iloc[rank]
        assert row["rank"] == rank
        assert {k: int(row[k]) for k in ("params_bytes", "grads_bytes", "optimizer_bytes")} == \
            rank_bytes(params, p, rank, "adam")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("objective", ["speed", "memory"])
def test_estimate_at_the_largest_world_size_is_fast(objective):
    zoo = build("mlp")
    analysis = analyze(zoo.model)
    p = plan(analysis=analysis, objective=objective, topology={"dp": MAX_WORLD_SIZE}, backend="torch",
             batch_size=MAX_WORLD_SIZE)
    estimate(zoo.model, p, example_input=zoo.example_input)  # the one-off profile
    start = time.monotonic()
    est = estimate(zoo.model, p, example_input=zoo.example_input)
    assert time.monotonic() - start < 5
    assert len(est.per_rank) == MAX_WORLD_SIZE and est.per_rank["rank"].tolist()[-1] == MAX_WORLD_SIZE - 1
    with pytest.raises(ValueError, match=rf"make {MAX_WORLD_SIZE * 2} ranks, more than .*MAX_WORLD_SIZE"):
        SNNDistributedTopology({"dp": MAX_WORLD_SIZE, "tp": 2})
