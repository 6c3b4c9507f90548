"""The package's layers, read from its source with ``ast`` (imports inside functions included).

Packages: ``compat`` <- ``compat_dcp``, ``compat_pipelining``, ``compat_elastic``, ``compat_fake`` <- ``core`` <- ``zoo``, ``ranks`` <- ``estimator``, ``launcher`` <- ``explorer``
<- ``cli``, ``quickstart``; inside the estimator: ``instruments`` <- ``profile`` <- ``memory`` <-
``timing`` <- ``calibration``, ``measurement`` <- its public face; inside the core (its ``__init__`` says
what each group holds): ``common`` <- ``model`` <- ``tp`` <- ``levers`` <- ``planning`` <- ``parallelize``
<- ``checkpoints`` <- ``runtime`` <- ``distribute`` <- its public face. Outside the core, a name a core
group exports (its ``__all__``) is imported from the group package, not from the module defining it. An import may point only down (or
within its own part), no import may close a circle, and an import inside a function must say why
it cannot sit at the top (a ``# lazy:`` comment: an optional or heavy dependency, a fast start).
Each rule is first shown to catch a planted violation.
"""
from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest

import snn_explorer

ROOT = pathlib.Path(snn_explorer.__file__).parent
PACKAGE = "snn_explorer"

#: Rank of each part of the package: an import must point to a lower rank (or stay in its part).
LAYERS = {"compat": 0, "compat_dcp": 0.5, "compat_pipelining": 0.5, "compat_elastic": 0.5, "compat_fake": 0.5, "core": 1, "zoo": 2, "ranks": 2, "estimator": 3, "launcher": 3, "explorer": 4, "cli": 5,
          "quickstart": 5, "": 6}
CORE_LAYERS = {"common": 0, "model": 1, "tp": 2, "levers": 3, "planning": 4, "parallelize": 5, "checkpoints": 6,
               "runtime": 7, "distribute": 8, "": 9}
ESTIMATOR_LAYERS = {"instruments": 0, "profile": 1, "memory": 2, "timing": 3, "calibration": 4, "measurement": 4,
                    "": 5}


class Import:
    """One import statement: the module holding it, the module it names, its line, whether it sits in a function."""

    def __init__(self, source: str, target: str, line: int, in_function: bool, lazy: bool):
        self.source, self.target, self.line, self.in_function, self.lazy = source, target, line, in_function, lazy

    def __repr__(self) -> str:
        return f"{self.source}:{self.line} -> {self.target}"


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PACKAGE, *parts])


def _resolve(source: str, is_package: bool, node: ast.ImportFrom) -> str:
    base = source.split(".") if is_package else source.split(".")[:-1]
    if node.level:
        base = base[:len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))
    return node.module or ""


