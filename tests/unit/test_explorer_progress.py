"""Progress of waits over two seconds: in a box of the UI, a notebook cell, a terminal; silent otherwise."""
from __future__ import annotations

import io
import os
import time

import ipywidgets as w
import pytest

from snn_explorer.estimator import cached_hardware, hardware_profile, model_profile
from snn_explorer.estimator.calibration import this_machine
from snn_explorer.explorer import Explorer
from snn_explorer.explorer import explorer as explorer_module
from snn_explorer.explorer import progress as progress_module
from snn_explorer.explorer.progress import Progress
from snn_explorer.explorer.ui import ExplorerUI
from snn_explorer.zoo import build

os.environ.setdefault("MPLBACKEND", "Agg")


class Terminal(io.StringIO):
    def isatty(self):
        return True


def _label(box) -> str:
    return box.children[0].children[1].value


def test_a_short_wait_shows_nothing_and_a_long_one_shows_a_bar_in_the_box():
    box = w.VBox()
    with Progress("quick", box=box, show_after=0.5):
        time.sleep(0.1)
    assert box.children == ()
    with Progress("measuring", total=3, box=box, show_after=0.1) as wait:
        wait.advance()
        time.sleep(0.6)
        bar = box.children[0].children[0]
        assert "measuring (1/3)" in _label(box) and (bar.value, bar.max) == (1, 3)
        wait.say("estimating dp")
        time.sleep(0.4)
        assert _label(box).startswith("estimating dp (1/3): ")
    assert box.children == ()


def test_silent_without_a_terminal_or_notebook_and_when_switched_off(monkeypatch, capsys):
    with Progress("waiting", show_after=0.0):
        time.sleep(0.3)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    monkeypatch.setenv(progress_module.ENV_VAR, "0")
    box = w.VBox()
    with Progress("waiting", box=box, show_after=0.0):
        time.sleep(0.3)
    assert box.children == ()


def test_a_terminal_gets_a_tqdm_line(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(progress_module.sys, "stderr", terminal)
    with Progress("calibrating", total=2, show_after=0.1) as wait:
        wait.advance()
        time.sleep(0.5)
    assert "calibrating (1/2): " in terminal.getvalue()


def test_a_notebook_cell_gets_the_widget_alone_without_text(monkeypatch):
    shown, updates = [], []

    class Handle:
        def update(self, data, raw):
            updates.append(data)

    def display(data, raw, display_id):
        shown.append(data)
        return Handle()

    monkeypatch.setattr(progress_module, "in_notebook", lambda: True)
    monkeypatch.setattr(progress_module, "display", display)
    with Progress("profiling", show_after=0.1):
        time.sleep(0.4)
        assert updates == []
    assert len(shown) == 1 and list(shown[0]) == [progress_module.WIDGET_MIME]  # nbval compares no text of it
    assert updates == [{}]  # emptied when the wait ends


def test_the_ui_shows_a_slow_estimate_in_its_progress_box(monkeypatch):
    monkeypatch.setattr(progress_module, "SHOW_AFTER_S", 0.2)
    ex = Explorer.from_zoo(build("mlp"))
    ui = ex.ui
    seen = []
    real = explorer_module.estimate_plan

    def slow(*args, **kwargs):
        time.sleep(0.7)
        seen.append(_label(ui.progress) if ui.progress.children else "")
        return real(*args, **kwargs)

    monkeypatch.setattr(explorer_module, "estimate_plan", slow)
    ui.tp.value = 2  # a plan not estimated yet
    assert seen and seen[-1].startswith(f"estimating {explorer_module.plan_label(ui.current)}"), seen
    assert ui.progress.children == () and ex.progress_box is None
    assert ui.compare_table is not None


@pytest.mark.parametrize("hardware, cached, note", [(None, False, True), (None, True, False),
                                                     ("A100-SXM-80GB", False, False)])
def test_the_estimate_line_says_when_it_calibrates_and_shows_the_pieces_heard(monkeypatch, hardware, cached, note):
    monkeypatch.setattr(progress_module, "SHOW_AFTER_S", 0.0)
    ex = Explorer.from_zoo(build("mlp"), hardware=hardware)
    box, lines = w.VBox(), []
    ex.progress_box = box
    monkeypatch.setattr(explorer_module, "cached_hardware", lambda: "a profile" if cached else None)
    assert ex.will_calibrate == note

    def slow(*args, on_progress, **kwargs):  # stands in for the estimate: it reports two pieces of a phase
        time.sleep(0.4)
        lines.append(_label(box))
        on_progress(1, 3, "calibrating this machine: 2 ranks: all_reduce timed")
        time.sleep(0.4)
        lines.append(_label(box))
        bar = box.children[0].children[0]
        lines.append((bar.value, bar.max))

    monkeypatch.setattr(explorer_module, "estimate_plan", slow)
    ex.estimate(ex.make_plan(topology={"dp": 2}))
    assert ("calibrating this machine first" in lines[0]) == note, lines
    assert "; calibrating this machine: 2 ranks: all_reduce timed (1/3): " in lines[1], lines
    assert lines[2] == (1, 3)


def test_profiling_reports_each_run_to_its_hook():
    zoo = build("mlp")  # a model of its own: the profile is measured here, not found in the cache
    heard = []
    profile = model_profile(zoo.model, zoo.example_input, zoo.labels, on_progress=lambda *piece: heard.append(piece))
    assert profile.modules  # measured
    assert [(done, total) for done, total, _ in heard] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert all(label.startswith("profiling the model: ran batch ") for _, _, label in heard)
    again = []
    model_profile(zoo.model, zoo.example_input, zoo.labels, on_progress=lambda *piece: again.append(piece))
    assert again == []  # cached: nothing runs, nothing is reported
    with pytest.raises(TypeError, match="on_progress must be None or a callable"):
        model_profile(zoo.model, zoo.example_input, zoo.labels, on_progress="tqdm")


def test_cached_hardware_names_the_env_profile_or_the_saved_calibration_without_calibrating(monkeypatch, tmp_path):
    monkeypatch.setenv("SNN_EXPLORER_HARDWARE", "A100-SXM-80GB")
    assert cached_hardware().name.startswith("A100")
    monkeypatch.delenv("SNN_EXPLORER_HARDWARE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(this_machine, "_DEFAULT", {})
    assert cached_hardware() is None  # nothing saved here, and nothing was calibrated to find that out
    saved = hardware_profile("RTX-4090")
    os.makedirs(os.path.dirname(this_machine.cache_path()))
    saved.save(this_machine.cache_path())
    assert cached_hardware() == saved


def test_the_ui_says_before_estimating_that_the_first_estimate_calibrates(monkeypatch):
    monkeypatch.setattr(explorer_module, "cached_hardware", lambda: None)
    ui = ExplorerUI(Explorer.from_zoo(build("mlp")), auto_estimate=False)  # nothing estimated: nothing calibrates
    assert "the first estimate calibrates this machine" in ui.hardware_note.value
    ui.hardware.value = "A100-SXM-80GB"
    assert ui.hardware_note.value == ""
