"""The package's structure, read from its source: kvjax's modules import one another without a circle, and no
module reaches into another's private names.

- **No import circle** among ``kvjax``'s modules, counting imports inside functions too (a lazy import hides a
  circle from Python, not from a reader): the graph of "module A imports module B" has no strongly connected
  component of two or more modules.
- **No circle at import time either**: importing ``kvjax.a.b`` first runs the package ``kvjax.a``'s
  ``__init__``, so that import leads to whatever the ``__init__`` imports; with those edges added the graph still
  has no circle (a low module inside a package whose ``__init__`` imports high ones would make one), and every
  module imports alone in a fresh interpreter.
- **Floors**: the packages stand on floors (``kvjax/__init__.py`` lists them) and a module imports only its own
  package and the floors below it.
- **No private reach-in**: no ``from kvjax.x import _name`` and no ``x._name`` on an imported kvjax module from
  outside it, in ``kvjax/``, ``eval/``, ``train_less/`` and ``benchmarks/`` (tests may look inside).

Plain ``ast`` parsing, no JAX work.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvjax"
CODE = ("kvjax", "eval", "train_less", "benchmarks")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def known_modules() -> set[str]:
    return {module_name(p) for p in PACKAGE.rglob("*.py")}


def resolve(name: str, modules: set[str]) -> str | None:
    """The kvjax module ``name`` refers to (a module, or the package whose attribute it is), else None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports(tree: ast.AST, modules: set[str]) -> list[tuple[str, str, int]]:
    """``(kvjax module, imported name or "", line)`` of every import in ``tree`` (module and function level);
    ``from kvjax.engine import core`` gives ``("kvjax.engine.core", "", line)``, ``from kvjax.engine.core import plan``
    ``("kvjax.engine.core", "plan", line)`` (the code imports absolutely: no relative imports)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if (m := resolve(a.name, modules)) is not None:
                    out.append((m, "", node.lineno))
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"line {node.lineno}: a relative import; the code imports absolutely"
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in modules:
                    out.append((full, "", node.lineno))
                elif (m := resolve(node.module, modules)) is not None:
                    out.append((m, a.name, node.lineno))
    return out


def import_graph(packages: bool = False) -> dict[str, set[str]]:
    """``module -> the kvjax modules it imports``; with ``packages``, also the packages whose ``__init__`` such an
    import runs first (every package above the target that is not also above the importer)."""
    modules = known_modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for path in PACKAGE.rglob("*.py"):
        here = module_name(path)
        for target, _, _ in imports(ast.parse(path.read_text(encoding="utf-8")), modules):
            if target != here and not here.startswith(target + "."):  # a package's own submodules import it
                graph[here].add(target)
            if packages:
                parts = target.split(".")
                for n in range(2, len(parts)):
                    pkg = ".".join(parts[:n])
                    if pkg in modules and not here.startswith(pkg + ".") and pkg != here:
                        graph[here].add(pkg)
    return graph


#: the floors of ``kvjax/`` (``kvjax/__init__.py``'s docstring): a unit is a package or a top-level module
FLOORS = {
    "kvjax.budget": 0,
    "kvjax.config": 0,
    "kvjax.sharding": 0,
    "kvjax.model": 1,
    "kvjax.loading": 2,
    "kvjax.methods": 3,
    "kvjax.engine": 4,
    "kvjax.analysis": 5,
    "kvjax.calibrate_chelsea": 5,
    "kvjax.cli": 5,
    "kvjax": 6,
}
FLAT = {0, 5}  # floors of loose modules, which may import one another (no circle: checked above)


def unit(module: str) -> str:
    return ".".join(module.split(".")[:2])


def floor_breaks(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for a, targets in graph.items():
        for b in targets:
            ua, ub = unit(a), unit(b)
            fa, fb = FLOORS[ua], FLOORS[ub]
            if ua != ub and not fb < fa and not (fa == fb and fa in FLAT):
                out.append(f"{a} (floor {fa}) imports {b} (floor {fb})")
    return sorted(out)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of two or more modules (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def private_reach_ins() -> list[str]:
    modules = known_modules()
    found = []
    for top in CODE:
        for path in (ROOT / top).rglob("*.py"):
            here = module_name(path)
            tree = ast.parse(path.read_text(encoding="utf-8"))
            aliases = {}
            for node in ast.walk(tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    for a in node.names:
                        if isinstance(node, ast.Import):
                            if a.asname and a.name in modules:
                                aliases[a.asname] = a.name
                        else:
                            full = f"{node.module}.{a.name}"
                            if full in modules:
                                aliases[a.asname or a.name] = full
            for target, name, line in imports(tree, modules):
                if name.startswith("_") and not name.startswith("__") and target != here:
                    found.append(f"{path.relative_to(ROOT)}:{line}: from {target} import {name}")
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id in aliases
                    and aliases[node.value.id] != here
                    and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
    return sorted(set(found))


def test_the_parser_sees_circles_and_reach_ins():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    tree = ast.parse(
        "from kvjax.engine.core import _hidden, plan\nimport kvjax.engine as E\n"
        "def f():\n    from kvjax.engine import core\n"
    )
    got = imports(tree, {"kvjax", "kvjax.engine.core", "kvjax.engine"})
    assert got == [
        ("kvjax.engine.core", "_hidden", 1),
        ("kvjax.engine.core", "plan", 1),
        ("kvjax.engine", "", 2),
        ("kvjax.engine.core", "", 4),
    ]


def test_kvjax_has_no_import_circle():
    found = circles(import_graph())
    assert not found, "kvjax modules that import each other (in a circle):\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_circle_at_import_time_and_every_module_imports_alone():
    found = circles(import_graph(packages=True))
    assert not found, "an import that runs a package's __init__ leads back to the importer:\n" + "\n".join(
        " -> ".join(c) for c in found
    )
    names = sorted(m for m in known_modules() if m != "kvjax")
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    for m in [m for m in sys.modules if m == 'kvjax' or m.startswith('kvjax.')]:\n"
        "        del sys.modules[m]\n"
        "    importlib.import_module(name)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_every_unit_has_a_floor_and_imports_only_below_it():
    graph = import_graph()
    assert {unit(m) for m in graph} == set(FLOORS), "a new package or top-level module: give it a floor in FLOORS"
    assert floor_breaks({"kvjax.model.rope": {"kvjax.engine.core"}}) == [
        "kvjax.model.rope (floor 1) imports kvjax.engine.core (floor 4)"
    ]
    assert floor_breaks({"kvjax.loading.load": {"kvjax.methods.h2o"}})
    found = floor_breaks(graph)
    assert not found, "imports that go up a floor (move the code down, or the import up):\n" + "\n".join(found)


def test_no_module_reaches_into_another_modules_private_names():
    found = private_reach_ins()
    assert not found, (
        "private names used from another module (make them public, or move the code to where it belongs):\n"
        + "\n".join(found)
    )