def _targets(source: str, is_package: bool, node, modules: Set[str]) -> Iterator[str]:
    """The package's own modules an import statement loads (``from pkg import mod`` names ``pkg.mod``)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = _resolve(source, is_package, node)
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    for name in names:
        if name == PACKAGE or name.startswith(PACKAGE + "."):
            while name not in modules and "." in name:
                name = name.rsplit(".", 1)[0]
            yield name


def _functions_imports(tree: ast.AST) -> Set[int]:
    inside = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside |= {id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return inside


def imports_of(root: pathlib.Path) -> Tuple[Set[str], List[Import], List[Import]]:
    """(every module, imports of the package's own modules, imports inside functions) under ``root``."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    own, in_functions = [], []
    for source, path in files.items():
        text = path.read_text()
        lines, tree = text.splitlines(), ast.parse(text)
        inside = _functions_imports(tree)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            around = " ".join(lines[max(0, node.lineno - 2):node.end_lineno])
            is_function = id(node) in inside
            for target in set(_targets(source, path.name == "__init__.py", node, set(files))) or {None}:
                record = Import(source, target or "", node.lineno, is_function, "# lazy:" in around)
                if target:
                    own.append(record)
                if is_function:
                    in_functions.append(record)
    return set(files), own, in_functions


def _part(module: str, table: Dict[str, int], prefix: str) -> Optional[str]:
    if module != prefix and not module.startswith(prefix + "."):
        return None
    rest = module[len(prefix) + 1:].split(".") if module != prefix else [""]
    return rest[0] if rest[0] in table else ""


def upward(imports: List[Import]) -> List[Import]:
    """Imports pointing up a layer or sideways to a part of the same rank, in the package or the estimator."""
    bad = []
    for table, prefix in ((LAYERS, PACKAGE), (ESTIMATOR_LAYERS, f"{PACKAGE}.estimator"), (CORE_LAYERS, f"{PACKAGE}.core")):
        for imp in imports:
            src, dst = _part(imp.source, table, prefix), _part(imp.target, table, prefix)
            if src is not None and dst is not None and src != dst and table[dst] >= table[src]:
                bad.append(imp)
    return bad


def _packages_run(source: str, target: str, modules: Set[str]) -> Set[str]:
    """The packages whose ``__init__`` importing ``target`` runs first: its ancestors, except those of
    ``source`` (already running when ``source`` is imported)."""
    parts, own = target.split("."), set()
    source_parts = source.split(".")
    for i in range(1, len(parts)):
        package = ".".join(parts[:i])
        if package in modules and source_parts[:i] != parts[:i]:
            own.add(package)
    return own


def circles(modules: Set[str], imports: List[Import]) -> List[List[str]]:
    """Every import circle between modules (strongly connected components of two or more, or a self-import)."""
    graph: Dict[str, Set[str]] = {m: set() for m in modules}
    for imp in imports:
        graph[imp.source].add(imp.target)
        graph[imp.source] |= _packages_run(imp.source, imp.target, modules)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def unexplained(in_functions: List[Import]) -> List[Import]:
    return [imp for imp in in_functions if not imp.lazy]


@pytest.fixture(scope="module")
def package():
    return imports_of(ROOT)


def test_no_import_points_up_a_layer(package):
    assert upward(package[1]) == []


def test_no_import_circle_anywhere(package):
    modules, own, _ = package
    assert circles(modules, own) == []


def test_every_import_inside_a_function_says_why(package):
    assert unexplained(package[2]) == []


def _planted(tmp_path: pathlib.Path, files: Dict[str, str]) -> Tuple[Set[str], List[Import], List[Import]]:
    root = tmp_path / PACKAGE
    for name, text in {"__init__.py": "", "core/__init__.py": "", "estimator/__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return imports_of(root)


def test_the_rules_catch_planted_violations(tmp_path):
    modules, own, in_functions = _planted(tmp_path, {
        "core/plan.py": "def f():\n    from ..estimator import timing\n",  # up a layer, in a function
        "estimator/timing.py": "from ..core import plan\n",  # down: allowed, but closes a circle with core/plan
        "estimator/memory/__init__.py": "",
        "estimator/memory/peak.py": "from ..timing import x\n",  # memory -> timing: up inside the estimator
        "estimator/profile.py": "def g():\n    import json  # lazy: only the CLI reads JSON\n",
        "core/runtime.py": "from .checkpoints.store import save\n",  # a circle through a package's __init__:
        "core/checkpoints/__init__.py": "",
        "core/checkpoints/store.py": "from ..parallelize.pipeline import Stage\n",  # -> parallelize/__init__
        "core/parallelize/__init__.py": "from ..runtime import Runtime\n",  # -> runtime (up a core group)
        "core/parallelize/pipeline.py": "",
    })
    assert sorted(repr(i) for i in upward(own)) == [
        "snn_explorer.core.parallelize:1 -> snn_explorer.core.runtime",
        "snn_explorer.core.plan:2 -> snn_explorer.estimator.timing",
        "snn_explorer.estimator.memory.peak:1 -> snn_explorer.estimator.timing"]
    assert circles(modules, own) == [["snn_explorer.core.checkpoints.store", "snn_explorer.core.parallelize",
                                      "snn_explorer.core.runtime"],
                                     ["snn_explorer.core.plan", "snn_explorer.estimator.timing"]]
    assert [repr(i) for i in unexplained(in_functions)] == ["snn_explorer.core.plan:2 -> snn_explorer.estimator.timing"]


def test_importing_every_module_leaves_the_process_environment_alone(tmp_path):
    """Module-level imports only: none may load torch's compiler, which sets TORCHINDUCTOR_CACHE_DIR and
    makes a folder under TMPDIR (torch.distributed.pipelining and tensor.debug do; compat imports them on use)."""
    probe = ("import importlib, os, pkgutil, snn_explorer as se\n"
             "for m in pkgutil.walk_packages(se.__path__, 'snn_explorer.'):\n"
             "    importlib.import_module(m.name)\n"
             "print(os.environ.get('TORCHINDUCTOR_CACHE_DIR'), sorted(os.listdir(os.environ['TMPDIR'])))\n")
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT.parent))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["None", "[]"]


