"""The Explorer UI's precision and memory-budget controls, driven headlessly."""
import os

os.environ.setdefault("MPLBACKEND", "Agg")

from snn_explorer.core.precision import Precision
from snn_explorer.explorer import Explorer
from snn_explorer.zoo import build

HW = "A100-SXM-80GB"


def _ui():
    return Explorer.from_zoo(build("mlp"), hardware=HW).ui


def test_precision_control_plans_bf16_behind_its_gate_and_the_comparison_shows_it():
    ui = _ui()
    assert ui.precision.value == "auto" and ui.current.precision == Precision("fp32")
    assert "precision" not in ui.compare_table.index  # fp32 only: the row is not shown
    assert ui.neuron_state_fp32.disabled
    ui.pin()  # the fp32 plan stays in the comparison
    ui.precision.value = "bf16"
    assert ui.current is None and "allow_mixed_precision" in ui.error and "allow_mixed_precision" in ui.message.value
    ui.gates["allow_mixed_precision"].value = True
    assert ui.current.precision == Precision("bf16", keep_neuron_state_fp32=True) and not ui.neuron_state_fp32.disabled
    table = ui.compare_table
    assert list(table.loc["precision"]) == ["fp32", "bf16"]
    fp32 = ui.ex.estimate(ui.ex.plans[0]).per_rank
    bf16 = ui.ex.estimate(ui.current).per_rank
    # layers compute in bf16 while the masters stay fp32: parameters alike, the autocast copies and activations not
    assert fp32["params_bytes"].max() == bf16["params_bytes"].max() > 0
    assert list(table.loc["peak_bytes_max"]) == [ui.ex.estimate(ui.ex.plans[0]).peak_bytes,
                                                 ui.ex.estimate(ui.current).peak_bytes]
    assert table.loc["peak_bytes_max"].iloc[0] != table.loc["peak_bytes_max"].iloc[1]
    ui.neuron_state_fp32.value = False
    assert ui.current.precision.label == "bf16/state-bf16" and "bf16/state-bf16" in ui.compare_table.columns[-1]
    ui.precision.value = "auto"  # the objective's choice with the gate open: bf16, neuron state fp32
    assert ui.current.precision == Precision("bf16") and ui.neuron_state_fp32.disabled
