"""The repository's scripts (``benchmarks/*.py``, ``scripts/*.py``) loaded as modules, for the tests that call their
functions: they are files run with ``python3``, not packages, so they are loaded by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(path: str, name: str, *, beside: bool = False):
    """The module of ``ROOT / path`` (``"benchmarks/e2e.py"``), executed anew under the module name ``name`` and
    registered in ``sys.modules`` under it (dataclasses look their module up there). ``beside``: the script's folder
    goes first on ``sys.path``, as ``python3 path`` puts it, for a script that imports the modules beside it."""
    file = ROOT / path
    if beside and str(file.parent) not in sys.path:
        sys.path.insert(0, str(file.parent))
    spec = importlib.util.spec_from_file_location(name, file)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
