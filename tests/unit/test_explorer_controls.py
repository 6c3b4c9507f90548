"""The Explorer UI's precision and memory-budget controls, driven headlessly."""
import os
import re

os.environ.setdefault("MPLBACKEND", "Agg")

from snn_explorer.core.common import Precision
from snn_explorer.explorer import Explorer
from snn_explorer.explorer.compare import format_bytes
from snn_explorer.explorer.fit_view import fit_chart, fit_table
from snn_explorer.explorer.ui import TABS, ExplorerUI
from snn_explorer.zoo import build

HW = "A100-SXM-80GB"


def _text(ui, tab="Fit") -> str:
    return "\n".join(o["data"]["text/plain"] for o in ui.outputs[tab].outputs)


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


def test_fit_tab_shows_the_fastest_fitting_plan_its_levers_every_candidate_and_the_pareto_front():
    ex = Explorer.from_zoo(build("mlp"), hardware=HW)
    ui = ExplorerUI(ex, world_size=2, auto_estimate=False)  # nothing estimated until the Fit tab asks
    ui.tabs.selected_index = TABS.index("Fit")
    assert "no memory budget" in _text(ui)
    ui.gates["allow_spike_compression"].value = True  # one lever: few candidates, a fast search
    unlevered = {p: ex.estimate(p).peak_bytes for p in ex.enumerate(2, features={"allow_zero_optimizer": True})}
    lowest = min(unlevered.values())
    ex.clear()  # enumerate added them
    ui.memory_budget.value = (lowest - 1) / 2 ** 20  # below every plan without levers: only a lever can fit it
    outputs = ui.outputs["Fit"].outputs
    assert len(outputs) == 3, _text(ui)
    result = ui.fit()
    chosen = result.table.iloc[0]
    assert chosen["outcome"] == "chosen" and chosen["levers"] != "-" and chosen["peak_bytes"] <= lowest - 1
    summary, table, chart = (o["data"] for o in outputs)
    assert chosen["plan"] in summary["text/plain"] and chosen["levers"] in summary["text/plain"]
    # every candidate is listed with why it lost; the chosen one's lever saves its peak without the lever minus its own
    assert table["text/plain"].count("\n") == len(result.table)
    saved = format_bytes(int(chosen["unlevered_peak_bytes"] - chosen["peak_bytes"]))
    assert fit_table(result).iloc[0]["lever saves"] == saved and saved != "0 B"
    raw = re.compile(r"\b\d{4,} B\b")  # the fit's reasons count bytes; the view says them in KiB / MiB as its cells do
    assert any(raw.search(w) for w in result.table["why"]) and not any(raw.search(w) for w in fit_table(result)["why"])
    assert "over_budget" in table["text/plain"] and "spikes:1bit" in table["text/plain"]
    assert "image/png" in chart
    fig = fit_chart(result)
    front = [line for line in fig.axes[0].get_lines() if line.get_label() == "Pareto front"][0]
    assert len(front.get_xdata()) == len(result.pareto) >= 1
    pinned = ui.pin_fitted()
    assert pinned == result.plan and ex.plans == [result.plan]
