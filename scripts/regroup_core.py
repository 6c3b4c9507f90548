"""Move ``snn_explorer/core`` modules into concept groups and rewrite every reference to the old paths.

Table-driven and idempotent: a file already at its new path is left there, a reference already written
against the new path is left alone, and a second run changes nothing. Run it from the repository root::

    python scripts/regroup_core.py            # move and rewrite
    python scripts/regroup_core.py --check    # list what would change, exit 1 if anything would

What it rewrites:

- dotted paths anywhere in text (``import``, ``from ... import``, ``mock.patch("snn_explorer.core.x.f")``,
  mkdocs ``::: snn_explorer.core.x``) and file paths (``core/x.py``);
- ``from snn_explorer.core import x`` (and ``from ..core import x``, ``from . import x`` inside core)
  where ``x`` is a moved module, split from the other names of the statement;
- relative imports in the package, resolved against the file's old place, written against its new one;
- names moved to another module (``NAME_MOVES``), split out of their ``from`` statement;
- outside ``core``, ``from <core group>.<module> import names`` for names the group's ``__all__``
  exports becomes ``from <core group> import names``.

Files: ``*.py`` under snn_explorer/, tests/, benchmarks/, scripts/; notebooks (``*.ipynb``) and docs
``*.md`` anywhere under notebooks/ and docs/, README.md and mkdocs.yml.
"""
from __future__ import annotations

import argparse
import ast
import pathlib
import re
import shutil
import subprocess
import sys
from typing import Dict, List, Optional, Sequence, Set, Tuple

PACKAGE = "snn_explorer"
CORE = f"{PACKAGE}.core"

#: Group of each moved core module (old name relative to ``core`` -> new name relative to ``core``).
GROUPS = {
    "common": ("vocabulary", "validate", "serialize", "collectives", "topology", "modes", "precision",
               "young_objects"),
    "model": ("walk", "module_copy", "model_memo", "neurons", "structure", "layouts", "attention", "dataflow",
              "analysis"),
    "tp": ("styles", "channel_styles", "tp_plan"),
    "levers": ("memory_levers", "block_choice", "chunk_choice", "activation_offload", "spike_compression"),
    "planning": ("pipeline_plan", "pipeline_schedules", "recommend", "plan_types", "planner"),
    "checkpoints": ("checkpoint", "checkpoint_files", "checkpoint_integrity", "checkpoint_lock",
                    "checkpoint_tensors"),
}
MOVES: Dict[str, str] = {f"{CORE}.{name}": f"{CORE}.{group}.{name}" for group, names in GROUPS.items()
                         for name in names}
#: ``core/plans`` was a one-module package: its module becomes ``model/families``.
MOVES.update({f"{CORE}.plans.families": f"{CORE}.model.families", f"{CORE}.plans": f"{CORE}.model.families"})
#: Files to move (old path -> new path), and packages left empty by the move (removed).
FILE_MOVES = {f"snn_explorer/core/{name}.py": f"snn_explorer/core/{group}/{name}.py"
              for group, names in GROUPS.items() for name in names}
FILE_MOVES["snn_explorer/core/plans/families.py"] = "snn_explorer/core/model/families.py"
REMOVED_FILES = ("snn_explorer/core/plans/__init__.py",)
GROUP_DOCS = {
    "common": "Vocabulary shared by every core group: names, validation, serialization, topology, modes, precision.",
    "model": "What a model is: its walk, neurons, structure, layouts, attention, dataflow, families and analysis.",
    "tp": "Tensor parallelism: the style of each layer, its torch implementation, and the per-layer TP plan.",
    "levers": "Memory levers: activation checkpointing, blocks and time chunks, offload, spike compression.",
    "planning": "From an analysis to a plan: pipeline layout and schedules, recommendation, plan types, planner.",
    "checkpoints": "Distributed checkpoints: files, integrity, the writer lock, tensors, save and load.",
}
#: Names moved from one module to another, keyed by (new module path, name) -> module path now holding it.
NAME_MOVES: Dict[Tuple[str, str], str] = {
    (f"{CORE}.planning.pipeline_plan", "pipeline_units"): f"{CORE}.model.units",
    (f"{CORE}.planning.pipeline_plan", "trainable_units"): f"{CORE}.model.units",
    (f"{CORE}.planning.pipeline_plan", "TIME_LOOP_SIGNS"): f"{CORE}.model.units",
    (f"{CORE}.planning.pipeline_plan", "TIME_LOOP_HINT"): f"{CORE}.model.units",
}
#: Constants that leave the public face (``snn_explorer`` and ``snn_explorer.core``) for their group.
FACE_CONSTANTS = {"ACTIVATION_CHECKPOINTING": "levers", "MODES": "common", "PRECISIONS": "common",
                  "TP_STYLES": "tp", "BATCH_MAJOR": "model", "TIME_MAJOR": "model", "PER_STEP": "model",
                  "SNN_DISTRIBUTED_PREFERENCES": "planning", "NEURON_BACKENDS": "planning"}
