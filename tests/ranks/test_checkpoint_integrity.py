"""A damaged, redirected or malformed checkpoint is refused by every reader, naming what is wrong,
and a refused load changes nothing: every parameter and every optimizer state tensor is compared
before and after (one process, mode ``none``; on 2 gloo ranks under fsdp2 for the staged load)."""
import io
import json
import os
import shutil

import pytest
import torch
from distributed_harness import run_on_ranks
from torch import nn

import snn_explorer as se
from snn_explorer import compat_dcp
from snn_explorer.core.checkpoints import CheckpointError, check_checkpoint, file_digest, latest_checkpoint, step_path
from snn_explorer.zoo import build


def _runtime():
    zoo = build("mlp", "tiny")
    plan = se.plan(analysis=se.analyze(zoo.model), objective="speed", topology={"dp": 1}, mode="none",
                   batch_size=zoo.batch_size)
    runtime = se.apply(model=zoo.model, plan=plan, device_type="cpu")
    return runtime, runtime.build_optimizer(lr=1e-2), zoo


def _train(runtime, optimizer, zoo):
    optimizer.zero_grad()
    runtime.train_step(nn.CrossEntropyLoss(), zoo.example_input, zoo.labels)
    optimizer.step()
    runtime.reset_state()


@pytest.fixture
def saved(tmp_path):
    """A checkpoint of step 3, then one more step so the live model differs from it."""
    runtime, optimizer, zoo = _runtime()
    _train(runtime, optimizer, zoo)
    path = runtime.save_checkpoint(step_path(tmp_path / "run", 3), optimizer=optimizer, step=3)
    _train(runtime, optimizer, zoo)
    return path, runtime, optimizer, zoo


def _snapshot(runtime, optimizer):
    params = {n: p.detach().clone() for n, p in runtime.module.named_parameters()}
    state = {(id(p), k): v.clone() for p, s in optimizer.state.items() for k, v in s.items()
             if isinstance(v, torch.Tensor)}
    return params, state


def _same(a, b) -> bool:
    return a[0].keys() == b[0].keys() and a[1].keys() == b[1].keys() and \
        all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def _shard(path):
    return sorted(p for p in path.iterdir() if p.suffix == ".distcp")[0]


def _rewrite_manifest(path, edit):
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def _rehash(path, name):
    """Record ``name``'s current checksum in the manifest (as a careful attacker would)."""
    def edit(m):
        m["files"][name]["hash"] = file_digest(path / name, m["hash_algorithm"])[1]
    _rewrite_manifest(path, edit)


def test_400_flipped_bytes_of_the_same_size_are_named_by_every_reader(saved, capsys):
    path, runtime, optimizer, zoo = saved
    shard = _shard(path)
    data = bytearray(shard.read_bytes())
    assert len(data) > 800
    for i in range(len(data) - 400, len(data)):
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))  # same size: the size check alone would pass it
    match = rf"damaged: {shard.name} does not match its blake2b-128 checksum"
    before = _snapshot(runtime, optimizer)
    with pytest.raises(CheckpointError, match=match):
        runtime.load_checkpoint(path, optimizer=optimizer)
    assert _same(before, _snapshot(runtime, optimizer))
    with pytest.raises(CheckpointError, match=match):
        check_checkpoint(path, zoo.model, runtime.plan)
    with pytest.raises(CheckpointError, match=match):
        latest_checkpoint(path.parent)
    from snn_explorer.cli import main
    assert main(["checkpoint", "info", str(path)]) == 2
    err = capsys.readouterr().err
    assert shard.name in err and "checksum" in err and len(err.strip().splitlines()) == 1


def _nan_into_last_item(path):
    """Write NaN over the values of the floating-point item stored last in the shards (found in its
    ``torch.save`` record by its own bytes), and fix up the checksum."""
    metadata = compat_dcp.read_dcp_metadata(path / ".metadata")
    floats = [(info.relative_path, info.offset, info.length) for index, info in metadata.storage_data.items()
              if metadata.state_dict_metadata[index.fqn].properties.dtype.is_floating_point]
    name, offset, length = max(floats)
    shard = path / name
    data = bytearray(shard.read_bytes())
    values = torch.load(io.BytesIO(bytes(data[offset:offset + length])), weights_only=True)
    raw = values.contiguous().numpy().tobytes()
    at = bytes(data[offset:offset + length]).find(raw)
    assert at >= 0 and values.numel() > 0
    nan = torch.full_like(values, float("nan")).numpy().tobytes()
    data[offset + at:offset + at + len(raw)] = nan
    shard.write_bytes(bytes(data))
    _rehash(path, name)


def test_a_load_refused_halfway_changes_no_parameter_and_no_optimizer_state(saved, tmp_path):
    path, runtime, optimizer, _ = saved
    intact = shutil.copytree(path, tmp_path / "intact")
    before = _snapshot(runtime, optimizer)
    _nan_into_last_item(path)  # read last: everything before it was already read when it is found
    with pytest.raises(CheckpointError, match="non-finite values .* saved finite; nothing was loaded"):
        runtime.load_checkpoint(path, optimizer=optimizer)
    assert _same(before, _snapshot(runtime, optimizer))
    runtime.load_checkpoint(intact, optimizer=optimizer)  # the intact copy does change them: the comparison means something
    assert not _same(before, _snapshot(runtime, optimizer))


