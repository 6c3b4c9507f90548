"""Nothing in a checkpoint runs as code: a planted ``.metadata`` or ``.distcp`` whose pickle would
create a file is refused by load_checkpoint, check_checkpoint, latest_checkpoint and the CLI,
the error says why, and the file is never created (one process, mode ``none``)."""
import dataclasses
import io
import json
import os
import pickle

import pytest
import torch
from torch import nn

import snn_explorer as se
from snn_explorer import compat_dcp
from snn_explorer.core.checkpoints import CheckpointError, check_checkpoint, file_digest, latest_checkpoint, step_path
from snn_explorer.zoo import build


class _CreatesFile:
    """Unpickled with plain pickle (or torch.load without weights_only) this runs a shell command."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _runtime():
    zoo = build("mlp", "tiny")
    plan = se.plan(analysis=se.analyze(zoo.model), objective="speed", topology={"dp": 1}, mode="none",
                   batch_size=zoo.batch_size)
    runtime = se.apply(model=zoo.model, plan=plan, device_type="cpu")
    return runtime, runtime.build_optimizer(lr=1e-2), zoo


@pytest.fixture
def saved(tmp_path):
    runtime, optimizer, zoo = _runtime()
    optimizer.zero_grad()
    runtime.train_step(nn.CrossEntropyLoss(), zoo.example_input, zoo.labels)
    optimizer.step()
    runtime.reset_state()
    path = runtime.save_checkpoint(step_path(tmp_path / "run", 3), optimizer=optimizer, step=3)
    return path, runtime, optimizer, zoo.model


def _plant(path, name, payload: bytes):
    """Replace ``path/name`` by ``payload`` and edit the manifest's size and checksum to match (as an
    attacker would), so that what refuses it is the reader, not the checksum."""
    (path / name).write_bytes(payload)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][name] = {"size": len(payload),
                               "hash": file_digest(path / name, manifest["hash_algorithm"])[1]}
    (path / "manifest.json").write_text(json.dumps(manifest))


def _every_reader_refuses(path, runtime, optimizer, model, match):
    with pytest.raises(CheckpointError, match=match):
        runtime.load_checkpoint(path, optimizer=optimizer)
    with pytest.raises(CheckpointError, match=match):
        check_checkpoint(path, model, runtime.plan)
    with pytest.raises(CheckpointError, match=match):
        latest_checkpoint(path.parent)


def test_a_metadata_pickle_that_runs_a_command_is_refused_and_never_runs(saved, tmp_path):
    path, runtime, optimizer, model = saved
    marker = tmp_path / "metadata-ran"
    _plant(path, ".metadata", pickle.dumps(_CreatesFile(marker)))
    _every_reader_refuses(path, runtime, optimizer, model, r"refused: .*\.metadata was not loaded: it names "
                          r"posix\.system, which is not a class of DCP tensor metadata")
    assert not marker.exists()


def test_metadata_routing_a_tensor_through_unrestricted_torch_load_is_refused(saved, tmp_path):
    """DCP reads an entry its metadata calls bytes with torch.load(weights_only=False): a .distcp
    holding a command would then run. Such metadata is refused before any .distcp is opened."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    path, runtime, optimizer, model = saved
    metadata = compat_dcp.read_dcp_metadata(path / ".metadata")
    entries = {k: BytesStorageMetadata() if k.startswith("model.") else v
               for k, v in metadata.state_dict_metadata.items()}
    _plant(path, ".metadata", pickle.dumps(dataclasses.replace(metadata, state_dict_metadata=entries)))
    marker = tmp_path / "distcp-ran"
    shard = next(p.name for p in path.iterdir() if p.suffix == ".distcp")
    _plant(path, shard, pickle.dumps(_CreatesFile(marker)))
    _every_reader_refuses(path, runtime, optimizer, model, r"it names torch\.distributed\.checkpoint\.metadata\."
                          r"BytesStorageMetadata, which is not a class of DCP tensor metadata")
    assert not marker.exists()


def test_a_distcp_holding_a_command_is_read_with_weights_only_and_refused(saved, tmp_path):
    path, runtime, optimizer, model = saved
    marker = tmp_path / "distcp-ran"
    buffer = io.BytesIO()
    torch.save(_CreatesFile(marker), buffer)
    payload = buffer.getvalue()
    metadata = compat_dcp.read_dcp_metadata(path / ".metadata")
    shard = next(p.name for p in path.iterdir() if p.suffix == ".distcp")
    storage = {index: dataclasses.replace(info, relative_path=shard, offset=0, length=len(payload))
               for index, info in metadata.storage_data.items()}
    _plant(path, ".metadata", pickle.dumps(dataclasses.replace(metadata, storage_data=storage)))
    _plant(path, shard, payload)
    check_checkpoint(path, model, runtime.plan)  # the metadata is well formed: only the tensor data is not
    with pytest.raises(CheckpointError, match=r"loading checkpoint .* failed \(rank 0: UnpicklingError: "
                                              r"Weights only load failed") as refused:
        runtime.load_checkpoint(path, optimizer=optimizer)
    assert not marker.exists()
    # torch's own message goes on to advise weights_only=False (which would run the command): not passed on
    assert "weights_only" not in str(refused.value) and "arbitrary code" not in str(refused.value)
    assert "os.system" in str(refused.value) or "posix.system" in str(refused.value)  # what it named is kept


def test_metadata_pointing_outside_its_folder_is_refused(saved, tmp_path):
    path, runtime, optimizer, model = saved
    metadata = compat_dcp.read_dcp_metadata(path / ".metadata")
    storage = {i: dataclasses.replace(info, relative_path="../elsewhere.distcp")
               for i, info in metadata.storage_data.items()}
    _plant(path, ".metadata", pickle.dumps(dataclasses.replace(metadata, storage_data=storage)))
    _every_reader_refuses(path, runtime, optimizer, model, r"points at storage '\.\./elsewhere\.distcp'")


def test_the_command_line_info_refuses_planted_metadata(saved, tmp_path, capsys):
    from snn_explorer.cli import main

    path = saved[0]
    marker = tmp_path / "cli-ran"
    _plant(path, ".metadata", pickle.dumps(_CreatesFile(marker)))
    assert main(["checkpoint", "info", str(path)]) != 0
    assert "not a class of DCP tensor metadata" in capsys.readouterr().err and not marker.exists()