for _name, _group in FACE_CONSTANTS.items():
    NAME_MOVES[(CORE, _name)] = NAME_MOVES[(PACKAGE, _name)] = f"{CORE}.{_group}"
#: Renamed names: (module now holding it, old name) -> new name.
RENAMES = {(f"{CORE}.planning", "BACKENDS"): "NEURON_BACKENDS", (f"{CORE}.planning.recommend", "BACKENDS"):
           "NEURON_BACKENDS", (CORE, "BACKENDS"): "NEURON_BACKENDS", (PACKAGE, "BACKENDS"): "NEURON_BACKENDS",
           (f"{PACKAGE}.ranks", "BACKENDS"): "COMM_BACKENDS", (f"{PACKAGE}.ranks.engine", "BACKENDS"): "COMM_BACKENDS"}

PY_ROOTS = ("snn_explorer", "tests", "benchmarks", "scripts")
TEXT_GLOBS = ("notebooks/**/*.ipynb", "docs/**/*.ipynb", "docs/**/*.md", "notebooks/**/*.md", "README.md",
              "mkdocs.yml")
SELF = pathlib.Path(__file__).resolve()


def _old_names_pattern() -> re.Pattern:
    olds = sorted((old[len(CORE) + 1:] for old in MOVES), key=len, reverse=True)
    return re.compile(r"(?<![\w.])(?:snn_explorer|se)\.core\.(" + "|".join(re.escape(o) for o in olds) + r")(?![\w])")


def _renamed(name: str) -> str:
    return RENAMES.get((CORE, name), name)


DOTTED = _old_names_pattern()
#: ``se.MODES``, ``snn_explorer.MODES``, ``snn_explorer.core.MODES``: a constant read off the public face.
FACE = re.compile(r"(?<![\w.])(se|snn_explorer)\.(core\.)?(" + "|".join(sorted(FACE_CONSTANTS) + ["BACKENDS"])
                  + r")\b")
FILE_PATH = re.compile(r"(?<![\w.])((?:snn_explorer/)?core/)(" + "|".join(
    sorted({re.escape(p[len("snn_explorer/core/"):-3]) for p in FILE_MOVES}, key=len, reverse=True)) + r")\.py\b")


def map_module(name: str) -> str:
    """The new dotted path for ``name`` (a module or a ``module.attribute`` path); unchanged if not moved."""
    for old in sorted(MOVES, key=len, reverse=True):
        if name == old or name.startswith(old + "."):
            new = MOVES[old] + name[len(old):]
            module, _, attr = new.rpartition(".")
            if attr and (module, attr) in NAME_MOVES:
                return f"{NAME_MOVES[(module, attr)]}.{attr}"
            return new
    module, _, attr = name.rpartition(".")
    if (module, attr) in NAME_MOVES:
        return f"{NAME_MOVES[(module, attr)]}.{attr}"
    return name


