"""Checkpoints refused with a clear error (one process, mode ``none``), and ``snn-explorer checkpoint info``."""
import json
import os
import re
import shutil

import pytest
import torch
from torch import nn

import snn_explorer as se
from snn_explorer.cli import main
from snn_explorer.core.checkpoints import CheckpointError, check_checkpoint, read_manifest, reshard_problem
from snn_explorer.zoo import build


def _runtime(name="mlp", size="tiny"):
    zoo = build(name, size)
    plan = se.plan(analysis=se.analyze(zoo.model, model_family=zoo.family), objective="speed",
                   topology={"dp": 1}, mode="none", batch_size=zoo.batch_size)
    runtime = se.apply(model=zoo.model, plan=plan, device_type="cpu")
    return runtime, runtime.build_optimizer(lr=1e-2), zoo


def _step(runtime, optimizer, zoo):
    optimizer.zero_grad()
    runtime.train_step(nn.CrossEntropyLoss(), zoo.example_input, zoo.labels)
    optimizer.step()
    runtime.reset_state()


@pytest.fixture
def saved(tmp_path):
    runtime, optimizer, zoo = _runtime()
    _step(runtime, optimizer, zoo)
    path = runtime.save_checkpoint(tmp_path / "ck", optimizer=optimizer, step=1, extra={"epoch": 0})
    return path, runtime, optimizer, zoo


def _files(path):
    return {p.name: p.read_bytes() for p in path.iterdir()}


def test_round_trip_in_one_process_restores_parameters_state_and_rng(saved):
    path, runtime, optimizer, zoo = saved
    want = {k: v.clone() for k, v in runtime.full_parameters().items()}
    rng_after_save = torch.get_rng_state()
    other, other_opt, _ = _runtime()
    torch.rand(5)  # moves the RNG on
    loaded = other.load_checkpoint(path, optimizer=other_opt)
    assert (loaded.step, loaded.extra, loaded.plan, loaded.rng_restored) == (1, {"epoch": 0}, runtime.plan, True)
    assert torch.equal(torch.get_rng_state(), rng_after_save)
    got = other.full_parameters()
    assert all(torch.equal(got[k], want[k]) for k in want) and not torch.equal(want["net.0.weight"],
                                                                                build("mlp").model.net[0].weight)
    for p, q in zip(runtime.model.parameters(), other.model.parameters()):
        assert torch.equal(optimizer.state[p]["exp_avg_sq"], other_opt.state[q]["exp_avg_sq"])


def test_missing_foreign_and_truncated_directories_are_named(saved, tmp_path):
    path, runtime, optimizer, _ = saved
    with pytest.raises(CheckpointError, match="does not exist"):
        runtime.load_checkpoint(tmp_path / "nowhere")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "weights.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="no manifest.json"):
        runtime.load_checkpoint(foreign)
    (foreign / "manifest.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(CheckpointError, match="format='something else'"):
        read_manifest(foreign)
    damaged = tmp_path / "damaged"
    shutil.copytree(path, damaged)
    shard = next(p for p in damaged.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-10])
    before = _files(damaged)
    with pytest.raises(CheckpointError, match=rf"damaged: {shard.name} has \d+ bytes, the manifest says"):
        runtime.load_checkpoint(damaged, optimizer=optimizer)
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"incomplete: {shard.name} is missing"):
        runtime.load_checkpoint(damaged)
    assert _files(damaged) == {k: v for k, v in before.items() if k != shard.name}


def test_a_checkpoint_of_another_model_names_paths_and_shapes(saved):
    path, _, _, _ = saved
    wider, _, _ = _runtime("mlp", "small")
    with pytest.raises(CheckpointError, match=r"another model.*shapes or dtypes differ: net\.0\.weight: checkpoint"):
        wider.load_checkpoint(path)
    vgg, _, _ = _runtime("vgg")
    with pytest.raises(CheckpointError, match=r"not in the checkpoint: \['classifier\.fc1\.bias'.*not in the model: "
                                              r"\['net\.0\.bias'"):
        vgg.load_checkpoint(path)
    double, _, _ = _runtime()
    double.model.double()
    with pytest.raises(CheckpointError, match=r"net\.0\.bias: checkpoint \(\d+,\) float32, model \(\d+,\) float64"):
        double.load_checkpoint(path)


