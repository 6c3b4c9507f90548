"""The Launch tab driven in-process on 2 gloo ranks: launch, stop, a rank's error, the tab's code run as shown.
(Save / load a plan, export, a missing-labels message, in one process: tests/unit/test_explorer_launch.py.)"""
from __future__ import annotations

import os
import sys
import time

import cloudpickle
import pytest
from launch_helpers import clean_launch, gone  # noqa: F401  (fixture)
from test_explorer_launch import _share_loss

from snn_explorer.explorer import Explorer
from snn_explorer.explorer.ui import TABS
from snn_explorer.zoo import build

os.environ.setdefault("MPLBACKEND", "Agg")
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture()
def ui():
    ex = Explorer.from_zoo(build("mlp"))
    ex.ui.world_size.value = 2  # dp=2
    return ex.ui


def _join(panel, seconds: float = 150.0) -> None:
    panel.thread.join(seconds)
    assert not panel.thread.is_alive(), "the launch did not end in time"


@pytest.mark.timeout(200)
def test_launch_button_trains_the_chosen_plan_on_2_gloo_ranks(ui, clean_launch):
    panel = ui.launcher
    assert panel.plan.value == ui.current and ui.current.world_size == 2
    panel.steps.value = 3
    panel.launch_button.click()
    assert panel.launch_button.disabled and not panel.stop_button.disabled
    _join(panel)
    assert panel.error == "" and "done: dp+zero dp=2 on gloo ranks, 3 steps" in panel.status.value
    losses = panel.result.losses
    share = ui.current.per_rank_batch
    ex = ui.ex
    for rank in (0, 1):
        assert losses[rank][0] == pytest.approx(_share_loss(ex.model, ex.example_input, ex.labels, rank, share),
                                                rel=1e-5)
    assert losses[0] != losses[1]  # each dp rank trains on its own share
    assert all(bar.value == 3 and bar.bar_style == "success" for bar in panel._bar)
    assert "rank 0" in panel.output.value and "rank 1" in panel.output.value
    assert f"{losses[1][2]:.6g}"[:6] in panel.output.value
    assert not panel.launch_button.disabled and panel.stop_button.disabled


@pytest.mark.timeout(200)
def test_stop_ends_a_long_launch_and_every_rank(ui, clean_launch):
    panel = ui.launcher
    panel.steps.value = 10 ** 6
    panel.launch()
    deadline = time.monotonic() + 120
    while not (panel._pids and any(bar.value > 0 for bar in panel._bar)):
        assert time.monotonic() < deadline and panel.thread.is_alive(), panel.status.value
        time.sleep(0.1)
    pids = set(panel._pids)
    stopped = time.monotonic()
    panel.stop_button.click()
    _join(panel, 60)
    assert time.monotonic() - stopped < 30
    assert "stopped after" in panel.status.value and panel.result is None
    assert all(gone(pid) for pid in pids)


@pytest.mark.timeout(200)
def test_a_failing_step_shows_the_rank_error_in_the_tab(ui, clean_launch):
    def broken_step(runtime, step, batch, state):
        raise ValueError(f"broken on dp rank {runtime.dp_rank}")

    panel = ui.launcher
    panel.train_fn = broken_step
    panel.launch()
    _join(panel)
    assert "the launch failed" in panel.status.value and panel.result is None
    assert "broken on dp rank" in panel.output.value and "ValueError" in panel.error


@pytest.mark.timeout(300)
def test_the_launch_tab_code_runs_as_shown(ui, tmp_path, clean_launch):
    ui.tabs.selected_index = TABS.index("Launch")
    text = ui.outputs["Launch"].outputs[0]["data"]["text/plain"]
    code = text[:text.index("# the plan file")].replace("'snn-job'", repr(str(tmp_path / "job")))
    scope = {"ex": ui.ex}
    exec(code, scope)  # noqa: S102 - the snippet the tab tells a user to run
    assert scope["result"].losses[0][0] == pytest.approx(
        _share_loss(ui.ex.model, ui.ex.example_input, ui.ex.labels, 0, ui.current.per_rank_batch), rel=1e-5)
    assert os.path.isfile(os.path.join(scope["job"].path, "run.py"))
