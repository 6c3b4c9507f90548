"""The precision vocabulary (core.precision), plan()'s choice of it, neuron state kept in fp32 under bf16
layers, and fp16's loss scaler surviving an overflow on real gloo ranks.
(The tests on gloo ranks: tests/ranks/test_precision_ranks.py.)"""
import dataclasses

import pytest
import snntorch
import torch
from torch import nn

import snn_explorer as se
from snn_explorer.core.common import PRECISIONS, Precision, precision_of
from snn_explorer.zoo import build
from snn_explorer.zoo._neurons import ATanSurrogate, MultiStep

GATE = se.DistributedFeatureSet(allow_mixed_precision=True)


# ---- the vocabulary ---------------------------------------------------------------------------------
def test_each_precision_names_its_dtypes():
    fp32, bf16, fp16 = (precision_of(n) for n in PRECISIONS)
    assert (fp32.compute_dtype, fp32.reduce_dtype, fp32.needs_loss_scaler) == (None, None, False)
    assert (bf16.compute_dtype, bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16,) * 3
    assert (fp16.compute_dtype, fp16.reduce_dtype, fp16.needs_loss_scaler) == (torch.float16, torch.float32, True)
    assert {p.master_dtype for p in (fp32, bf16, fp16)} == {torch.float32}
    assert [bf16.itemsize(w) for w in ("compute", "param", "reduce", "state")] == [2, 2, 2, 4]
    assert precision_of("bf16", keep_neuron_state_fp32=False).itemsize("state") == 2
    assert precision_of("bf16", reduce_in_fp32=True).itemsize("reduce") == 4
    assert precision_of("bfloat16") == bf16 and precision_of(None) == fp32
    assert Precision.from_dict(fp16.to_dict()) == fp16


@pytest.mark.parametrize("bad,match", [("fp8", "scaled matmuls"), ("float8", "scaled matmuls"),
                                       ("int8", "expected one of"), (16, "expected one of")])
def test_unknown_precisions_are_refused_with_the_reason(bad, match):
    with pytest.raises(ValueError, match=match):
        precision_of(bad)


def _analysis():
    zoo = build("mlp_all_steps")
    return se.analyze(zoo.model, model_family=zoo.family), zoo.batch_size


def test_plan_keeps_fp32_unless_the_gate_is_open_and_explains_its_choice():
    analysis, batch = _analysis()
    plain = se.plan(analysis=analysis, objective="memory", topology={"dp": 2}, batch_size=batch)
    assert plain.precision == precision_of("fp32")
    with pytest.raises(ValueError, match="allow_mixed_precision"):
        se.plan(analysis=analysis, objective="memory", topology={"dp": 2}, batch_size=batch, options=se.PlanOptions(precision="bf16"))
    chosen = se.plan(analysis=analysis, objective="memory", topology={"dp": 2}, batch_size=batch, features=GATE)
    assert chosen.precision.name == "bf16" and chosen.precision.keep_neuron_state_fp32
    assert any("Chosen for objective 'memory'" in n and "neuron state in fp32" in n for n in chosen.notes)
    explicit = se.plan(analysis=analysis, objective="speed", topology={"dp": 2}, batch_size=batch, features=GATE, options=se.PlanOptions(precision="fp16"))
    assert explicit.precision.needs_loss_scaler and any("loss scaler" in n for n in explicit.notes)
    assert se.SNNDistributedPlan.from_dict(explicit.to_dict()) == explicit
    assert "fp16" in repr(explicit) and explicit.layout_key() != dataclasses.replace(
        explicit, precision="bf16").layout_key()
    with pytest.raises(ValueError, match="fp8 training needs"):
        se.plan(analysis=analysis, objective="speed", topology={"dp": 2}, batch_size=batch, features=GATE, options=se.PlanOptions(precision="fp8"))


def test_a_saved_plan_without_precision_loads_as_fp32():
    analysis, batch = _analysis()
    data = se.plan(analysis=analysis, objective="speed", topology={"dp": 2}, batch_size=batch).to_dict()
    del data["precision"]
    assert se.SNNDistributedPlan.from_dict(data).precision.name == "fp32"


# ---- neuron state: fp32 under bf16 layers keeps the spikes a bf16 membrane drops ----------------------
T, N, F, H = 50, 16, 64, 128
BETA, DRIVE = 0.95, 0.05  # a membrane leak of 5 % per step; the mean input current puts v* = DRIVE/(1-BETA) at threshold


