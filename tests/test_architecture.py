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
  package and the floors below it. Inside ``kvjax/methods/`` too: the interface (``boundary``, then ``base``), then
  ``core/`` (what the methods share: it imports no method), then the methods and the per-layer plans (a module, or a
  package of a method's parts), then the registry (``kvjax/methods/__init__.py``).
- **No private reach-in**: a private name (a leading ``_``: a function, a constant, a module such as ``_common``) is
  used only inside the module or package that defines it: no ``from x import _name`` and no ``alias._name`` on an
  imported first-party module from outside it, in every package of the repository (``kvjax/``, ``kernels_pallas/``,
  ``eval/``, ``train_less/``, ``benchmarks/``, ``scripts/``; tests may look inside). The scripts of ``benchmarks/``
  import one another by bare name (their folder is on ``sys.path``), so there a bare name is a sibling script.

Plain ``ast`` parsing, no JAX work.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvjax"
#: every package of the repository: the import packages, then the folders of scripts
CODE = ("kvjax", "kernels_pallas", "eval", "train_less", "benchmarks", "scripts")
SCRIPT_FOLDERS = ("benchmarks", "scripts")


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

#: the floors inside ``kvjax/methods/``: a unit is a module or a package directly under it
METHOD_FLOORS = {
    "kvjax.methods.boundary": 0,  # the interface's checks
    "kvjax.methods.base": 1,  # the interface
    "kvjax.methods.core": 2,  # what the methods share: never a method
    **{
        f"kvjax.methods.{name}": 3  # the methods and the per-layer plans
        for name in ("full", "streaming", "h2o", "snapkv", "chunkkv", "quest", "plans")
        + ("chelsea", "clusterkv", "pqcache", "less")
    },
    "kvjax.methods": 4,  # the registry
}
METHOD_FLAT = {3}  # a method may build on another (LESS on H2O, ClusterKV on the plans; no circle: checked above)


def unit(module: str) -> str:
    return ".".join(module.split(".")[:2])


def method_unit(module: str) -> str:
    return ".".join(module.split(".")[:3])


def floor_breaks(graph: dict[str, set[str]], floors=FLOORS, unit_of=unit, flat=FLAT) -> list[str]:
    out = []
    for a, targets in graph.items():
        for b in targets:
            ua, ub = unit_of(a), unit_of(b)
            fa, fb = floors[ua], floors[ub]
            if ua != ub and not fb < fa and not (fa == fb and fa in flat):
                out.append(f"{a} (floor {fa}) imports {b} (floor {fb})")
    return sorted(out)


def methods_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The part of ``graph`` inside ``kvjax/methods/``."""
    inside = lambda m: m == "kvjax.methods" or m.startswith("kvjax.methods.")  # noqa: E731
    return {a: {b for b in targets if inside(b)} for a, targets in graph.items() if inside(a)}


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


def first_party(top: str) -> set[str]:
    """The modules of one package of the repository (``benchmarks.e2e``, ``kernels_pallas.decode_attention.xla``)."""
    return {module_name(p) for p in (ROOT / top).rglob("*.py")}


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def reach_in(path: str, here: str) -> bool:
    """Whether ``path`` (a dotted module, or a module and a name in it) is private to a module or package that
    ``here`` is not inside: its first private part is private to what precedes it."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if is_private(part):
            owner = ".".join(parts[:i])
            return not (here == owner or here.startswith(owner + "."))
    return False


def dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (head := dotted(node.value)) is not None:
        return f"{head}.{node.attr}"
    return None


def reach_ins(source: str, here: str, modules: set[str], bare: dict[str, str] | None = None) -> list[str]:
    """``"line: what"`` for each private name of another first-party module that ``source`` (the module ``here``)
    uses: ``from m import _x``, ``import m._x``, and ``alias._x`` where ``alias`` names an imported module (``import
    m``, ``import m as alias``, ``from pkg import m``, through attributes too: ``pkg.m._x``). ``modules``: the
    first-party modules; ``bare``: the modules a bare name imports (sibling scripts on ``sys.path``)."""
    bare = bare or {}

    def full(name: str) -> str:
        head, _, rest = name.partition(".")
        return f"{bare[head]}.{rest}".rstrip(".") if head in bare else name

    tree = ast.parse(source)
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                name = full(a.name)
                if resolve(name, modules) is None:
                    continue
                if reach_in(name, here):
                    found.append(f"{node.lineno}: import {a.name}")
                if a.asname:
                    aliases[a.asname] = name
                else:
                    top = a.name.partition(".")[0]
                    aliases[top] = full(top)
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"line {node.lineno}: a relative import; the code imports absolutely"
            source_module = full(node.module)
            if resolve(source_module, modules) is None:
                continue
            for a in node.names:
                name = f"{source_module}.{a.name}"
                if reach_in(name, here):
                    found.append(f"{node.lineno}: from {node.module} import {a.name}")
                if name in modules:
                    aliases[a.asname or a.name] = name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr) and (chain := dotted(node.value)) is not None:
            head, _, rest = chain.partition(".")
            if head in aliases and (module := f"{aliases[head]}.{rest}".rstrip(".")) in modules:
                if reach_in(f"{module}.{node.attr}", here):
                    found.append(f"{node.lineno}: {chain}.{node.attr}")
    return sorted(found, key=lambda hit: (int(hit.partition(":")[0]), hit))


