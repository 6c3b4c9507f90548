"""bf16 plans in one process: FSDP2 plans bf16 on BatchNorm models (each norm its own fp32 unit) and refuses a
bare BatchNorm; the estimate computes bf16 at the hardware's half-precision rate. (bf16 estimates against
measure() on real gloo ranks: tests/ranks/test_precision_estimate.py.)"""
import dataclasses

import pytest
from test_precision_estimate import GATE, _plans
from torch import nn

import snn_explorer as se
from snn_explorer.estimator import estimate
from snn_explorer.zoo import build

pytestmark = pytest.mark.timeout(600)  # the first test measures every model of CASES


def test_fsdp2_plans_bf16_on_batchnorm_models_and_refuses_a_bare_batchnorm():
    zoo = build("vgg")
    analysis = se.analyze(zoo.model, model_family=zoo.family)
    auto = se.plan(analysis=analysis, objective="speed", topology={"dp": 2}, batch_size=zoo.batch_size,
                   mode="fsdp2", features=GATE)
    assert auto.precision.name == "bf16" and any("FSDP2 unit of its own" in n for n in auto.notes), auto.notes
    bare = se.analyze(nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match="this model is itself a BatchNorm layer"):
        se.plan(analysis=bare, objective="speed", topology={"dp": 2}, batch_size=4, mode="fsdp2", features=GATE, options=se.PlanOptions(precision="bf16"))
    fallback = se.plan(analysis=bare, objective="speed", topology={"dp": 2}, batch_size=4, mode="fsdp2",
                       features=GATE)
    assert fallback.precision.name == "fp32" and any("itself a BatchNorm" in n for n in fallback.notes)


def test_half_precision_rate_is_used_for_bf16_compute():
    """On an A100 profile made FLOP-bound (no operator overhead, unlimited bandwidth), the bf16 plan's compute
    time is the fp32 plan's over the datasheet ratio 312 / 19.5 TFLOP/s, up to the casts autocast adds."""
    zoo = build("mlp_all_steps")
    plans = _plans(zoo, "bf16")[:1] + _plans(zoo, "fp32")[:1]
    hw = dataclasses.replace(se.hardware_profile("A100-SXM-80GB"), op_overhead_s=0.0, bytes_per_s=1e30,
                             framework_overhead={})
    est = [estimate(zoo.model, p, example_input=zoo.example_input, labels=zoo.labels, hardware=hw) for p in plans]
    compute16, compute32 = (float(e.time["compute_s"].max()) for e in est)
    assert hw.flops(2) / hw.flops(4) == pytest.approx(312 / 19.5)
    assert compute32 / compute16 == pytest.approx(312 / 19.5, rel=0.05), (compute16, compute32)
