"""The notebooks' markdown states no result: a number with a unit, a ratio or a share is formatted from the run
by a code cell, so the text cannot contradict the tables beside it.

A markdown cell may still name the setup (``T = 25``, ``4 ranks``, ``784 → 512``), a mesh shape (``2 × 2``),
a heading's number (``# 05 ·``) and code (anything in backticks)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("[0-9][0-9]_*.ipynb"))

_NUMBER = r"(?<![\w.])\d[\d,]*(?:\.\d+)?"
#: what states a result: a quantity with a unit, a multiple, a fraction, a share in words
RESULT = re.compile("|".join((
    _NUMBER + r"\s*(?:%|per ?cent\b|[KMGT]i?B\b|B\b|bytes?\b|ms\b|µs\b|us\b|s\b|seconds?\b|samples/s\b|GB/s\b)",
    _NUMBER + r"\s*[×x](?!\s*\d)",                      # "2×", "3 × T" (a mesh "2 × 2" is allowed)
    _NUMBER + r"\s*/\s*\d",                             # "1/4", "128 / 4"
    r"\b(?:halve[sd]?|halving|twice|doubles?|doubled|triples?|tripled)\b",
    r"\b(?:a|one)\s+(?:third|quarter|fifth|tenth)\s+of\b",
)), re.IGNORECASE)


def claims(markdown: str) -> list:
    """The result-stating phrases of ``markdown``, code spans and fenced code left out."""
    text = re.sub(r"```.*?```", " ", markdown, flags=re.S)
    text = re.sub(r"`[^`]*`", " ", text)
    return [m.group(0) for m in RESULT.finditer(text)]


def test_claims_finds_results_and_leaves_setup_and_code_alone():
    assert claims("dp+zero sends 69.1 KiB against tp's 34.0 KiB") == ["69.1 KiB", "34.0 KiB"]
    assert claims("a 53 % slower step, 2× the bytes, 1/4 each; saved tensors halve") == \
        ["53 %", "2×", "1/4", "halve"]
    assert claims("it holds about a third of the peak in 14 s") == ["a third of", "14 s"]
    assert claims("# 05 · Pipeline on a 2 × 2 mesh, T = 25, batch 128, 784 → 512, 4 ranks, 5 steps") == []
    assert claims("`(pp - 1) / (V·m + pp - 1)` and `x[0]`, fp32 and bf16, `2 * T`") == []
    assert claims("```python\nx = 3 / 4  # 5 MiB\n```") == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_markdown_cells_state_no_results(path):
    found = [(i, c) for i, cell in enumerate(json.loads(path.read_text())["cells"]) if cell["cell_type"] == "markdown"
             for c in claims("".join(cell["source"]))]
    assert not found, (f"{path.name}: markdown cells state results that a code cell should compute "
                       f"(e.g. display(Markdown(f'...'))): {found}")