def _lif_model():
    """Linear -> multi-step snntorch Leaky over T=50 steps; positive weights give each neuron a small
    steady current (mean DRIVE per step) that its membrane accumulates towards the threshold."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(F, H), MultiStep(snntorch.Leaky(beta=BETA, init_hidden=True,
                                                                    spike_grad=ATanSurrogate())))
    with torch.no_grad():
        model[0].weight.uniform_(0, 2 * DRIVE / (0.5 * F))
        model[0].bias.zero_()
    return model, torch.bernoulli(torch.full((T, N, F), 0.5))


def _spike_count(precision) -> float:
    model, x = _lif_model()
    plan = se.plan(analysis=se.analyze(model), objective="speed", topology=1, batch_size=N, features=GATE, options=se.PlanOptions(precision=precision))
    runtime = se.apply(model=model, plan=plan, device_type="cpu")
    runtime.reset_state()
    with torch.no_grad():
        return float(runtime.model(x).sum())


def test_fp32_neuron_state_keeps_the_spikes_a_bf16_membrane_drops():
    """Over 50 time steps a bf16 membrane (8 significant bits: near v = 1 its spacing is 2**-8 = 0.004,
    a tenth of each step's input) rounds its leak and inputs away and fires about a third less; with the
    state in fp32 under the same bf16 layer the count matches fp32's within 2 % (only the layer's
    current is rounded, once per step, not accumulated). Measured: 390 / 390 / 256 spikes."""
    fp32 = _spike_count("fp32")
    fp32_state = _spike_count(Precision("bf16"))
    bf16_state = _spike_count(Precision("bf16", keep_neuron_state_fp32=False))
    assert fp32 > 100, f"only {fp32} spikes in the fp32 run: nothing to compare"
    assert abs(fp32_state - fp32) <= 0.02 * fp32, (fp32, fp32_state)
    assert bf16_state <= 0.8 * fp32, f"bf16 state fired {bf16_state} of fp32's {fp32}: no visible drift"


def test_neurons_compute_in_their_state_dtype_while_layers_run_in_bf16():
    seen = {}
    model, x = _lif_model()
    plan = se.plan(analysis=se.analyze(model), objective="speed", topology=1, batch_size=N, features=GATE, options=se.PlanOptions(precision=Precision("bf16", keep_neuron_state_fp32=False)))
    runtime = se.apply(model=model, plan=plan, device_type="cpu")
    def linear(_module, _args, out):
        seen.setdefault("linear", out.dtype)

    def neuron(module, _args, _out):
        seen.setdefault("mem", module.mem.dtype)
    model[0].register_forward_hook(linear)
    model[1].neuron.register_forward_hook(neuron)
    runtime.reset_state()
    runtime.model(x[:2])
    assert seen == {"linear": torch.bfloat16, "mem": torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}


# ---- this machine's half-precision rates ----------------------------------------------------------------
def test_calibration_measures_half_precision_rates_that_half_precision_plans_compute_at():
    """The calibration's probes time bf16 (and fp16, which CPU autocast offers in torch 2.13) matmuls and adds
    on tensors of that dtype; a bf16 plan's profile then takes the measured matmul rate, and the measured
    elementwise rate where its neurons compute in bf16 too. Datasheet profiles and fp32 plans are unchanged."""
    from snn_explorer.estimator.calibration.probes import half_probes
    from snn_explorer.estimator.timing.hardware import HardwareProfile, hardware_profile

    rates = half_probes(torch.device("cpu"))
    assert set(rates) == {"bf16", "fp16"}, rates
    assert all(v > 0 for r in rates.values() for v in r.values()), rates
    base = hardware_profile("A100-SXM-80GB")
    # a calibrated profile: measured rates, so no datasheet fractions (achieved) scale them
    local = dataclasses.replace(base, device="cpu", half_flops_per_s=None, measured_half=rates, achieved={})
    assert HardwareProfile.from_dict(local.to_dict()) == local
    bf16 = local.in_precision(Precision("bf16"))
    assert bf16.flops(2) == rates["bf16"]["flops_per_s"] * local.efficiency and bf16.bytes_per_s == local.bytes_per_s
    state16 = local.in_precision(Precision("bf16", keep_neuron_state_fp32=False))
    assert state16.bytes_per_s == rates["bf16"]["bytes_per_s"]
    assert local.in_precision(Precision("fp16")).half_flops_per_s == rates["fp16"]["flops_per_s"]
    assert local.in_precision(Precision("fp32")) is local and base.in_precision(Precision("bf16")) is base
    with pytest.raises(ValueError, match=r"measured_half\['fp8'\]"):
        dataclasses.replace(local, measured_half={"fp8": rates["bf16"]})