CORE_GROUPS = [name for name in CORE_LAYERS if name and (ROOT / "core" / name / "__init__.py").exists()]


def group_exports(root: pathlib.Path) -> Dict[str, Set[str]]:
    """``__all__`` of each core group package, read from its ``__init__.py`` (a group without one: no entry)."""
    out = {}
    for group in CORE_LAYERS:
        init = root / "core" / group / "__init__.py"
        if group and init.exists():
            for node in ast.parse(init.read_text()).body:
                if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
                    out[group] = set(ast.literal_eval(node.value))
    return out


def deep_imports(root: pathlib.Path, exports: Dict[str, Set[str]]) -> List[str]:
    """``from <core group>.<module> import name`` outside the core, for names the group exports."""
    bad = []
    for path in root.rglob("*.py"):
        source = module_name(path, root)
        if source.startswith(f"{PACKAGE}.core"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(source, path.name == "__init__.py", node).split(".")
                if target[:2] == [PACKAGE, "core"] and len(target) > 3 and target[2] in exports:
                    bad += [f"{source}:{node.lineno} {a.name}" for a in node.names if a.name in exports[target[2]]]
    return bad


def test_core_groups_are_the_ones_listed():
    on_disk = sorted(p.parent.name for p in (ROOT / "core").glob("*/__init__.py"))
    assert on_disk == sorted(CORE_GROUPS)
    assert sorted(p.stem for p in (ROOT / "core").glob("*.py")) == ["__init__", "distribute", "runtime"]


def test_every_core_group_lists_its_public_names():
    exports = group_exports(ROOT)
    assert sorted(exports) == sorted(CORE_GROUPS)
    for group, names in exports.items():
        module = __import__(f"{PACKAGE}.core.{group}", fromlist=["__all__"])
        assert names and all(hasattr(module, n) for n in names), group


def test_outside_the_core_exported_names_come_from_their_group():
    assert deep_imports(ROOT, group_exports(ROOT)) == []


def test_the_core_rules_catch_planted_violations(tmp_path):
    modules, own, _ = _planted(tmp_path, {
        "core/common/__init__.py": "", "core/tp/__init__.py": '__all__ = ["STYLES"]\nSTYLES = {}\n',
        "core/common/modes.py": "from ..tp import STYLES\n",  # common -> tp: up a group
        "core/tp/styles.py": "from ..common import modes\n",  # tp -> common: down, allowed
        "core/runtime.py": "def f():\n    from .distribute import apply  # lazy: planted\n",  # runtime -> distribute
        "core/distribute.py": "",
        "ranks/__init__.py": "", "ranks/engine.py": "from ..core.tp.styles import STYLES, other\n",
    })
    assert sorted(repr(i) for i in upward(own)) == ["snn_explorer.core.common.modes:1 -> snn_explorer.core.tp",
                                                     "snn_explorer.core.runtime:2 -> snn_explorer.core.distribute"]
    root = tmp_path / PACKAGE
    assert deep_imports(root, group_exports(root)) == ["snn_explorer.ranks.engine:1 STYLES"]


def test_each_core_class_is_defined_once():
    """A class name names one class in the core (a TP style and its torch implementation differ in name)."""
    where: Dict[str, List[str]] = {}
    for path in (ROOT / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where.setdefault(node.name, []).append(module_name(path, ROOT))
    assert {name: mods for name, mods in where.items() if len(mods) > 1} == {}
    assert where["ConvColwise"] == ["snn_explorer.core.tp.styles"]
    assert where["ConvColwiseParallel"] == ["snn_explorer.core.tp.channel_styles"]
