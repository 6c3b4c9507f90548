"""Writing results into ``ipywidgets.Output`` state as display data (what nbval and a browser both see)."""
from __future__ import annotations

import base64
import html

import pandas as pd

from .figure import png_bytes

#: Rows of a long table shown in a widget; the full table stays available as a DataFrame.
MAX_ROWS = 200


def table_data(df: pd.DataFrame, max_rows: int = MAX_ROWS) -> dict:
    """``text/html`` and ``text/plain`` of a DataFrame, cut to ``max_rows`` rows with a note."""
    shown, note = df, ""
    if len(df) > max_rows:
        shown, note = df.head(max_rows), f"<p>first {max_rows} of {len(df)} rows</p>"
    return {"text/html": shown.to_html(index=False) + note, "text/plain": shown.to_string(index=False)}


def styler_data(styler, text: str) -> dict:
    return {"text/html": styler.to_html(), "text/plain": text}


def figure_data(fig) -> dict:
    """``image/png`` (base64, as Jupyter stores it) of a matplotlib Figure."""
    title = fig.axes[0].get_title() if fig.axes else "figure"
    return {"image/png": base64.b64encode(png_bytes(fig)).decode("ascii"), "text/plain": f"<Figure: {title}>"}


def message_data(text: str, kind: str = "info") -> dict:
    color = {"error": "#a94442", "info": "#31708f"}[kind]
    return {"text/html": f'<p style="color: {color}">{html.escape(text)}</p>', "text/plain": text}


def show(out, *items: dict) -> None:
    """Replace ``out``'s outputs with one ``display_data`` entry per mimebundle in ``items``."""
    out.outputs = tuple({"output_type": "display_data", "data": data, "metadata": {}} for data in items)


def message_html(text: str, kind: str = "info") -> str:
    return message_data(text, kind)["text/html"] if text else ""
