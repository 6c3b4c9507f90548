"""The styled comparison: each table highlights its own best values, also beside another on one page."""
import re

import pandas as pd
import pytest

from snn_explorer.explorer import Explorer
from snn_explorer.explorer.compare import BEST_CSS, BEST_HIGH, BEST_LOW, best_columns, style_compare

#: A rule of a styled table's <style>: the selectors before "{", its properties inside.
RULE = re.compile(r"([^{}]+)\{([^}]*)\}")
CELL = re.compile(r'<td id="(T_[\w-]+)_row(\d+)_col(\d+)"')


def highlighted_cells(page: str, table_id: str, table: pd.DataFrame) -> set:
    """(row, column) of ``table``'s cells that any rule on the whole ``page`` colours best, as a
    browser applies every <style> of a page to every element it selects."""
    best_ids = set()
    for selectors, props in RULE.findall(page):
        if "#d4edda" in props:
            best_ids.update(s.strip().lstrip("#") for s in selectors.split(","))
    cells = set()
    for uuid, row, col in CELL.findall(page):
        if uuid == table_id and f"{uuid}_row{row}_col{col}" in best_ids:
            cells.add((table.index[int(row)], table.columns[int(col)]))
    return cells


def table_id(html: str) -> str:
    return re.search(r'<table id="(T_[\w-]+)"', html).group(1)


def expected_best(table: pd.DataFrame) -> set:
    """Computed here from the numbers: the smallest of each lower-is-better row, the largest of each
    higher-is-better row, nothing in a row whose values are all equal."""
    cells = set()
    for row in table.index:
        if row not in BEST_LOW + BEST_HIGH:
            continue
        values = [float(v) for v in table.loc[row]]
        if len(set(values)) < 2:
            continue
        best = max(values) if row in BEST_HIGH else min(values)
        cells.update((row, col) for col, v in zip(table.columns, values) if v == best)
    return cells


@pytest.fixture(scope="module")
def ex():
    explorer = Explorer.from_zoo("mlp", hardware="A100-SXM-80GB")
    explorer.enumerate(world_size=4)
    return explorer


def test_two_comparisons_on_one_page_each_highlight_their_own_best(ex):
    first, second = ex.plans[:3], ex.plans[1:][::-1]
    tables = [ex.compare(first), ex.compare(second, time_steps=16)]
    htmls = [ex.compare(first, styled=True).to_html(), ex.compare(second, styled=True, time_steps=16).to_html()]
    ids = [table_id(h) for h in htmls]
    assert ids[0] != ids[1]
    page = "<html><body>" + "".join(htmls) + "</body></html>"
    for table, tid in zip(tables, ids):
        expected = expected_best(table)
        assert expected and any(r == "peak_bytes_max" for r, _ in expected)  # not vacuous
        assert highlighted_cells(page, tid, table) == expected
    assert ex.compare(first, styled=True).to_html() == htmls[0]  # the same table renders the same HTML


def test_only_numeric_better_rows_are_best_and_ties_share():
    table = pd.DataFrame({"a": ["dp", 8, 100, 5.0, 3], "b": ["tp", 4, 100, 2.0, 3], "c": ["fsdp2", 2, 200, 2.0, 3]},
                         index=["mode", "batch_per_rank", "peak_bytes_max", "samples_per_s", "step_time_s"],
                         dtype=object)
    assert best_columns(table, "mode") == [] and best_columns(table, "batch_per_rank") == []
    assert best_columns(table, "peak_bytes_max") == ["a", "b"]  # a tie: both best
    assert best_columns(table, "samples_per_s") == ["a"]  # higher is better
    assert best_columns(table, "step_time_s") == []  # all equal: none
    html = style_compare(table).to_html()
    assert highlighted_cells(html, table_id(html), table) == {("peak_bytes_max", "a"), ("peak_bytes_max", "b"),
                                                              ("samples_per_s", "a")}
    assert BEST_CSS.split(";")[0] in html


def test_styled_comparison_scrolls_instead_of_widening_the_page(ex):
    html = ex.compare(styled=True).to_html()
    assert re.search(r"#T_[\w-]+\s*\{[^}]*overflow-x: auto", html)