def test_optimizer_mismatch_is_named(saved, tmp_path):
    path, runtime, _, zoo = saved
    other, _, _ = _runtime()
    with pytest.raises(CheckpointError, match="Adam optimizer, not of the SGD"):
        other.load_checkpoint(path, optimizer=torch.optim.SGD(other.model.parameters(), lr=0.1))
    runtime.save_checkpoint(tmp_path / "no_opt")
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        other.load_checkpoint(tmp_path / "no_opt", optimizer=torch.optim.Adam(other.model.parameters()))


def test_a_plan_that_cannot_reshard_the_checkpoint_is_named_at_plan_time(saved):
    path, _, _, zoo = saved
    plan = se.plan(analysis=se.analyze(zoo.model), objective="speed", topology={"tp": 2}, mode="tp",
                   batch_size=zoo.batch_size)
    assert check_checkpoint(path, zoo.model, plan)["step"] == 1
    manifest = read_manifest(path)
    first = next(iter(plan.tensor_parallel_plan))
    manifest["tensors"][f"{first}.weight"]["shape"][0] = 7  # a width tp=2 cannot split
    problem = reshard_problem(manifest, plan)
    assert "tp=2 cannot reshard" in problem and f"{first}.weight" in problem


def test_nothing_is_overwritten_unless_asked(saved):
    path, runtime, optimizer, zoo = saved
    before = _files(path)
    _step(runtime, optimizer, zoo)
    with pytest.raises(CheckpointError, match="already exists; pass overwrite=True"):
        runtime.save_checkpoint(path, optimizer=optimizer, step=2)
    assert _files(path) == before
    runtime.save_checkpoint(path, optimizer=optimizer, step=2, overwrite=True)
    assert read_manifest(path)["step"] == 2
    assert sorted(p.name for p in path.parent.iterdir()) == ["ck"]  # no partial or replaced directory left


def test_mid_sequence_is_refused_unless_asked(tmp_path):
    runtime, optimizer, zoo = _runtime()
    runtime.model(zoo.example_input[:2])  # neurons now hold membranes: a sequence not finished
    with pytest.raises(CheckpointError, match=r"neuron state is not at rest in \['net\.1'"):
        runtime.save_checkpoint(tmp_path / "mid")
    assert not (tmp_path / "mid").exists()
    runtime.save_checkpoint(tmp_path / "mid", allow_mid_sequence=True)
    assert read_manifest(tmp_path / "mid")["step"] == 0
    with pytest.raises(CheckpointError, match="extra must be JSON-serialisable"):
        runtime.save_checkpoint(tmp_path / "x", extra=object(), allow_mid_sequence=True)


def test_cli_checkpoint_info(saved, capsys, tmp_path):
    path, runtime, _, _ = saved
    assert main(["checkpoint", "info", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"plan: {runtime.plan!r}" in out and "step: 1  world size: 1" in out and "optimizer: Adam" in out
    shapes = {n: tuple(p.shape) for n, p in runtime.model.named_parameters()}
    for name, shape in shapes.items():
        assert re.search(rf"^{re.escape(name)} +{re.escape(str(shape))}  float32$", out, re.M), name
    assert main(["checkpoint", "info", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"]["net.0.weight"]["shape"] == list(shapes["net.0.weight"])
    assert main(["checkpoint", "info", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nowhere" in err and "does not exist" in err


def test_exported_job_restarts_and_resumes_from_checkpoints(tmp_path):
    import pickle
    import stat

    from snn_explorer.launcher import ExportOptions, export_job

    zoo = build("mlp")
    plan = se.plan(analysis=se.analyze(zoo.model), objective="speed", topology={"dp": 2}, mode="dp",
                   batch_size=zoo.batch_size)
    job = export_job(plan, lambda runtime, step, batch, state: 0.0, tmp_path / "job", model=zoo.model, steps=10, options=ExportOptions(max_restarts=3, checkpoint_dir="ckpt", checkpoint_every=2))
    assert "--max-restarts 3" in job.command and "--max-restarts 3" in open(job.sbatch_file).read()
    assert stat.S_IMODE(os.stat(job.payload_file).st_mode) == 0o600
    with open(job.payload_file, "rb") as fh:
        assert pickle.load(fh)["checkpoints"] == {"dir": "ckpt", "every": 2}
    with pytest.raises(ValueError, match="max_restarts=-1 must be a non-negative int"):
        export_job(plan, lambda *a: 0.0, tmp_path / "job2", model=zoo.model, options=ExportOptions(max_restarts=-1))
    with pytest.raises(ValueError, match="checkpoint_dir and checkpoint_every go together"):
        export_job(plan, lambda *a: 0.0, tmp_path / "job3", model=zoo.model, options=ExportOptions(checkpoint_every=2))
