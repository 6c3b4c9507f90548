"""explorer/ui.py driven headlessly: set widget values, read the widget state it wrote."""
import os

os.environ.setdefault("MPLBACKEND", "Agg")

import ipywidgets as w
import pytest

from snn_explorer.explorer import Explorer
from snn_explorer.explorer import explorer as explorer_module
from snn_explorer.explorer.ui import TABS, ExplorerUI, fit_sizes
from snn_explorer.zoo import SpikingMLP, build


def _fresh():
    return Explorer.from_zoo(build("mlp"))


def _data(ui, tab="Compare"):
    outputs = ui.outputs[tab].outputs
    assert len(outputs) == 1 and outputs[0]["output_type"] == "display_data"
    return outputs[0]["data"]


def _columns(ui):
    return [] if ui.compare_table is None else list(ui.compare_table.columns)


@pytest.fixture()
def ui():
    return _fresh().ui


def test_display_shows_the_ui_widget():
    ex = _fresh()
    bundle = ex._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/plain"] == repr(ex)
    assert isinstance(ex.ui, ExplorerUI) and ex.ui is ex.ui and isinstance(ex.ui.widget, w.VBox)
    assert [ex.ui.tabs.get_title(i) for i in range(len(TABS))] == list(TABS)


def test_initial_state_compares_the_current_plan(ui):
    assert ui.current.mode == "dp" and ui.current.world_size == 4 and ui.error == ""
    assert _columns(ui) == ["current dp+zero dp=4"]
    data = _data(ui)
    assert "T_snn-compare" in data["text/html"] and "peak_bytes_max" in data["text/plain"]
    assert "not pinned" in ui.plan_list.value and ui.message.value == ""


def test_topology_sliders_stay_on_the_world_size_and_replan(ui):
    before = _data(ui)["text/html"]
    ui.tp.value = 2
    assert ui.dp.value == 2 and ui.current.topology.dims == {"dp": 2, "tp": 2}
    ui.objective.value = "memory"
    assert ui.current.mode == "fsdp2_tp" and _columns(ui) == ["current fsdp2_tp+reshard dp=2 x tp=2"]
    assert _data(ui)["text/html"] != before
    ui.world_size.value = 8
    assert list(ui.tp.options) == [1, 2, 4, 8] and (ui.dp.value, ui.tp.value) == (4, 2)
    ui.dp.value = 8
    assert ui.tp.value == 1 and ui.current.topology.dims == {"dp": 8}
    assert ui.compare_table.loc["batch_per_rank"].tolist() == [1]


def test_each_mesh_size_is_a_button_that_picks_it(ui):
    """A size is clicked, not typed: a selection slider's readout looked like a box and ignored a typed 4."""
    assert isinstance(ui.tp, w.ToggleButtons) and ui.tp._options_labels == ("1", "2", "4")
    ui.tp.index = 2  # what a click on the button "4" sends
    assert (ui.dp.value, ui.tp.value, ui.pp.value) == (1, 4, 1) and ui.current.topology.dims == {"tp": 4}


def test_mode_gates_batch_time_steps_and_budget_change_the_comparison(ui):
    ui.mode.value = "fsdp2"
    assert ui.current.mode == "fsdp2" and ui.compare_table.loc["mode"].tolist() == ["fsdp2"]
    ui.mode.value = "dp"
    assert ui.current.optimizer_strategy == "zero"
    ui.gates["allow_zero_optimizer"].value = False
    assert ui.current.optimizer_strategy == "none"
    ui.batch_size.value = 16
    assert ui.compare_table.loc["batch_per_rank"].tolist() == [4]
    ui.time_steps.value = 4
    assert ui.compare_table.loc["time_steps"].tolist() == [4]
    peak = ui.compare_table.loc["peak_bytes_max"].iloc[0]
    ui.memory_budget.value = peak / 2 ** 20 * 2
    assert ui.compare_table.loc["fits_budget"].tolist() == ["yes"]
    ui.memory_budget.value = peak / 2 ** 20 / 2
    assert ui.compare_table.loc["fits_budget"].tolist() == ["no"]


