"""The step-time chart's pipeline bubble is its own bar and agrees with the estimate's time table."""
import pytest

import snn_explorer as se
from snn_explorer.estimator import estimate
from snn_explorer.explorer.charts import TIME_PARTS, step_time_chart
from snn_explorer.zoo import build


def test_the_bubble_bar_is_the_time_tables_mean_idle_time():
    vgg = build("vgg", batch_size=8)
    analysis = se.analyze(vgg.model)
    pp = se.plan(analysis=analysis, objective="capacity", topology={"pp": 2}, batch_size=8, mode="pp", options=se.PlanOptions(pp_schedule="1f1b", pp_microbatches=4))
    dp = se.plan(analysis=analysis, objective="speed", topology={"dp": 2}, batch_size=8, mode="dp")
    ests = [estimate(vgg.model, p, example_input=vgg.example_input, labels=vgg.labels) for p in (pp, dp)]
    time = ests[0].time
    assert (time["bubble_s"] > 0).all() and time["bubble_s"].nunique() > 1  # each rank idles its own share
    ax = step_time_chart(ests).axes[0]
    bars = {}  # (plan index, part) -> height in ms
    for part, container in zip(TIME_PARTS, ax.containers):
        for i, bar in enumerate(container):
            bars[i, part[0]] = bar.get_height()
    for column, _ in TIME_PARTS:  # the pipeline: every part the ranks' mean, so the parts add up to the step
        assert bars[0, column] == pytest.approx(1e3 * time[column].mean())
    assert sum(bars[0, c] for c, _ in TIME_PARTS) == pytest.approx(1e3 * time["step_s"].max(), rel=1e-3)
    slowest = ests[1].time.loc[ests[1].time["step_s"].idxmax()]  # no pipeline: the slowest rank, no bubble
    assert bars[1, "bubble_s"] == 0 and bars[1, "compute_s"] == pytest.approx(1e3 * slowest["compute_s"])
    assert "mean over ranks" in ax.get_title()
    assert ax.get_ylim()[1] > max(sum(bars[i, c] for c, _ in TIME_PARTS) for i in range(2))  # nothing clipped


def test_the_pipeline_chart_states_the_time_tables_idle_share_and_stays_readable_at_16_micro_batches():
    import pandas as pd

    from snn_explorer.explorer import Explorer
    from snn_explorer.explorer.pipeline_view import LABEL_INCHES, pipeline_chart

    vgg = build("vgg", batch_size=16)
    ex = Explorer.from_zoo(vgg)
    plan = ex.make_plan(objective="capacity", topology={"pp": 2}, mode="pp", options=se.PlanOptions(pp_schedule="1f1b", pp_microbatches=16))
    units = ex.analysis.pipeline_units
    # two ranks idle 0.3 and 0.1 s of 1 s steps: 20 %; the schedule alone idles (pp - 1) / (m + pp - 1) = 1/17
    given = pipeline_chart(plan, units, time=pd.DataFrame({"bubble_s": [0.3, 0.1], "step_s": [1.0, 1.0]}))
    assert "idle 20% of the ranks' step time (estimate); 6% at equal stage costs" in given.axes[0].get_title()
    assert "idle 6% (schedule at equal stage costs)" in pipeline_chart(plan, units).axes[0].get_title()
    time = ex.estimate(plan).time
    top = ex.pipeline_chart(plan).axes[0]
    assert f"idle {time['bubble_s'].sum() / time['step_s'].sum():.0%} of the ranks' step time" in top.get_title()
    width = top.figure.get_size_inches()[0]
    assert width > 9.0  # 16 micro-batches: 3 x 16 units of work a rank, wider than the default 9 inches
    assert len(top.patches) == 2 * 2 * 16
    inches_per_unit = width * top.get_position().width / top.get_xlim()[1]
    labelled = [p for p in top.patches if p.get_width() * inches_per_unit >= LABEL_INCHES]
    assert len(top.texts) == len(labelled) > 0  # text only where it fits
