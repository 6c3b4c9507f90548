"""Progress displays: live ipywidgets in a notebook, one rewritten line in a terminal, a callback."""
from __future__ import annotations

import shutil
import sys
import time
from typing import Callable, Union

from .progress import Tracker


class NullDisplay:
    def update(self, tracker: Tracker) -> None:
        pass

    def close(self, tracker: Tracker) -> None:
        pass


class CallbackDisplay(NullDisplay):
    """Calls ``fn(snapshot)`` (a list of per-rank dicts) after every poll that brought events."""

    def __init__(self, fn: Callable):
        self._fn = fn

    def update(self, tracker: Tracker) -> None:
        self._fn(tracker.snapshot())


class TextDisplay(NullDisplay):
    """A single ``\\r``-rewritten status line on a terminal's stderr."""

    def __init__(self, stream=None, interval: float = 0.2):
        self._stream = stream or sys.stderr
        self._interval, self._last, self._shown = interval, 0.0, ""

    @staticmethod
    def _bar(state) -> str:
        if not state.total or state.step is None:
            return ""
        filled = int(10 * min(state.step, state.total) / state.total)
        return "[" + "#" * filled + "." * (10 - filled) + "] "

    def render(self, tracker: Tracker) -> str:
        return " | ".join(f"r{r} {self._bar(s)}{tracker.line(r)}" for r, s in tracker.ranks.items())

    def update(self, tracker: Tracker, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self._interval:
            return
        text = self.render(tracker)[: shutil.get_terminal_size((120, 20)).columns - 1]
        if text != self._shown:
            self._stream.write("\r" + text.ljust(len(self._shown)))
            self._stream.flush()
            self._shown, self._last = text, now

    def close(self, tracker: Tracker) -> None:
        self.update(tracker, force=True)
        self._stream.write("\n")
        self._stream.flush()


class WidgetDisplay(NullDisplay):
    """One row per rank (label, progress bar, status text), updated live while the cell runs."""

    def __init__(self, nprocs: int):
        import ipywidgets as w  # lazy: ipywidgets and IPython are optional (notebook only) and slow to import
        from IPython.display import display  # lazy: as above

        self._bars = [w.IntProgress(value=0, min=0, max=1, layout=w.Layout(width="40%")) for _ in range(nprocs)]
        self._texts = [w.HTML("starting") for _ in range(nprocs)]
        rows = [w.HBox([w.Label(f"rank {r}", layout=w.Layout(width="60px")), self._bars[r], self._texts[r]])
                for r in range(nprocs)]
        self.box = w.VBox(rows)
        display(self.box)

    def update(self, tracker: Tracker) -> None:
        styles = {"done": "success", "failed": "danger"}
        for r, s in tracker.ranks.items():
            bar = self._bars[r]
            if s.total:
                bar.max = s.total
                bar.value = min(s.step or 0, s.total)
            elif s.status == "done":
                bar.value = bar.max
            bar.bar_style = styles.get(s.status, "")
            self._texts[r].value = tracker.line(r)

    def close(self, tracker: Tracker) -> None:
        self.update(tracker)


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where widgets render)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def choose_display(progress: Union[bool, Callable, None], nprocs: int):
    """``True``: widgets in a notebook, a text line on a terminal, nothing otherwise;
    ``False``/``None``: nothing; a callable: :class:`CallbackDisplay`."""
    if callable(progress):
        return CallbackDisplay(progress)
    if not progress:
        return NullDisplay()
    if in_notebook():
        try:
            return WidgetDisplay(nprocs)
        except ImportError:
            pass
    return TextDisplay() if sys.stderr.isatty() else NullDisplay()