def test_invalid_choices_show_a_message_not_a_traceback():
    ex = Explorer(SpikingMLP(in_features=16, hidden=(32, 32), num_classes=10),
                  example_input=build("mlp", batch_size=8).example_input[:, :, :16])
    ui = ex.ui
    ui.mode.value = "tp"
    ui.tp.value = 4
    assert ui.current is None and "tp=4 does not divide net.4.out_features=10" in ui.error
    assert "does not divide" in ui.message.value and "Traceback" not in ui.message.value
    assert "no plan to compare" in _data(ui)["text/plain"] and ui.plan_list.value.endswith("none")
    assert _columns(ui) == []
    ui.mode.value = "fsdp2_tp"
    ui.tp.value = 2
    assert ui.current.mode == "fsdp2_tp" and ui.message.value == ""
    ui.mode.value = "auto"
    ui.batch_size.value = 6
    ui.tp.value = 1
    assert ui.current is None and "not divisible by dp=4" in ui.message.value
    ui.tabs.selected_index = TABS.index("Launch")
    assert "not divisible" in _data(ui, "Launch")["text/plain"]


def test_pinning_keeps_plans_in_the_comparison(ui):
    pinned = ui.pin()
    assert ui.ex.plans == [pinned] and _columns(ui) == ["#1 dp+zero dp=4"]
    ui.tp.value = 4
    assert _columns(ui) == ["#1 dp+zero dp=4", "current tp tp=4"]
    assert "#1 dp+zero dp=4" in ui.plan_list.value and "current tp tp=4 (not pinned)" in ui.plan_list.value
    ui.pin()
    ui.mode.value = "fsdp2"
    ui.tp.value = 1
    assert _columns(ui) == ["#1 dp+zero dp=4", "#2 tp tp=4", "current fsdp2 dp=4"]
    ui.pin_button.click()
    assert len(ui.ex.plans) == 3 and _columns(ui) == ["#1 dp+zero dp=4", "#2 tp tp=4", "#3 fsdp2 dp=4"]
    ui.clear_button.click()
    assert ui.ex.plans == [] and _columns(ui) == ["current fsdp2 dp=4"]


def test_plans_added_through_the_api_show_as_pinned(ui):
    ui.ex.enumerate(world_size=4)
    ui.refresh()
    assert len(_columns(ui)) == 5 and "not pinned" not in ui.plan_list.value


def test_tabs_render_modules_candidates_charts_and_launch(ui):
    assert ui.outputs["Modules"].outputs == ()  # rendered when shown
    ui.tabs.selected_index = TABS.index("Modules")
    assert "net.4" in _data(ui, "Modules")["text/html"] and "tp_style" in _data(ui, "Modules")["text/plain"]
    ui.tabs.selected_index = TABS.index("Candidates")
    assert _data(ui, "Candidates")["text/plain"].count("Linear") == 3
    ui.tabs.selected_index = TABS.index("Charts")
    assert "image/png" in _data(ui, "Charts")
    ui.chart.value = "mesh"
    ui.tp.value = 2  # re-renders the visible tab
    assert "what each rank holds" in _data(ui, "Charts")["text/plain"]
    ui.tabs.selected_index = TABS.index("Launch")
    launch = _data(ui, "Launch")["text/plain"]
    assert "result = ex.launch(plan, steps=5)" in launch and '"mode": "fsdp2_tp"' in launch


def test_without_an_example_input_the_comparison_says_why():
    ex = Explorer(SpikingMLP(in_features=8, hidden=(8,), num_classes=4), batch_size=4)
    assert "cannot estimate" in _data(ex.ui)["text/plain"] and ex.ui.current is not None


def test_opening_estimates_only_the_shown_comparison_and_matches_the_eager_path():
    """Opening is lazy: only the current plan is estimated (one TP layout, no replica built); a plan
    reached later is measured then, and gives the numbers Explorer.prepare's eager path gives."""
    from snn_explorer.estimator import model_profile

    lazy = Explorer.from_zoo(build("vgg"))
    ui = lazy.ui
    assert ui.error == "" and len(lazy._estimates) == 1
    assert not model_profile(lazy.model, lazy.example_input, lazy.labels).replicas, "no TP layout measured on open"
    ui.tp.value = 2
    ui.gates["allow_experimental_conv_tp"].value = True  # a TP layout: its replica measured now
    current = ui.current
    eager = Explorer.from_zoo(build("vgg"))
    assert eager.prepare(4) > len(lazy._estimates)
    a, b = lazy.estimate(current), eager.estimate(current)
    assert current.tp_size == 2 and a.peak_bytes > 0 and a.comm_bytes > 0
    assert a.per_rank.equals(b.per_rank) and a.collectives.equals(b.collectives)  # step times: timed, not compared