def test_a_saved_plan_with_an_unknown_mode_is_refused_before_anything_changes(saved):
    path, runtime, optimizer, _ = saved
    before = _snapshot(runtime, optimizer)
    _rewrite_manifest(path, lambda m: m["plan"].update(mode="warp9"))
    with pytest.raises(CheckpointError, match="manifest field 'plan' is not a plan .*warp9"):
        runtime.load_checkpoint(path, optimizer=optimizer)
    assert _same(before, _snapshot(runtime, optimizer))


@pytest.mark.parametrize("name", ["shard", "manifest.json", ".metadata"])
def test_a_file_replaced_by_a_symlink_outside_the_folder_is_refused(saved, tmp_path, name):
    path, runtime, optimizer, zoo = saved
    target = _shard(path) if name == "shard" else path / name
    outside = tmp_path / f"outside-{target.name}"
    outside.write_bytes(target.read_bytes())  # the same bytes: only the link itself is wrong
    target.unlink()
    os.symlink(outside, target)
    before = _snapshot(runtime, optimizer)
    with pytest.raises(CheckpointError, match=rf"{target.name} is a symlink"):
        runtime.load_checkpoint(path, optimizer=optimizer)
    assert _same(before, _snapshot(runtime, optimizer))
    with pytest.raises(CheckpointError, match="symlink"):
        check_checkpoint(path, zoo.model, runtime.plan)


@pytest.mark.parametrize("edit, field", [
    (lambda m: m.pop("tensors"), "'tensors' is missing"),
    (lambda m: m.update(files=list(m["files"])), "'files' is list"),
    (lambda m: m.update(step="abc"), "'step' is str 'abc'; expected a non-negative int"),
    (lambda m: m.update(world_size=0), "'world_size' is int 0; expected a positive int"),
    (lambda m: m["tensors"].update({"x": {"shape": "3", "dtype": "float32"}}), "'tensors' is dict"),
    (lambda m: m.update(optimizer={"class": 1}), "'optimizer' is dict"),
    (lambda m: m.update(finite="yes"), "'finite' is str"),
])
def test_every_manifest_field_is_type_checked_naming_it(saved, edit, field):
    path, runtime, optimizer, zoo = saved
    _rewrite_manifest(path, edit)
    with pytest.raises(CheckpointError, match=f"manifest field {field}"):
        runtime.load_checkpoint(path, optimizer=optimizer)
    with pytest.raises(CheckpointError, match=f"manifest field {field}"):
        check_checkpoint(path, zoo.model, runtime.plan)


def test_non_finite_weights_are_never_saved_and_never_the_latest(saved):
    path, runtime, optimizer, _ = saved
    with torch.no_grad():
        next(runtime.module.parameters())[0, 0] = float("nan")
    nan_path = step_path(path.parent, 4)
    with pytest.raises(CheckpointError, match=r"non-finite values \(NaN / Inf\) in rank 0: model\.net\.0\.weight"):
        runtime.save_checkpoint(nan_path, optimizer=optimizer, step=4)
    assert not nan_path.exists() and latest_checkpoint(path.parent) == path
    runtime.save_checkpoint(nan_path, optimizer=optimizer, step=4, allow_non_finite=True)
    assert json.loads((nan_path / "manifest.json").read_text())["finite"] is False
    assert latest_checkpoint(path.parent) == path  # passed over for the last finite one


def _staged_load_on_ranks(root):
    """fsdp2 on 2 ranks: a good load restores DTensor shards; a load with NaN in its last item
    (checksum fixed up) is refused on both ranks and leaves every local shard and state as it was."""
    import torch.distributed as dist

    zoo = build("mlp", "tiny")
    plan = se.plan(analysis=se.analyze(zoo.model), objective="speed", topology={"dp": 2}, mode="fsdp2",
                   batch_size=zoo.batch_size)
    runtime = se.apply(model=zoo.model, plan=plan, device_type="cpu")
    optimizer = runtime.build_optimizer(lr=1e-2)
    share = zoo.batch_size // 2
    step = lambda: (optimizer.zero_grad(), runtime.train_step(  # noqa: E731
        nn.CrossEntropyLoss(), zoo.example_input[:, dist.get_rank() * share:][:, :share],
        zoo.labels[dist.get_rank() * share:][:share]), optimizer.step(), runtime.reset_state())
    step()
    path = runtime.save_checkpoint(step_path(root, 1), optimizer=optimizer, step=1)
    step()
    local = lambda: ({n: p.to_local().clone() for n, p in runtime.model.named_parameters()},  # noqa: E731
                     {(id(p), k): v.to_local().clone() if hasattr(v, "to_local") else v.clone()
                      for p, s in optimizer.state.items() for k, v in s.items()})
    before = local()
    dist.barrier()
    if dist.get_rank() == 0:
        _nan_into_last_item(path)
    dist.barrier()
    try:
        runtime.load_checkpoint(path, optimizer=optimizer)
        refused = None
    except CheckpointError as exc:
        refused = str(exc)
    return refused, _same(before, local())


def test_a_refused_load_on_fsdp2_ranks_changes_no_shard(tmp_path):
    results = run_on_ranks(_staged_load_on_ranks, 2, str(tmp_path), timeout=180)
    for refused, unchanged in results:
        assert refused is not None and "non-finite values" in refused and "nothing was loaded" in refused
        assert unchanged
