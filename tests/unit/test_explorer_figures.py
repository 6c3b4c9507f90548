"""Charts are pictures wherever they are returned: no backend magic, every committed chart has its image."""
import base64
import json
import re
from pathlib import Path

import nbformat
import pytest
from IPython.core.formatters import DisplayFormatter
from nbclient import NotebookClient

from snn_explorer.explorer import Explorer

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
#: A cell whose last line returns a chart (``ex.memory_chart()``, ``pipeline_chart(...)``, ...).
DRAWS = re.compile(r"^[\w.]*(_chart|chart)\(.*\)\s*$")


@pytest.fixture(scope="module")
def ex():
    explorer = Explorer.from_zoo("mlp", hardware="A100-SXM-80GB")
    explorer.enumerate(world_size=4)
    explorer.enumerate(world_size=2)
    return explorer


def test_a_returned_chart_formats_as_png_without_the_inline_backend(ex):
    formatter = DisplayFormatter()  # a bare IPython formatter: no matplotlib backend registered
    for fig in (ex.memory_chart(), ex.pareto_chart(), ex.comm_chart(), ex.step_time_chart(),
                ex.mesh_chart(ex.plans[0])):
        data, _ = formatter.format(fig)
        assert data["image/png"][:8] == PNG_MAGIC


def test_a_notebook_without_the_magic_shows_its_chart_as_an_image(tmp_path):
    cells = ["from snn_explorer.explorer import Explorer\n"
             "ex = Explorer.from_zoo('mlp', hardware='A100-SXM-80GB')\n"
             "ex.add_plan(topology={'dp': 2})\n"
             "ex.memory_chart()"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = nb.cells[0].outputs
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1, outputs
    assert base64.b64decode(images[0]["data"]["image/png"])[:8] == PNG_MAGIC
    assert "%matplotlib" not in cells[0]


def _chart_cells(path: Path):
    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        lines = [line for line in "".join(cell["source"]).splitlines() if line.strip()]
        texts = ["".join(o.get("data", {}).get("text/plain", "")) for o in cell.get("outputs", [])]
        if (lines and DRAWS.match(lines[-1])) or any(t.startswith("<Figure") for t in texts):
            yield i, cell


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_every_committed_chart_cell_has_an_image(path):
    for i, cell in _chart_cells(path):
        kinds = [k for o in cell.get("outputs", []) for k in o.get("data", {})]
        assert "image/png" in kinds, f"{path.name} cell {i} draws a chart but its output has no image: {kinds}"


def test_chart_cells_are_found():
    assert sum(1 for p in NOTEBOOKS for _ in _chart_cells(p)) >= 8  # the check above is not vacuous


def test_eight_plans_have_labels_side_by_side_and_the_budget_is_drawn(ex):
    plans = ex.plans[:8]
    assert len(plans) >= 7
    budget = 2 ** 20
    fig = ex.memory_chart(plans, memory_budget=budget)
    fig.canvas.draw()
    ax = fig.axes[0]
    boxes = [t.get_window_extent() for t in ax.get_xticklabels() if t.get_text()]
    assert len(boxes) == len(plans)
    for a, b in zip(boxes, boxes[1:]):
        assert a.x1 <= b.x0, (a, b)  # each label ends before the next begins
    assert any(line.get_label().startswith("budget") for line in ax.get_lines())


def test_pareto_fronts_are_per_world_size(ex):
    fig = ex.pareto_chart(memory_budget=2 ** 20)
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert "Pareto front, 2 ranks" in labels and "Pareto front, 4 ranks" in labels
    assert any(label.startswith("budget") for label in labels)
