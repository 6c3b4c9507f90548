"""explorer/: the Explorer object's tables, plans, estimates, charts and reprs (no widgets, no ranks).
(The tests on gloo ranks: tests/ranks/test_explorer_ranks.py.)"""
import os
import re
import subprocess
import sys

os.environ.setdefault("MPLBACKEND", "Agg")

import pytest
from matplotlib.figure import Figure

import snn_explorer as se
from snn_explorer.explorer import COMPARE_ROWS, FIGSIZE, Explorer, comm_chart, memory_chart, pareto_chart, pareto_front
from snn_explorer.explorer.compare import BEST_LOW, MEMORY_ROWS, STYLER_UUID, best_columns, unique_labels
from snn_explorer.zoo import SpikingMLP, build


@pytest.fixture(scope="module")
def ex():
    explorer = Explorer.from_zoo("mlp")
    explorer.enumerate(world_size=4)
    return explorer


def test_exported_from_the_package():
    assert se.Explorer is Explorer and "Explorer" in se.__all__


def test_modules_table_has_the_issue_columns_and_reasons():
    zoo = build("vgg")
    ex = Explorer(zoo.model, example_input=zoo.example_input, model_family=zoo.family)
    mods = ex.modules
    for col in ("path", "type", "depth", "params", "stateful", "snn_library", "tp_candidate", "tp_style",
                "sharded_dim", "not_candidate_because"):
        assert col in mods.columns
    assert len(mods) == sum(1 for n, _ in zoo.model.named_modules() if n)
    fc1 = mods.set_index("path").loc["classifier.fc1"]
    assert fc1.tp_candidate and fc1.tp_style == "colwise" and fc1.sharded_dim == "out_features"
    assert fc1.params == sum(p.numel() for p in zoo.model.get_submodule("classifier.fc1").parameters())
    conv = mods[mods["type"] == "Conv2d"].iloc[0]
    assert not conv.tp_candidate and "allow_experimental_conv_tp" in conv.not_candidate_because
    neurons = mods[mods["stateful"]]
    assert len(neurons) == len(ex.analysis.memory_module_names) and set(neurons["snn_library"]) == {"snntorch"}
    assert list(ex.candidates["path"]) == list(ex.analysis.tensor_parallel_candidate_names)
    gated = ex.add_plan(objective="memory", topology={"dp": 2, "tp": 2}, features={"allow_experimental_conv_tp": True})
    sharded = ex.modules_for(gated).set_index("path").loc[gated.tensor_parallel_plan.keys()]
    assert (sharded["not_candidate_because"] == "").all() and (sharded["sharded_dim"] != "").all()


def test_modules_table_says_which_size_tp_fails_to_divide():
    model = SpikingMLP(in_features=16, hidden=(32, 32), num_classes=10)
    ex = Explorer(model, batch_size=4)
    plan = ex.add_plan(objective="memory", topology={"dp": 2, "tp": 2})
    table = ex.modules_for(plan)
    assert (table["not_candidate_because"][table["tp_candidate"]] == "").all()
    four = ex.modules_for(None, tp_size=4).set_index("path")
    assert four.loc["net.4", "not_candidate_because"] == "tp=4 does not divide out_features=10"


def test_plan_enumerate_and_plan_list(ex):
    modes = [(p.mode, p.optimizer_strategy) for p in ex.plans]
    assert sorted(modes) == [("dp", "none"), ("dp", "zero"), ("fsdp2", "none"), ("fsdp2_tp", "none"), ("tp", "none")]
    times = [ex.estimate(p).step_time_s for p in ex.plans]
    assert times == sorted(times)  # objective "speed": fastest predicted step first
    budget = min(ex.estimate(p).peak_bytes for p in ex.plans)  # only the leanest plans fit: they lead
    ranked = ex.enumerate(world_size=4, memory_budget=budget)
    fits = [ex.estimate(p).peak_bytes <= budget for p in ranked]
    assert fits == sorted(fits, reverse=True) and 0 < sum(fits) < len(fits)
    again = ex.enumerate(world_size=4)
    assert len(ex.plans) == 5 and len(again) == 5  # the same plans are not added twice
    other = Explorer.from_zoo("mlp")
    p = other.add_plan(objective="memory", topology={"dp": 2, "tp": 2})
    assert other.plans == [p] and p.mode == "fsdp2_tp"
    other.remove(p)
    assert other.plans == []
    with pytest.raises(ValueError, match="does not divide|not divisible"):
        other.add_plan(topology={"dp": 3}, batch_size=8)


