"""Packaging: the accelerator extras pull the jax build in the same version range as the base install."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _jax_range(requirement: str) -> str:
    m = re.fullmatch(r"jax(\[[a-z0-9]+\])?(.*)", requirement.replace(" ", ""))
    assert m, requirement
    return m.group(2)


def test_accelerator_extras_match_the_base_jax_range():
    project = _project()
    base = [r for r in project["dependencies"] if re.match(r"jax[<>=!\[]", r)]
    assert len(base) == 1, base
    extras = project["optional-dependencies"]
    for extra, jax_extra in (("tpu", "[tpu]"), ("cuda", "[cuda12]"), ("cuda13", "[cuda13]")):
        (req,) = [r for r in extras[extra] if r.startswith("jax[")]
        assert req.startswith(f"jax{jax_extra}"), (extra, req)
        assert _jax_range(req) == _jax_range(base[0]), f"kvjax[{extra}] pins {req}, the base install {base[0]}"


def test_the_test_extra_can_execute_the_notebooks():
    extras = _project()["optional-dependencies"]
    names = {re.split(r"[<>=\[]", r)[0] for r in extras["test"]}
    for req in extras["notebooks"]:
        assert re.split(r"[<>=\[]", req)[0] in names, f"{req} is in [notebooks] but not in [test]"


def test_one_version_with_its_changelog_entry():
    """pyproject's version is ``kvjax.__version__`` and has a section in CHANGELOG.md."""
    version = _project()["version"]
    init = (ROOT / "kvjax" / "__init__.py").read_text()
    assert f'__version__ = "{version}"' in init, f"kvjax.__version__ differs from pyproject's {version}"
    assert re.search(rf"^## {re.escape(version)}\b", (ROOT / "CHANGELOG.md").read_text(), re.M), (
        f"CHANGELOG.md has no '## {version}' section"
    )


def test_every_package_is_typed():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = project["tool"]["setuptools"]["package-data"]
    for package in ("kvjax", "kernels_pallas", "train_less", "eval"):
        assert (ROOT / package / "py.typed").is_file(), f"{package}/py.typed is missing"
        assert "py.typed" in data.get(package, []), f"py.typed of {package} is not in [tool.setuptools.package-data]"
