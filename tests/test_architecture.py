"""The package's structure, read from its source: kvjax's modules import one another without a circle, and no
module reaches into another's private names.

- **No import circle** among ``kvjax``'s modules, counting imports inside functions too (a lazy import hides a
  circle from Python, not from a reader): the graph of "module A imports module B" has no strongly connected
  component of two or more modules.
- **No private reach-in**: no ``from kvjax.x import _name`` and no ``x._name`` on an imported kvjax module from
  outside it, in ``kvjax/``, ``eval/``, ``train_less/`` and ``benchmarks/`` (tests may look inside).

Plain ``ast`` parsing, no JAX work.
"""

from __future__ import annotations

import ast
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
    ``from kvjax import core`` gives ``("kvjax.core", "", line)``, ``from kvjax.core import plan``
    ``("kvjax.core", "plan", line)`` (the code imports absolutely: no relative imports)."""
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


def import_graph() -> dict[str, set[str]]:
    modules = known_modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for path in PACKAGE.rglob("*.py"):
        here = module_name(path)
        for target, _, _ in imports(ast.parse(path.read_text(encoding="utf-8")), modules):
            if target != here and not here.startswith(target + "."):  # a package's own submodules import it
                graph[here].add(target)
    return graph


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
        "from kvjax.core import _hidden, plan\nimport kvjax.engine as E\ndef f():\n    from kvjax import core\n"
    )
    got = imports(tree, {"kvjax", "kvjax.core", "kvjax.engine"})
    assert got == [
        ("kvjax.core", "_hidden", 1),
        ("kvjax.core", "plan", 1),
        ("kvjax.engine", "", 2),
        ("kvjax.core", "", 4),
    ]


def test_kvjax_has_no_import_circle():
    found = circles(import_graph())
    assert not found, "kvjax modules that import each other (in a circle):\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_module_reaches_into_another_modules_private_names():
    found = private_reach_ins()
    assert not found, (
        "private names used from another module (make them public, or move the code to where it belongs):\n"
        + "\n".join(found)
    )