def rewrite_dotted(text: str) -> str:
    """Dotted module paths and ``core/x.py`` file paths in any text."""
    def dotted(match: re.Match) -> str:
        alias = match.group(0)[: match.group(0).index(".core.")]  # snn_explorer, or the notebooks' se
        whole = CORE + match.group(0)[len(alias) + len(".core"):]
        tail = re.match(r"[\w.]*", text[match.end():]).group(0)  # a following .attr path, for NAME_MOVES
        first = tail.split(".")[1] if tail.startswith(".") and len(tail) > 1 else ""
        new = map_module(whole + ("." + first if first else ""))
        new = new[: len(new) - len(first) - 1] if first and new.endswith("." + first) else new
        return alias + new[len(PACKAGE):]

    text = DOTTED.sub(dotted, text)
    text = FACE.sub(lambda m: f"{m.group(1)}.{'core.' if m.group(2) is None else m.group(2)}"
                    f"{FACE_CONSTANTS[_renamed(m.group(3))]}.{_renamed(m.group(3))}", text)
    text = FILE_PATH.sub(lambda m: m.group(1) + MOVES[f"{CORE}.{m.group(2)}"][len(CORE) + 1:].replace(".", "/")
                         + ".py", text)
    return text


# --- Python files -----------------------------------------------------------------------------------------

