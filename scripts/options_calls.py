"""Rewrite calls that pass settings as keywords into calls that pass one options object.

``plan(analysis=a, objective="memory", ..., pp_schedule="1F1B", cpu_offload=True)`` becomes
``plan(analysis=a, objective="memory", ..., options=PlanOptions(pp_schedule="1F1B", cpu_offload=True))``;
likewise ``launch_plan`` / ``export_job`` keywords into ``LaunchOptions`` / ``ExportOptions``.
Table-driven and idempotent (a call without such keywords is left alone). It edits ``*.py`` under
snn_explorer/, tests/, benchmarks/, scripts/ and the code cells of notebooks/*.ipynb, and prints the
files it changed and the calls it could not rewrite (a ``**kwargs`` it cannot see into, a bare
function name it cannot find the import of)::

    python scripts/options_calls.py [--check]
"""
from __future__ import annotations

import argparse
import ast
import json
import pathlib
import re
import shutil
import subprocess
import sys
from typing import Dict, List, Optional, Sequence, Tuple

#: callable name -> (options class, its fields). A call matches by the called name (``plan``,
#: ``se.plan``, ``core_plan`` imported as ``plan``); the class is reached the same way.
TABLE: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "plan": ("PlanOptions", ("tensor_parallel_plan", "pp_schedule", "pp_microbatches", "pp_virtual_stages",
                             "pp_layout", "activation_checkpointing", "checkpoint_every", "cpu_offload",
                             "time_step_module", "checkpoint_blocks", "data_layout", "precision", "peak_estimate")),
    "launch_plan": ("LaunchOptions", ("comm_backend", "timeout", "env", "progress", "log_dir", "checkpoint_dir",
                                      "checkpoint_every", "max_restarts", "on_non_finite")),
    "export_job": ("ExportOptions", ("nnodes", "nproc_per_node", "job_name", "port", "gpus_per_node", "time_limit",
                                     "partition", "max_restarts", "checkpoint_dir", "checkpoint_every",
                                     "rdzv_endpoint", "on_non_finite")),
}
ALIASES = {"core_plan": "plan"}  # names the project imports a verb under
METHODS = {"make_plan": "plan", "add_plan": "plan"}  # Explorer methods taking a verb's options
MODULES = ("snn_explorer", "se")  # ``se.plan`` -> ``se.PlanOptions``
SELF = pathlib.Path(__file__).resolve()


def _verb(func: ast.expr, imported: Dict[str, str]) -> Optional[Tuple[str, str]]:
    """(table key, how to spell its options class here) for a called expression, or None."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in MODULES:
        key = func.attr
        return (key, f"{func.value.id}.{TABLE[key][0]}") if key in TABLE else None
    if isinstance(func, ast.Attribute) and func.attr in METHODS and "se" in imported:
        key = METHODS[func.attr]
        return (key, f"se.{TABLE[key][0]}") if key in TABLE else None
    if isinstance(func, ast.Name):
        key = ALIASES.get(func.id, func.id)
        if key in TABLE and func.id in imported:
            return key, TABLE[key][0]
    return None


def _imports(tree: ast.AST) -> Dict[str, ast.ImportFrom]:
    """Local name -> the ``from snn_explorer... import`` statement binding it."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == "snn_explorer" and a.asname == "se" for a in node.names):
            out["se"] = node
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("snn_explorer")):
            for alias in node.names:
                out[alias.asname or alias.name] = node
    return out


def _offsets(text: str) -> List[int]:
    starts, pos = [0], 0
    for line in text.splitlines(keepends=True):
        pos += len(line)
        starts.append(pos)
    return starts