def test_compare_rows_come_from_the_estimator(ex):
    table = ex.compare()
    assert list(table.index) == list(COMPARE_ROWS) and len(table.columns) == len(ex.plans)
    for row in ("mode", "mesh", "optimizer_strategy", "batch_per_rank", "rationale", "notes", "peak_bytes_max",
                "comm_bytes_per_step"):
        assert row in table.index
    for col, plan in zip(table.columns, ex.plans):
        est = ex.estimate(plan)
        assert table.loc["peak_bytes_max", col] == est.peak_bytes == est.per_rank["peak_bytes"].max()
        assert table.loc["comm_bytes_per_step", col] == est.collectives["bytes"].sum()
        assert table.loc["batch_per_rank", col] == plan.per_rank_batch
        for row in MEMORY_ROWS:
            assert table.loc[row, col] == est.per_rank[row].max()
    assert ex.estimate(ex.plans[0]) is ex.estimate(ex.plans[0])  # cached
    subset = ex.compare(ex.plans[:2])
    assert list(subset.columns) == unique_labels(ex.plans[:2])


def test_compare_budget_and_time_steps(ex):
    tight = ex.compare(memory_budget=150 * 2 ** 10)
    peaks = tight.loc["peak_bytes_max"]
    assert list(tight.loc["fits_budget"]) == ["yes" if p <= 150 * 2 ** 10 else "no" for p in peaks]
    assert set(tight.loc["fits_budget"]) == {"yes", "no"}
    longer = ex.compare(time_steps=16)
    assert set(longer.loc["time_steps"]) == {16}
    assert (longer.loc["activations_bytes"] > ex.compare().loc["activations_bytes"]).all()


def test_styler_highlights_the_best_value_per_row_with_a_fixed_uuid(ex):
    table = ex.compare()
    html = ex.compare(styled=True).to_html()
    assert f"T_{STYLER_UUID}" in html and html == ex.compare(styled=True).to_html()
    best = best_columns(table, "peak_bytes_max")
    assert best == [table.loc["peak_bytes_max"].astype(int).idxmin()]
    marked = html.count("font-weight: bold")
    assert marked >= 1
    highlighted = sum(len(best_columns(table, r)) for r in BEST_LOW)
    assert html.count("background-color: #d4edda") <= highlighted  # one CSS rule per highlighted cell at most


def test_text_tables_for_a_terminal(ex):
    text = ex.compare_text()
    assert "peak_bytes_max" in text and "KiB" in text and "<" not in text
    assert text == ex.compare_text()


def test_estimates_need_an_example_input():
    ex = Explorer(SpikingMLP(in_features=8, hidden=(8,), num_classes=4))
    ex.add_plan(topology={"dp": 2}, batch_size=2)
    with pytest.raises(ValueError, match="example_input"):
        ex.compare()