def test_controls_other_than_the_work_reestimate_without_running_the_model():
    """After Explorer.prepare, dp x tp, mode, objective, gates and budget never run the model (its
    profile copy or a TP replica)."""
    from snn_explorer.estimator import model_profile

    ex = Explorer.from_zoo(build("vgg"))
    ui = ex.ui
    ex.prepare(ui.world_size.value)
    profile = model_profile(ex.model, ex.example_input, ex.labels)
    assert profile.replicas, "TP layouts were prepared"
    runs = []
    for model in [profile.model, *profile.replicas.values()]:
        model.register_forward_pre_hook(lambda m, a: runs.append(m))
    seen = set()
    for tp in (1, 2, 4, 2, 1):
        for objective in ("speed", "memory", "capacity"):
            ui.tp.value, ui.objective.value = tp, objective
            for gate in ("allow_experimental_conv_tp", "allow_zero_optimizer"):
                ui.gates[gate].value = not ui.gates[gate].value
                seen.add(_data(ui)["text/plain"])
    ui.memory_budget.value = 1.0
    ui.mode.value = "fsdp2"
    assert len(seen) > 5 and ui.error == ""  # the comparison really changed
    assert runs == []
    ui.batch_size.value = ui.batch_size.value * 2  # new work: measured when the comparison needs it
    assert runs


def test_pinning_the_same_layout_twice_keeps_one_column_and_says_so(ui):
    first = ui.pin()
    ui.pin()
    assert ui.ex.plans == [first] and _columns(ui) == ["#1 dp+zero dp=4"]
    assert "current = #1 (already pinned)" in ui.plan_list.value
    ui.objective.value = "memory"  # another objective, same mode forced: the same layout (dp ignores memopt)
    ui.mode.value = "dp"
    assert ui.current.objective == "memory" and ui.current != first
    assert ui.current.layout_key() == first.layout_key()
    ui.pin()
    assert ui.ex.plans == [first] and _columns(ui) == ["#1 dp+zero dp=4"]
    ui.mode.value = "fsdp2"  # a different layout appears as the current column again
    assert _columns(ui) == ["#1 dp+zero dp=4", "current fsdp2+reshard dp=4"] and "already pinned" not in ui.plan_list.value


def test_hardware_choice_re_predicts_step_time_and_world_size_reaches_1024(ui):
    assert ui.world_size.max == 1024 and "A100-SXM-80GB" in ui.hardware.options
    ui.hardware.value = "A100-SXM-80GB"
    a100 = ui.compare_table.loc["step_time_s"].iloc[0]
    ui.hardware.value = "RTX-4090"
    assert ui.ex.hardware == "RTX-4090" and ui.compare_table.loc["step_time_s"].iloc[0] != a100
    ui.chart.value = "step time"
    ui.tabs.selected_index = TABS.index("Charts")
    assert "image/png" in _data(ui, "Charts")


@pytest.fixture(scope="module")
def pipelined():
    """An Explorer of a model the analysis cuts into 5 pipeline units (8 samples: 4 per dp replica on 4 ranks)."""
    ex = Explorer.from_zoo(build("mlp_all_steps"))
    assert len(ex.analysis.pipeline_units) == 5 and ex.batch_size == 8
    return ex


@pytest.fixture()
def pp_ui(pipelined):
    pipelined.clear()
    return ExplorerUI(pipelined)


def test_fit_sizes_keeps_the_moved_slider_then_pp_then_tp():
    """The moved size stays; pp, then tp keep what of theirs divides the ranks left; the last one takes the rest."""
    assert fit_sizes(8, {"pp": 2, "dp": 4, "tp": 4}, "tp") == {"pp": 2, "dp": 1, "tp": 4}
    assert fit_sizes(8, {"pp": 2, "dp": 8, "tp": 1}, "dp") == {"pp": 1, "dp": 8, "tp": 1}
    assert fit_sizes(8, {"pp": 2, "dp": 2, "tp": 1}, "dp") == {"pp": 2, "dp": 2, "tp": 2}  # tp takes the rest
    assert fit_sizes(8, {"pp": 4, "dp": 4, "tp": 2}, "pp") == {"pp": 4, "dp": 1, "tp": 2}
    assert fit_sizes(6, {"pp": 4, "dp": 1, "tp": 1}) == {"pp": 2, "dp": 3, "tp": 1}  # a new world size


