"""Checkpoints across precisions on real gloo ranks: what a bf16 or fp16 run saves are its fp32 master
weights and fp32 optimizer state, which a plan of any precision and mode loads exactly; an fp16 run's
loss scaler (scale, growth tracker, skipped steps) travels with them to an fp16 plan.
(The tests on gloo ranks: tests/ranks/test_precision_checkpoint_ranks.py.)"""
import pytest

import snn_explorer as se
from snn_explorer.core.checkpoints import CheckpointError
from snn_explorer.zoo import build

GATE = dict(allow_mixed_precision=True)


def test_a_damaged_loss_scaler_state_is_refused_before_any_tensor_is_read(tmp_path):
    zoo = build("mlp_all_steps", seed=0)
    plan = se.plan(analysis=se.analyze(zoo.model, model_family=zoo.family), objective="speed", topology=1,
                   batch_size=zoo.batch_size, features=se.DistributedFeatureSet(**GATE), options=se.PlanOptions(precision="fp16"))
    runtime = se.apply(model=zoo.model, plan=plan, device_type="cpu")
    path = runtime.save_checkpoint(tmp_path / "ck")
    manifest = (path / "manifest.json").read_text()
    assert '"scale": 65536.0' in manifest
    (path / "manifest.json").write_text(manifest.replace('"scale": 65536.0', '"scale": -1.0'))
    with pytest.raises(CheckpointError, match=r"scale=-1.0; expected a finite number > 0"):
        runtime.load_checkpoint(path)