def test_charts_are_figures_of_the_fixed_size_with_one_bar_per_rank_and_component(ex):
    ests = ex.estimates()
    ranks = sum(e.plan.world_size for e in ests)
    for fig in (ex.memory_chart(), ex.comm_chart(), ex.pareto_chart(), ex.mesh_chart(ex.plans[-1])):
        assert isinstance(fig, Figure)
        assert tuple(fig.get_size_inches()) == FIGSIZE
    mem = ex.memory_chart().axes[0]
    assert len(mem.patches) == len(MEMORY_ROWS) * ranks
    kinds = {f"{r.mesh_dim} {r.kind}" for e in ests for r in e.collectives.itertuples()}
    for measure, total in (("buffer", lambda e: e.comm_bytes), ("wire", lambda e: e.wire_bytes)):
        comm = ex.comm_chart(measure=measure).axes[0]
        assert len(comm.patches) == len(kinds) * len(ests)
        assert ("wire" in comm.get_title()) == (measure == "wire") and measure in comm.get_ylabel()
        heights = {}
        for bar in comm.patches:
            heights[round(bar.get_x(), 3)] = heights.get(round(bar.get_x(), 3), 0) + bar.get_height()
        assert [round(h * 2 ** 20) for h in heights.values()] == pytest.approx([total(e) for e in ests], abs=2)
    assert any(e.wire_bytes != e.comm_bytes for e in ests)  # the two measures differ on these plans
    pareto = ex.pareto_chart().axes[0]
    assert len(pareto.collections[0].get_offsets()) == len(ests)
    front = pareto_front([(e.peak_bytes, e.step_time_s) for e in ests])
    assert len(pareto.lines[0].get_xdata()) == len(front) >= 1
    assert len(ex.mesh_chart(ex.plans[-1]).axes[0].patches) == ex.plans[-1].world_size
    assert len(memory_chart([]).axes) == 1 and comm_chart([]) and pareto_chart([])
    steps = ex.step_time_chart(measured=[None] * len(ests)).axes[0]
    assert tuple(steps.figure.get_size_inches()) == FIGSIZE
    heights = {}
    for bar in steps.patches:  # one bar per plan, split into compute / exposed communication / bubble
        heights[round(bar.get_x(), 3)] = heights.get(round(bar.get_x(), 3), 0) + bar.get_height()
    assert list(heights.values()) == pytest.approx([1e3 * e.step_time_s for e in ests])


def test_pareto_front():
    points = [(1, 5), (2, 2), (3, 3), (5, 1), (2, 2)]
    assert pareto_front(points) == [0, 1, 4, 3]
    assert pareto_front([(1, 1), (2, 2)]) == [0]


def test_shard_layout_tells_which_rank_holds_which_slice(ex):
    fsdp_tp = next(p for p in ex.plans if p.mode == "fsdp2_tp")
    layout = ex.layout(fsdp_tp, "net.0").set_index(["rank", "param"])["held"]
    assert layout[(0, "weight")] == "[0:16, :]" and layout[(1, "weight")] == "[32:48, :]"
    assert layout[(2, "weight")] == "[16:32, :]" and layout[(3, "bias")] == "[48:64]"
    row = ex.layout(next(p for p in ex.plans if p.mode == "tp"), "net.2").set_index(["rank", "param"])["held"]
    assert row[(1, "weight")] == "[:, 16:32]" and row[(1, "bias")] == "whole"
    dp = next(p for p in ex.plans if p.mode == "dp")
    assert set(ex.layout(dp, "net.0")["held"]) == {"whole"}
    with pytest.raises(KeyError):
        ex.layout(dp, "nope")


def test_repr_is_short_and_deterministic(ex):
    text = repr(ex)
    assert text == "Explorer(SpikingMLP: 6 modules, 2 stateful, 3 TP candidates, family=generic, 5 plans)"
    assert not re.search(r"0x[0-9a-f]+", text)


#: Rows that carry the estimator's saved-activation attribution, which varies between processes
#: (snn_explorer.estimator.profile attributes saved storages by address; reported to its owner).
_PROFILE_ROWS = ["verdict", "activations_bytes", "peak_bytes_max"]


def _snapshot() -> str:
    ex = Explorer.from_zoo("mlp")
    ex.enumerate(world_size=4)
    table = ex.compare().drop(index=_PROFILE_ROWS)
    parts = [repr(ex), ex.modules.to_string(), ex.candidates.to_string(), table.to_string(),
             se.explorer.style_compare(table).to_html(), ex.layout(ex.plans[-1]).to_string(),
             ex.mesh_chart(ex.plans[-1]).axes[0].get_title()]
    return "\n".join(parts) + "\n"


_SCRIPT = "import os; os.environ['MPLBACKEND'] = 'Agg'; import test_explorer; print(test_explorer._snapshot(), end='')"


