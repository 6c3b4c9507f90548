"""Progress of a wait that lasts over :data:`SHOW_AFTER_S`: a widget bar in Jupyter (or in a box of
the Explorer UI), a tqdm bar on a terminal, nothing otherwise (tests, pipes, ``SNN_EXPLORER_PROGRESS=0``).

Nothing is shown for a shorter wait, so quick calls (and notebooks whose cells are quick, under
nbval) print nothing. A background thread shows the bar once the wait passes the threshold and
keeps its elapsed time current while the caller blocks.

In a notebook the bar is published with the widget's mime type only (no ``text/plain``) and emptied
when the wait ends, so a saved notebook holds no text for it and nbval, which skips widget views,
compares nothing extra.
"""
from __future__ import annotations

import contextvars
import os
import sys
import threading
import time
from typing import Iterable, Iterator, Optional, Tuple

import ipywidgets as w
from IPython.display import display
from tqdm import tqdm

from ..ranks.display import in_notebook

#: Seconds a wait lasts before its progress is shown.
SHOW_AFTER_S = 2.0
#: Seconds between updates of a shown bar's elapsed time.
TICK_S = 0.25
#: ``0``, ``off`` or ``false`` here: never show progress.
ENV_VAR = "SNN_EXPLORER_PROGRESS"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def _enabled() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "off", "false", "no")


class _WidgetView:
    """A bar and a line of text; shown in ``box`` (replacing its children) or as a cell output."""

    def __init__(self, box: Optional[w.Box]):
        self.bar = w.IntProgress(value=0, min=0, max=1, layout=w.Layout(width="300px"))
        self.label = w.Label()
        self.row, self.box, self.handle = w.HBox([self.bar, self.label]), box, None

    def show(self) -> None:
        if self.box is not None:
            self.box.children = (self.row,)
        else:
            bundle = self.row._repr_mimebundle_() or {}
            self.handle = display({WIDGET_MIME: bundle[WIDGET_MIME]}, raw=True, display_id=True)

    def update(self, done: int, total: Optional[int], text: str) -> None:
        self.bar.max = max(total or 1, 1)
        self.bar.value = min(done, self.bar.max) if total else 0
        self.bar.bar_style = "" if total else "info"
        self.label.value = text

    def close(self) -> None:
        if self.box is not None:
            self.box.children = ()
        elif self.handle is not None:
            self.handle.update({}, raw=True)  # the cell keeps an empty output, not a dangling widget view
        self.row.close()


class _TqdmView:
    """A tqdm bar on stderr (the line itself carries the elapsed seconds)."""

    def __init__(self):
        self.bar = None

    def show(self) -> None:
        self.bar = tqdm(total=None, file=sys.stderr, leave=False, bar_format="{desc}")

    def update(self, done: int, total: Optional[int], text: str) -> None:
        if total and self.bar.total != total:
            self.bar.total = total
            self.bar.bar_format = "{desc} {bar}"
        self.bar.n = done
        self.bar.set_description_str(text, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def _choose_view(box: Optional[w.Box]):
    """Where a long wait shows: the given box, a notebook cell, a terminal, or nowhere (None)."""
    if not _enabled():
        return None
    if box is not None or in_notebook():
        return _WidgetView(box)
    if not sys.stderr.isatty():
        return None
    return _TqdmView()


class Progress:
    """``with Progress("profiling the model") as p: ...`` (``total`` steps: ``p.advance()`` after each).

    ``box``: an ipywidgets Box to show the bar in (the Explorer UI's), else the cell or terminal.
    """

    def __init__(self, text: str, total: Optional[int] = None, *, box: Optional[w.Box] = None,
                 show_after: Optional[float] = None):
        self.text, self.total, self.done = text, total, 0
        #: (done, total, label) of the phase an estimator hook last reported (:meth:`hear`), or None
        self.phase: Optional[Tuple[int, int, str]] = None
        self.shown = False
        self._view = _choose_view(box)
        self._show_after = SHOW_AFTER_S if show_after is None else show_after
        self._started = time.monotonic()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._thread = None

    def __enter__(self) -> "Progress":
        if self._view is not None:
            context = contextvars.copy_context()  # the cell a notebook display belongs to
            self._thread = threading.Thread(target=context.run, args=(self._watch,), daemon=True,
                                            name="snn-explorer-progress")
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self.shown:
                self._view.close()

    def advance(self, steps: int = 1, text: Optional[str] = None) -> None:
        """``steps`` more of ``total`` done (the phase heard ends); ``text`` replaces the line."""
        self.done += steps
        self.phase = None
        if text is not None:
            self.text = text

    def say(self, text: str) -> None:
        """What is waited for now (the count and elapsed time stay; the phase heard ends)."""
        self.text, self.phase = text, None

    def hear(self, done: int, total: int, label: str) -> None:
        """The estimator's ``on_progress`` hook (:mod:`snn_explorer.estimator.instruments.progress_hook`):
        ``label``'s phase is at ``done`` of ``total``; the line adds it and the bar counts it."""
        self.phase = (done, total, label)

    def each(self, items: Iterable) -> Iterator:
        """``items``, advancing after each."""
        for item in items:
            yield item
            self.advance()

    def line(self) -> str:
        """The text shown: what is waited for, the count, the phase heard with its count, the seconds so far."""
        count = f" ({self.done}/{self.total})" if self.total else ""
        phase = f"; {self.phase[2]} ({self.phase[0]}/{self.phase[1]})" if self.phase else ""
        return f"{self.text}{count}{phase}: {time.monotonic() - self._started:.0f} s"

    def counts(self) -> Tuple[int, Optional[int]]:
        """What the bar shows: the phase heard, else the wait's own count."""
        return (self.phase[0], self.phase[1]) if self.phase else (self.done, self.total)

    def _watch(self) -> None:
        if self._closed.wait(max(0.0, self._show_after - (time.monotonic() - self._started))):
            return
        with self._lock:
            self._view.show()
            self.shown = True
        while True:
            with self._lock:
                self._view.update(*self.counts(), self.line())
            if self._closed.wait(TICK_S):
                return
