"""Figures that display themselves: a chart returned anywhere in Jupyter shows as a PNG, no
``%matplotlib`` magic needed (under the inline backend its own formatter takes over, one image)."""
from __future__ import annotations

import io
import textwrap
from typing import Sequence

from matplotlib.figure import Figure


class ChartFigure(Figure):
    """A matplotlib ``Figure`` with ``_repr_png_``; draws without pyplot, so no global state."""

    def _repr_png_(self) -> bytes:
        return png_bytes(self)


def png_bytes(fig: Figure) -> bytes:
    """``fig`` as PNG bytes, without the matplotlib version in its metadata (stable across runs)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def new_figure(figsize: Sequence[float]) -> ChartFigure:
    return ChartFigure(figsize=tuple(figsize), dpi=100, layout="constrained")


def wrapped(labels: Sequence[str], width: int = 16) -> list:
    """Tick labels broken into lines of at most ``width`` characters, so that many plans' labels
    stand side by side instead of over each other."""
    return ["\n".join(textwrap.wrap(label, width)) or label for label in labels]