def test_tables_are_the_same_in_a_fresh_process():
    here = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120, cwd=here)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout == _snapshot()
    assert not re.search(r"0x[0-9a-f]{6,}", run.stdout)


def test_tables_are_the_same_on_every_call(ex):
    assert ex.compare().equals(ex.compare()) and ex.compare_text() == ex.compare_text()
    assert ex.compare(styled=True).to_html() == ex.compare(styled=True).to_html()
    assert ex.modules.equals(ex.modules_for(None))


def test_apply_single_process_plan():
    zoo = build("mlp")
    ex = Explorer.from_zoo(zoo)
    runtime = ex.apply(ex.add_plan(topology={"dp": 1}))
    assert runtime.plan.mode == "none"
    assert runtime.model(zoo.example_input).shape == (zoo.time_steps, zoo.batch_size, zoo.num_classes)


def test_importing_the_package_leaves_pandas_matplotlib_and_widgets_unloaded():
    """What a launched rank imports stays light; the notebook layer (snn_explorer.explorer, reached
    through ``snn_explorer.Explorer`` on first use) loads them at its top like any module."""
    code = ("import sys, snn_explorer, snn_explorer.launcher, snn_explorer.ranks; "
            "print(sorted(m for m in ('pandas', 'matplotlib', 'ipywidgets') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stderr[-2000:]


def test_tables_say_where_state_lives_and_keep_integers():
    from snn_explorer.explorer import analysis_table, modules_table

    zoo = build("mlp_tutorial")
    table = modules_table(zoo.model, se.analyze(zoo.model)).set_index("path")
    assert "passed in and out by the model's forward" in table.loc["lif1", "state"]
    assert not table.loc["lif1", "stateful"] and table.loc["fc1", "state"] == ""
    zoo = build("mlp")
    table = modules_table(zoo.model, se.analyze(zoo.model)).set_index("path")
    assert table.loc["net.1", "state"] == "membrane in the module (snntorch init_hidden=True)"
    shapes = analysis_table(se.analyze(zoo.model)).set_index("path")
    assert str(shapes["in_features"].dtype) == "Int64" and shapes.loc["net.4", "out_features"] == 8
    assert shapes["in_features"].isna().sum() == 2  # the two neurons have no feature counts
    assert "64.0" not in shapes.to_string() and "NaN" not in shapes.to_string()


def test_coinciding_plans_share_one_label_on_the_pareto_chart():
    from snn_explorer.explorer.charts import coinciding, mesh_fontsize

    groups = coinciding([(1.0, 2.0), (1.0000001, 2.0), (3.0, 1.0)], ["#1 dp", "#2 dp+zero", "#3 tp"])
    assert [names for _, names in groups] == [["#1 dp", "#2 dp+zero"], ["#3 tp"]]
    ex = Explorer.from_zoo(build("mlp"))
    plans = ex.enumerate(world_size=2)
    fig = ex.pareto_chart()
    texts = [t.get_text() for t in fig.axes[0].texts]
    points = {(float(f"{e.peak_bytes / 2 ** 20:.3g}"), float(f"{e.step_time_s * 1e3:.3g}")) for e in ex.estimates(plans)}
    assert len(texts) == len(points) <= len(plans)
    assert sorted(n for t in texts for n in t.split("\n")) == sorted(unique_labels(plans))
    assert mesh_fontsize(2, 2) >= 10 and mesh_fontsize(1, 4) >= 10
    fig = ex.mesh_chart(plans[0], "net.0")
    assert min(t.get_fontsize() for t in fig.axes[0].texts) >= 10


def test_compare_rows_pick_rows_and_keep_readable_units():
    ex = Explorer.from_zoo(build("mlp"))
    ex.enumerate(world_size=2)
    rows = ["mode", "params_bytes", "peak_bytes_max"]
    table = ex.compare(rows=rows)
    assert list(table.index) == rows
    html = ex.compare(rows=rows, styled=True).to_html()
    assert "KiB" in html
    with pytest.raises(ValueError, match=r"rows \['bogus'\] are not rows of the comparison"):
        ex.compare(rows=["bogus"])