def rewrite(text: str, where: str, problems: List[str]) -> str:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    imported = _imports(tree)
    starts = _offsets(text)
    at = lambda line, col: starts[line - 1] + col  # noqa: E731  (1-based line, 0-based col -> offset)
    edits: List[Tuple[int, int, str]] = []
    needed: Dict[ast.ImportFrom, set] = {}
    for call in ast.walk(tree):
        if not isinstance(call, ast.Call):
            continue
        verb = _verb(call.func, imported)
        if verb is None:
            continue
        key, spelled = verb
        fields = TABLE[key][1]
        moved = [k for k in call.keywords if k.arg in fields]
        if not moved:
            continue
        if any(k.arg == "options" for k in call.keywords):
            problems.append(f"{where}:{call.lineno}: both options= and option keywords; left alone")
            continue
        stars = [k for k in call.keywords if k.arg is None]
        if stars:
            problems.append(f"{where}:{call.lineno}: **{ast.unparse(stars[0].value)} also passed; moved into the "
                            f"options object: check its keys are {TABLE[key][0]} fields")
            moved += stars
        inner = ", ".join(ast.get_source_segment(text, k) for k in moved)
        edits += _call_edits(call, moved, f"options={spelled}({inner})", at)
        if isinstance(call.func, ast.Name):
            needed.setdefault(imported[call.func.id], set()).add(TABLE[key][0])
    for node, names in needed.items():
        have = {a.name for a in node.names}
        add = sorted(names - have)
        if add:
            old = ast.get_source_segment(text, node)
            new = re.sub(r"\)\s*$", "", old.rstrip())
            closing = ")" if new != old.rstrip() else ""
            new = new.rstrip().rstrip(",") + ", " + ", ".join(add) + closing
            edits.append((at(node.lineno, node.col_offset), at(node.end_lineno, node.end_col_offset), new))
    for start, end, new in sorted(edits, key=lambda e: (-e[0], -e[1])):
        text = text[:start] + new + text[end:]
    return text


def _call_edits(call: ast.Call, moved: list, options: str, at) -> List[Tuple[int, int, str]]:
    """Edits that drop the ``moved`` arguments of ``call`` where they stand and add ``options`` after the last
    argument kept (the call's layout and comments otherwise unchanged)."""
    items = sorted(list(call.args) + list(call.keywords), key=lambda n: (n.lineno, n.col_offset))
    start = [at(n.lineno, n.col_offset) for n in items]
    end = [at(n.end_lineno, n.end_col_offset) for n in items]
    gone = [n in moved for n in items]
    tail = len(items)
    while tail > 0 and gone[tail - 1]:
        tail -= 1  # items[tail:] are moved: one span from the last kept item's end
    edits = [(start[i], start[i + 1], "") for i in range(tail) if gone[i]]
    kept = [i for i in range(tail) if not gone[i]]
    if tail < len(items):
        edits.append((end[kept[-1]] if kept else start[tail], end[-1], ""))
    where = end[kept[-1]] if kept else start[0]
    edits.append((where, where, (", " if kept else "") + options))
    return edits


def _notebook(path: pathlib.Path, problems: List[str]) -> Optional[str]:
    book = json.loads(path.read_text())
    changed = False
    for i, cell in enumerate(book.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        source = "".join(cell["source"])
        new = rewrite(source, f"{path}#cell{i}", problems)
        if new != source:
            cell["source"] = new.splitlines(keepends=True)
            changed = True
    return json.dumps(book, indent=1, ensure_ascii=False) + "\n" if changed else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--verbs", nargs="*", default=sorted(TABLE), help="rewrite calls of these only")
    parser.add_argument("--root", default=".")
    args = parser.parse_args(argv)
    root = pathlib.Path(args.root).resolve()
    for verb in set(TABLE) - set(args.verbs):
        del TABLE[verb]
    problems: List[str] = []
    changed = []
    for path in sorted(p for r in ("snn_explorer", "tests", "benchmarks", "scripts") for p in (root / r).rglob("*.py")):
        if path.resolve() == SELF:
            continue
        before = path.read_text()
        after = rewrite(before, str(path.relative_to(root)), problems)
        if after != before:
            changed.append(path)
            if not args.check:
                path.write_text(after)
    for path in sorted((root / "notebooks").glob("*.ipynb")):
        after = _notebook(path, problems)
        if after is not None:
            changed.append(path)
            if not args.check:
                path.write_text(after)
    ruff = pathlib.Path(sys.executable).with_name("ruff")
    ruff = str(ruff) if ruff.exists() else shutil.which("ruff")
    python_files = [str(p) for p in changed if p.suffix == ".py"]
    if ruff and python_files and not args.check:  # imports the rewrite extended, sorted as the project sorts them
        subprocess.run([ruff, "check", "--fix", "--select", "I", "--quiet", *python_files], cwd=root, check=False)
    print("\n".join(f"rewrite {p.relative_to(root)}" for p in changed) or "nothing to change")
    print("\n".join(problems), file=sys.stderr)
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