def module_of(path: pathlib.Path, root: pathlib.Path) -> Optional[str]:
    """The dotted module of a file under the package, or None outside it."""
    rel = path.relative_to(root)
    if rel.parts[0] != PACKAGE:
        return None
    parts = list(rel.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def known_modules(root: pathlib.Path) -> Set[str]:
    """Every module of the package once moved: files present, plus the new paths of the table."""
    found = {module_of(p, root) for p in (root / PACKAGE).rglob("*.py")}
    found |= set(MOVES.values()) | {m.rpartition(".")[0] for m in MOVES.values()}
    found |= set(NAME_MOVES.values())
    return {m for m in found if m} - set(MOVES)


def _package_of(module: str, is_package: bool) -> List[str]:
    return module.split(".") if is_package else module.split(".")[:-1]


def _resolve(package: List[str], level: int, module: Optional[str]) -> str:
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _relative(package: List[str], target: str) -> Tuple[int, str]:
    """(level, module) of a relative import of ``target`` from a module in ``package``."""
    parts = target.split(".")
    common = 0
    while common < min(len(package), len(parts)) and package[common] == parts[common]:
        common += 1
    return len(package) - common + 1, ".".join(parts[common:])


def _exported(root: pathlib.Path) -> Dict[str, Set[str]]:
    """``__all__`` of each core group package, read from its ``__init__.py``."""
    out = {}
    for group in (*GROUPS, "parallelize"):
        init = root / PACKAGE / "core" / group / "__init__.py"
        if not init.exists():
            continue
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
                out[f"{CORE}.{group}"] = set(ast.literal_eval(node.value))
    return out


class PyFile:
    """One Python file's import rewriting: ``old_module`` is where its relative imports were written."""

    def __init__(self, path: pathlib.Path, root: pathlib.Path, modules: Set[str], exported: Dict[str, Set[str]]):
        self.path, self.root, self.modules, self.exported = path, root, modules, exported
        self.is_package = path.name == "__init__.py"
        self.renamed: Set[Tuple[str, str]] = set()
        self.module = module_of(path, root)
        new_path = FILE_MOVES.get(str(path.relative_to(root)))
        self.new_module = module_of(root / new_path, root) if new_path else self.module
        reverse = {v: k for k, v in FILE_MOVES.items()}
        old_path = reverse.get(str(path.relative_to(root)))
        self.old_module = module_of(root / old_path, root) if old_path else self.module

    def _target(self, level: int, module: Optional[str]) -> str:
        """The absolute module a relative import names: against the file's place now, or its old place
        when that does not name a module (a line written before the move)."""
        here = _resolve(_package_of(self.module, self.is_package), level, module)
        if here in self.modules or here in MOVES:
            return here
        return _resolve(_package_of(self.old_module, self.is_package), level, module)

    def _spell(self, target: str, relative: bool) -> str:
        if not relative:
            return target
        level, rest = _relative(_package_of(self.new_module, self.is_package), target)
        return "." * level + rest

    def _split(self, base: str, names: Sequence[ast.alias]) -> List[Tuple[str, List[ast.alias]]]:
        """Group the names of ``from base import names`` by the module that holds each after the move."""
        groups: Dict[str, List[ast.alias]] = {}
        for alias in names:
            full = f"{base}.{alias.name}"
            if full in MOVES:  # a moved module imported from its package
                new = MOVES[full]
                if new.rsplit(".", 1)[-1] == alias.name:
                    groups.setdefault(new.rpartition(".")[0], []).append(alias)
                else:  # core.plans imported as a module: import the new module under the old name
                    groups.setdefault(new.rpartition(".")[0], []).append(
                        ast.alias(name=new.rsplit(".", 1)[-1], asname=alias.asname or alias.name))
                continue
            mapped = map_module(full)
            owner = mapped.rpartition(".")[0] if mapped != full else map_module(base)
            groups.setdefault(owner, []).append(alias)
        if not (self.module or "").startswith(CORE):
            groups = self._route(groups)
        for owner, aliases in groups.items():
            for i, alias in enumerate(aliases):
                new = RENAMES.get((owner, alias.name)) or RENAMES.get((base, alias.name))
                if new:
                    aliases[i] = ast.alias(name=new, asname=alias.asname if alias.asname != new else None)
                    self.renamed.add((alias.name, new) if not alias.asname else ("", ""))
        return list(groups.items())

    def _route(self, groups: Dict[str, List[ast.alias]]) -> Dict[str, List[ast.alias]]:
        """Outside core: names a group exports are imported from the group package."""
        out: Dict[str, List[ast.alias]] = {}
        for owner, names in groups.items():
            group = next((g for g in self.exported if owner.startswith(g + ".")), None)
            for alias in names:
                key = group if group and alias.name in self.exported[group] else owner
                out.setdefault(key, []).append(alias)
        return out

    def rewrite(self, text: str) -> str:
        tree = ast.parse(text)
        lines = text.splitlines(keepends=True)
        edits = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                new = self._import_from(node, lines)
                if new is not None:
                    edits.append((node.lineno, node.end_lineno, new))
        for start, end, new in sorted(edits, reverse=True):
            lines[start - 1:end] = [new]
        text = "".join(lines)
        for old, new in self.renamed - {("", "")}:  # the imported name is used under its new name
            text = re.sub(r"(?<![\w.\"'])" + old + r"\b", new, text)
        return rewrite_dotted(text)

    def _import_from(self, node: ast.ImportFrom, lines: List[str]) -> Optional[str]:
        relative = node.level > 0
        if relative and self.module is None:
            return None
        base = self._target(node.level, node.module) if relative else (node.module or "")
        moving = self.new_module != self.module
        if base != CORE and not base.startswith(CORE + ".") and not (relative and moving) \
                and not (base in (PACKAGE, f"{PACKAGE}.ranks", f"{PACKAGE}.ranks.engine")
                         and any((base, a.name) in NAME_MOVES or (base, a.name) in RENAMES for a in node.names)):
            return None
        parts = self._split(MOVES.get(base) or map_module(base), node.names)
        written = "." * node.level + (node.module or "") if relative else base
        if len(parts) == 1 and self._spell(parts[0][0], relative) == written \
                and [a.name for a in parts[0][1]] == [a.name for a in node.names]:
            return None  # nothing moves
        indent = re.match(r"\s*", lines[node.lineno - 1]).group(0)
        comment = _trailing_comment(lines[node.end_lineno - 1])
        statements = []
        for owner, names in parts:
            spelled = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in names)
            statements.append(f"{indent}from {self._spell(owner, relative)} import {spelled}")
        if comment:
            statements[0] += "  " + comment
        rest = lines[node.end_lineno - 1][node.end_col_offset:].rstrip("\n")
        return "\n".join(_wrap(s, indent) for s in statements) + (rest if not comment else "") + "\n"


def _trailing_comment(line: str) -> str:
    match = re.search(r"#.*$", line.rstrip("\n"))
    return match.group(0) if match and "import" not in match.group(0) else ""