def test_pp_slider_gives_a_pipeline_plan_with_its_row_in_the_comparison(pp_ui):
    ui = pp_ui
    assert ui.current.mode == "dp" and all(c.disabled for c in (ui.pp_schedule, ui.pp_microbatches,
                                                                 ui.pp_virtual_stages))
    assert "pipeline" not in ui.compare_table.index  # rows for pipelines only when one is compared
    ui.pp.value = 2
    assert (ui.pp.value, ui.dp.value, ui.tp.value) == (2, 2, 1) and ui.error == ""
    assert ui.current.uses_pp and ui.current.topology.dims == {"pp": 2, "dp": 2}
    assert not ui.pp_schedule.disabled
    # the planner's choice for 4 samples per replica on pp=2: 2 virtual stages, 4 micro-batches (issue 13's rule)
    assert _columns(ui) == ["current pp pp=2 x dp=2 interleaved m=4 v=2"]
    # the Explorer balances the stages by the profile (tests/unit/test_pipeline_estimate.py checks that layout)
    assert ui.compare_table.loc["pipeline"].tolist() == [f"interleaved m=4 v=2 stages {ui.current.pp_layout}"]
    assert ui.compare_table.loc["bubble_fraction"].tolist() == [pytest.approx(1 / (2 * 4 + 1))]  # (pp-1)/(Vm+pp-1)
    assert "11.1%" in _data(ui)["text/plain"]
    ui.tp.value = 2  # dp gives way, pp stays: a 3-D plan, its stages tensor-parallel
    assert (ui.pp.value, ui.dp.value) == (2, 1) and ui.error == ""
    assert ui.current.mode == "pp_tp" and ui.current.topology.dims == {"pp": 2, "tp": 2}
    assert _columns(ui) == [f"current pp_tp pp=2 x tp=2 {ui.current.pp_schedule} m={ui.current.pp_microbatches}"]
    ui.dp.value = 4
    assert (ui.pp.value, ui.tp.value) == (1, 1) and ui.current.mode == "dp"
    ui.mode.value = "pp"
    assert ui.current is None and "mode 'pp' needs the dim(s) ['pp']" in ui.error
    ui.pp.value = 4
    # 4 stages of mlp_all_steps' 5 units (3 with weights) leave a rank only a neuron: refused, named
    assert ui.dp.value == 1 and ui.current is None and "without a trainable parameter" in ui.error
    ui.world_size.value = 8
    assert list(ui.pp.options) == [1, 2, 4, 8] and (ui.pp.value, ui.dp.value, ui.tp.value) == (4, 2, 1)


def test_the_mode_list_offers_pipelines_with_fsdp2_stages(pp_ui):
    """Mode pp_fsdp2 from the list on the pp slider's mesh: the stages FSDP2-sharded over dp; tp=2 on 4 ranks leaves
    FSDP2 no dp rank, refused with the reason; the list also offers pp_fsdp2_tp."""
    ui = pp_ui
    ui.pp.value = 2
    replicated = ui.ex.estimate(ui.current).per_rank
    ui.mode.value = "pp_fsdp2"
    assert ui.error == "" and ui.current.mode == "pp_fsdp2" and ui.current.topology.dims == {"pp": 2, "dp": 2}
    assert _columns(ui)[0].startswith("current pp_fsdp2 pp=2 x dp=2")
    sharded = ui.ex.estimate(ui.current).per_rank
    assert (sharded["optimizer_bytes"] < replicated["optimizer_bytes"]).all()
    ui.tp.value = 2
    assert ui.current is None and "mode 'pp_fsdp2' needs the dim(s) ['dp']" in ui.error
    assert "pp_fsdp2_tp" in ui.mode.options


