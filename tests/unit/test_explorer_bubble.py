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