def private_reach_ins() -> list[str]:
    modules = set().union(*(first_party(top) for top in CODE))
    found = []
    for top in CODE:
        for path in (ROOT / top).rglob("*.py"):
            here = module_name(path)
            # a script's folder is on sys.path: a bare name that is a sibling script is that script
            bare = {m.rpartition(".")[2]: m for m in first_party(top)} if top in SCRIPT_FOLDERS else {}
            source = path.read_text(encoding="utf-8")
            found += [f"{path.relative_to(ROOT)}:{hit}" for hit in reach_ins(source, here, modules, bare)]
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


def test_the_reach_in_check_catches_every_form():
    """A planted reach-in of each form is found; what is the owner's own, or a dunder, or a third party's, is not."""
    modules = {
        "kvjax",
        "kvjax.engine",
        "kvjax.engine.core",
        "kernels_pallas",
        "kernels_pallas.decode_attention",
        "kernels_pallas.decode_attention.xla",
        "kernels_pallas.pq_lookup",
        "kernels_pallas.pq_lookup._common",
        "benchmarks.e2e",
    }
    planted = (
        "import jax\n"
        "import kvjax.engine.core\n"
        "import kernels_pallas.decode_attention.xla as X\n"
        "from kvjax.engine import core\n"
        "from kvjax.engine.core import _hidden, plan\n"  # line 5: from-import of a private name
        "from kernels_pallas.pq_lookup._common import CODE_ALIGN\n"  # line 6: a package's private module
        "from e2e import _memory_stats\n"  # line 7: a sibling script, imported by bare name
        "def f(x):\n"
        "    a = X._gather_windows(x)\n"  # line 9: alias._name
        "    b = core._plan_of(x) + kvjax.engine.core._cached\n"  # line 10: both attribute forms
        "    return jax._src, x._private, core.__doc__, core.plan\n"  # none: a third party's, not a module, dunder
    )
    got = reach_ins(planted, "eval.runner", modules, bare={"e2e": "benchmarks.e2e"})
    assert got == [
        "5: from kvjax.engine.core import _hidden",
        "6: from kernels_pallas.pq_lookup._common import CODE_ALIGN",
        "7: from e2e import _memory_stats",
        "9: X._gather_windows",
        "10: core._plan_of",
        "10: kvjax.engine.core._cached",
    ]
    # inside the owner: a module's own names, and a package's private module from the package and its modules
    own = "from kernels_pallas.pq_lookup._common import CODE_ALIGN\nfrom kernels_pallas.pq_lookup import _common\n"
    assert reach_ins(own, "kernels_pallas.pq_lookup", modules) == []
    assert reach_ins(own, "kernels_pallas.pq_lookup.pallas_gpu", modules) == []
    assert reach_ins(own, "kernels_pallas.decode_attention", modules) == [
        "1: from kernels_pallas.pq_lookup._common import CODE_ALIGN",
        "2: from kernels_pallas.pq_lookup import _common",
    ]
    # a package's __init__ reaching into one of its modules is a reach-in too
    assert reach_ins(
        "from kernels_pallas.decode_attention import xla\nxla._g()\n", "kernels_pallas.decode_attention", modules
    ) == ["2: xla._g"]


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


def test_the_methods_stand_on_floors_and_core_imports_no_method():
    graph = methods_graph(import_graph())
    assert {method_unit(m) for m in graph} == set(METHOD_FLOORS), (
        "a new module or package in kvjax/methods/: give it a floor in METHOD_FLOORS"
    )
    check = lambda g: floor_breaks(g, METHOD_FLOORS, method_unit, METHOD_FLAT)  # noqa: E731
    assert check({"kvjax.methods.core.select": {"kvjax.methods.chelsea.csm"}}) == [
        "kvjax.methods.core.select (floor 2) imports kvjax.methods.chelsea.csm (floor 3)"
    ]
    assert check({"kvjax.methods.base": {"kvjax.methods.core.select"}})
    assert not check(
        {"kvjax.methods.less": {"kvjax.methods.h2o"}, "kvjax.methods.chelsea.merge": {"kvjax.methods.chelsea.csm"}}
    )
    found = check(graph)
    assert not found, "imports that go up a floor inside kvjax/methods/:\n" + "\n".join(found)


def test_no_module_reaches_into_another_modules_private_names():
    found = private_reach_ins()
    assert not found, (
        "private names used from another module (make them public, or move the code to where it belongs):\n"
        + "\n".join(found)
    )
