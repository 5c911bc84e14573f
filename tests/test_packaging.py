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
