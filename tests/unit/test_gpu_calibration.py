"""GPU calibration: its file round-trips into estimate (the rates it holds are the rates the estimate uses) and,
without CUDA, it refuses in one line before doing any work. The measuring code runs here on the CPU (its
device-independent part); the NCCL timings are a recorded measurement dict."""
import json

import pytest
import torch
from torch import nn

import snn_explorer as se
from snn_explorer.cli import main
from snn_explorer.estimator.calibration.gpu import (
    CudaRequiredError,
    measure_device,
    model_shapes,
    profile_from_measurement,
)
from snn_explorer.estimator.timing.hardware import KINDS
from snn_explorer.zoo import build

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def _zoo():
    return build("mlp", batch_size=8)


def _recorded_nccl(alpha_s: float, bytes_per_s: float) -> dict:
    """NCCL timings as nccl_on_rank reports them, of collectives that take alpha + bytes / bandwidth."""
    sizes = [4096 * 4 ** i for i in range(6)]
    return {"group_size": 2, "timings": {k: [[b, alpha_s + b / bytes_per_s] for b in sizes] for k in KINDS}}


@pytest.fixture(scope="module")
def measured():
    zoo = _zoo()
    shapes = model_shapes(zoo.model, zoo.example_input)
    m = measure_device("cpu", shapes, stream_elements=2 ** 16)
    m.update(device_name="NVIDIA H100 80GB HBM3", nccl=_recorded_nccl(20e-6, 100e9))
    return m


def test_the_shapes_are_the_models_own(measured):
    zoo = _zoo()
    linears = [m for m in zoo.model.modules() if isinstance(m, nn.Linear)]
    weights = {(m.in_features, m.out_features) for m in linears}
    assert {tuple(b) for _, b, _ in measured["shapes"]["matmul"]} == weights  # addmm(bias, x, W^T): W^T's shape
    rows = measured["by_dtype"]["float32"]["matmul"]
    assert rows and all(r["seconds"] > 0 and r["flops"] == 2 * r["shape"][0][0] * r["shape"][0][1] * r["shape"][1][1]
                        for r in rows)
    assert measured["by_dtype"]["float32"]["elementwise"] and measured["launch_s"] > 0


def _estimate(model, example, hardware, dp=1):
    plan = se.plan(analysis=se.analyze(model), objective="speed", topology={"dp": dp}, batch_size=8,
                   mode="dp" if dp > 1 else "none")
    return se.estimate(model, plan, example_input=example, hardware=hardware).time.iloc[0]


def test_a_calibration_file_round_trips_into_estimate(measured, tmp_path):
    profile = profile_from_measurement(measured)
    assert profile.device == "cuda" and profile.kernel_model and profile.source.startswith("calibration on NVIDIA")
    alpha, beta = profile.collectives["all_reduce"][2]
    assert alpha == pytest.approx(20e-6, rel=1e-6) and beta == pytest.approx(1 / 100e9, rel=1e-6)
    path = tmp_path / "gpu.json"
    profile.save(path)
    data = json.loads(path.read_text())
    assert se.HardwareProfile.load(path) == profile

    def variant(name, **changes):
        out = tmp_path / f"{name}.json"
        out.write_text(json.dumps(dict(data, **changes)))
        return str(out)

    zoo = _zoo()
    base = variant("base", op_overhead_s=0.0)
    fast = variant("fast", op_overhead_s=0.0, **{k: 2 * data[k] for k in
                                                  ("flops_per_s", "half_flops_per_s", "tensor_flops_per_s",
                                                   "bytes_per_s") if data[k]})
    slow_launch = variant("launch", op_overhead_s=1e-3)
    got = {name: _estimate(zoo.model, zoo.example_input, path) for name, path in
           (("base", base), ("fast", fast), ("launch", slow_launch))}
    assert got["base"]["compute_s"] > 0
    assert got["fast"]["compute_s"] == pytest.approx(got["base"]["compute_s"] / 2, rel=1e-9)  # every kernel's roofline
    assert got["launch"]["compute_s"] >= got["base"]["compute_s"] + 1e-3  # at least one launch, 1 ms each
    slow_ring = variant("ring", collectives={k: {"2": [20e-6, 10 / 100e9]} for k in KINDS})
    dp = {name: _estimate(zoo.model, zoo.example_input, p, dp=2) for name, p in (("base", str(path)), ("ring", slow_ring))}
    assert dp["ring"]["step_s"] > dp["base"]["step_s"]  # a tenth of the bus bandwidth: a slower all-reduce


def test_one_gpu_borrows_the_collectives_of_its_builtin(measured):
    one = dict(measured, nccl=None)
    profile = profile_from_measurement(one)
    assert profile.collectives == se.hardware_profile("H100-SXM").collectives and "not measured" in profile.topology
    with pytest.raises(ValueError, match="collectives_from"):
        profile_from_measurement(dict(one, device_name="Some Other GPU"))


def test_a_missing_profile_file_is_named():
    zoo = _zoo()
    with pytest.raises(ValueError, match="no such profile file"):
        _estimate(zoo.model, zoo.example_input, "missing-gpu.json")


class _Refused(nn.Module):
    def forward(self, x):
        raise AssertionError("the model ran: calibration did work before checking for CUDA")


@no_cuda
def test_without_cuda_calibrate_says_it_needs_cuda_before_any_work():
    with pytest.raises(CudaRequiredError, match=r"calibrate\(device='cuda'\) needs CUDA"):
        se.calibrate(device="cuda", model=_Refused(), example_input=torch.ones(1))


@no_cuda
def test_without_cuda_the_cli_exits_2_in_one_line(capsys, tmp_path):
    assert main(["calibrate", "--device", "cuda", "--model", "zoo:mlp", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs CUDA" in err and not (tmp_path / "x.json").exists()


def test_the_cli_compares_plans_on_a_profile_file(measured, tmp_path, capsys):
    path = tmp_path / "my-gpu.json"
    profile_from_measurement(measured, name="my calibrated GPU").save(path)
    assert main(["compare", "zoo:mlp", "--topology", "dp=2", "--objective", "speed", "--hardware", str(path)]) == 0
    assert "my calibrated GPU" in capsys.readouterr().out
    assert main(["compare", "zoo:mlp", "--topology", "dp=2", "--hardware", str(tmp_path / "none.json")]) == 2
    assert "no such profile file" in capsys.readouterr().err