def _wrap(statement: str, indent: str, width: int = 120) -> str:
    """A ``from x import a, b`` statement, wrapped in parentheses when longer than ``width``."""
    if len(statement) <= width:
        return statement
    head, _, names = statement.partition(" import ")
    out, line = [], f"{head} import ("
    for name in names.split(", "):
        piece = name + ", "
        if len(line) + len(piece) > width:
            out.append(line.rstrip())
            line = indent + "    "
        line += piece
    out.append(line.rstrip().rstrip(",") + ")")
    return "\n".join(out)


# --- the run -----------------------------------------------------------------------------------------------

def move_files(root: pathlib.Path, dry: bool) -> List[str]:
    done = []
    for old, new in FILE_MOVES.items():
        if (root / old).exists() and not (root / new).exists():
            done.append(f"git mv {old} {new}")
            if not dry:
                (root / new).parent.mkdir(parents=True, exist_ok=True)
                subprocess.run(["git", "mv", old, new], cwd=root, check=True)
    for group, doc in GROUP_DOCS.items():
        init = root / "snn_explorer" / "core" / group / "__init__.py"
        if not init.exists():
            done.append(f"create {init.relative_to(root)}")
            if not dry:
                init.parent.mkdir(parents=True, exist_ok=True)
                init.write_text(f'"""{doc}"""\n')
                subprocess.run(["git", "add", str(init)], cwd=root, check=True)
    for gone in REMOVED_FILES:
        if (root / gone).exists():
            done.append(f"git rm {gone}")
            if not dry:
                subprocess.run(["git", "rm", "-q", "-f", gone], cwd=root, check=True)
    return done


def files(root: pathlib.Path) -> Tuple[List[pathlib.Path], List[pathlib.Path]]:
    py = sorted(p for r in PY_ROOTS for p in (root / r).rglob("*.py")
                if ".venv" not in p.parts and p.resolve() != SELF)
    text = sorted({p for g in TEXT_GLOBS for p in root.glob(g) if ".ipynb_checkpoints" not in p.parts})
    return py, text


def run(root: pathlib.Path, dry: bool) -> List[str]:
    changed = []
    for key, target in list(NAME_MOVES.items()):  # a name moves only once its new module exists
        where = root / target.replace(".", "/")
        if not (where.with_suffix(".py").exists() or (where / "__init__.py").exists()):
            del NAME_MOVES[key]
    modules = known_modules(root)
    exported = _exported(root)
    py, text = files(root)
    for path in py:  # rewrite first: relative imports resolve against the file's place before the move
        before = path.read_text()
        after = PyFile(path, root, modules, exported).rewrite(before)
        if after != before:
            changed.append(f"rewrite {path.relative_to(root)}")
            if not dry:
                path.write_text(after)
    _sort_imports(root, [root / c.split(" ", 1)[1] for c in changed], dry)
    for path in text:
        before = path.read_text()
        after = rewrite_dotted(before)
        if after != before:
            changed.append(f"rewrite {path.relative_to(root)}")
            if not dry:
                path.write_text(after)
    return changed + move_files(root, dry)


def _sort_imports(root: pathlib.Path, paths: List[pathlib.Path], dry: bool) -> None:
    """Re-sort the rewritten files' imports with ruff (the project's isort rules), when ruff is at hand."""
    ruff = pathlib.Path(sys.executable).with_name("ruff")
    ruff = str(ruff) if ruff.exists() else shutil.which("ruff")
    if dry or not paths or ruff is None:
        return
    subprocess.run([ruff, "check", "--fix", "--select", "I", "--quiet", *map(str, paths)], cwd=root, check=False)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="list what would change; exit 1 if anything would")
    parser.add_argument("--root", default=".", help="repository root (default: the current folder)")
    args = parser.parse_args(argv)
    changes = run(pathlib.Path(args.root).resolve(), dry=args.check)
    print("\n".join(changes) if changes else "nothing to change")
    return 1 if args.check and changes else 0


if __name__ == "__main__":
    sys.exit(main())