def test_pp_schedule_micro_batches_and_virtual_stages_reach_the_plan(pp_ui):
    ui = pp_ui
    ui.pp.value = 2
    ui.pp_schedule.value = "1f1b"
    assert (ui.current.pp_schedule, ui.current.pp_virtual_stages, ui.current.pp_microbatches) == ("1f1b", 1, 4)
    ui.pp_microbatches.value = 2
    assert ui.current.pp_microbatches == 2 and _columns(ui) == ["current pp pp=2 x dp=2 1f1b m=2"]
    ui.pp_microbatches.value = 3
    assert ui.current is None and "invalid choice: pp_microbatches=3 does not divide the per-rank batch 4" \
        in ui.message.value
    ui.pp_microbatches.value = 4
    ui.pp_schedule.value = "gpipe"
    assert (ui.current.pp_schedule, ui.current.pp_microbatches) == ("gpipe", 4)
    ui.pp_schedule.value = "interleaved"
    ui.pp_virtual_stages.value = 2
    assert (ui.current.pp_schedule, ui.current.pp_virtual_stages, ui.current.pp_stages) == ("interleaved", 2, 4)
    ui.pp_virtual_stages.value = 3
    assert ui.current is None and "pp_microbatches=4 is fewer than pp * virtual stages = 2 * 3 = 6" in ui.error
    ui.pp_schedule.value, ui.pp_virtual_stages.value, ui.pp_microbatches.value = "1f1b", 0, 0
    pinned = ui.pin()
    ui.pp.value = 1  # the pinned pipeline stays; the other controls are off again and ignored
    assert ui.pp_microbatches.disabled and ui.choices()["options"].pp_schedule is None and ui.current.mode == "dp"
    assert ui.ex.plans == [pinned] and _columns(ui) == ["#1 pp pp=2 x dp=2 1f1b m=4", "current dp+zero dp=4"]
    assert ui.compare_table.loc["bubble_fraction"].tolist() == [pytest.approx(1 / 5), 0.0]
    assert ui.compare_table.loc["pipeline"].tolist() == [f"1f1b m=4 stages {pinned.pp_layout}", ""]


def test_pipeline_chart_draws_a_pipeline_plan_and_says_when_there_is_none(pp_ui):
    ui = pp_ui
    ui.tabs.selected_index = TABS.index("Charts")
    ui.chart.value = "pipeline"
    assert "the plan has no pipeline: pp=1 (mode 'dp')" in _data(ui, "Charts")["text/plain"]
    ui.pp.value = 2
    ui.pp_schedule.value = "1f1b"  # re-renders the visible tab
    data = _data(ui, "Charts")
    assert "image/png" in data and "1f1b: 4 micro-batches on pp=2" in data["text/plain"]
    ui.chart.value = "mesh"  # a dp x tp grid does not describe stages: said, not drawn wrong
    assert "cannot show Charts: the shard layout covers dp x tp meshes" in _data(ui, "Charts")["text/plain"]


def test_without_estimating_on_change_the_ui_opens_without_model_runs_and_estimates_on_the_button(monkeypatch):
    ex = _fresh()
    runs = []
    real = explorer_module.estimate_plan
    monkeypatch.setattr(explorer_module, "estimate_plan", lambda *a, **k: runs.append(1) or real(*a, **k))
    ui = ExplorerUI(ex, auto_estimate=False)
    assert runs == [] and ui.compare_table is None and not ui.auto_estimate.value
    assert "not estimated yet: current dp+zero dp=4" in _data(ui)["text/plain"] and "press 'estimate'" in \
        _data(ui)["text/plain"]
    ui.tabs.selected_index = TABS.index("Charts")  # the memory chart needs estimates too: it waits
    assert "not estimated yet" in _data(ui, "Charts")["text/plain"] and runs == []
    ui.tabs.selected_index = TABS.index("Modules")  # what needs no estimate is there
    assert "text/html" in _data(ui, "Modules")
    ui.tabs.selected_index = TABS.index("Compare")
    ui.estimate_button.click()
    assert len(runs) == 1 and _columns(ui) == ["current dp+zero dp=4"]
    ui.tp.value = 2  # a new plan waits again; the estimated one is shown from the cache
    assert len(runs) == 1 and ui.compare_table is None and "not estimated yet" in _data(ui)["text/plain"]
    ui.tp.value = 1
    assert len(runs) == 1 and _columns(ui) == ["current dp+zero dp=4"]
    ui.auto_estimate.value = True  # estimating on change: every change estimates again
    ui.tp.value = 2
    assert len(runs) == 2 and ui.compare_table is not None and _columns(ui)[0].startswith("current ")


def test_the_ui_estimates_on_change_by_default_up_to_the_module_limit(monkeypatch):
    from snn_explorer.explorer import ui as ui_module

    assert ExplorerUI(_fresh()).auto_estimate.value  # the zoo's mlp: well under the limit
    monkeypatch.setattr(ui_module, "AUTO_ESTIMATE_MAX_MODULES", 3)
    small_limit = ExplorerUI(_fresh())
    assert not small_limit.auto_estimate.value and small_limit.compare_table is None
