"""Progress of waits over two seconds: in a box of the UI, a notebook cell, a terminal; silent otherwise."""
from __future__ import annotations

import io
import os
import time

import ipywidgets as w
import pytest

from snn_explorer.explorer import Explorer
from snn_explorer.explorer import explorer as explorer_module
from snn_explorer.explorer import progress as progress_module
from snn_explorer.explorer.progress import Progress
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


@pytest.mark.parametrize("hardware, env, note", [(None, None, True), (None, "A100-SXM-80GB", False),
                                                  ("A100-SXM-80GB", None, False)])
def test_the_estimate_line_says_when_it_may_calibrate(monkeypatch, hardware, env, note):
    monkeypatch.setattr(progress_module, "SHOW_AFTER_S", 0.0)
    ex = Explorer.from_zoo(build("mlp"), hardware=hardware)
    box, lines = w.VBox(), []
    ex.progress_box = box

    def slow(*args, **kwargs):  # stands in for the estimate: nothing here calibrates the machine
        time.sleep(0.5)
        lines.append(_label(box))

    monkeypatch.setattr(explorer_module, "estimate_plan", slow)
    if env is None:
        monkeypatch.delenv("SNN_EXPLORER_HARDWARE", raising=False)
    else:
        monkeypatch.setenv("SNN_EXPLORER_HARDWARE", env)
    ex.estimate(ex.make_plan(topology={"dp": 2}))
    assert ("calibrates it" in lines[0]) == note, lines
