"""The tree's style, as pyproject.toml's ``[tool.ruff]`` sets it: formatted with ``ruff format`` (line length 120) and
clean under ``ruff check`` (the pyflakes rules and the line length). The test extra installs ruff; without it these
skip. Fix a failure with ``ruff format kvjax eval train_less kernels_pallas benchmarks tests scripts`` and
``ruff check --fix ...``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ["kvjax", "eval", "train_less", "kernels_pallas", "benchmarks", "tests", "scripts", "docs/examples"]
RUFF = shutil.which("ruff")
pytestmark = pytest.mark.skipif(RUFF is None, reason="ruff is not installed (pip install -e '.[test]')")


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]], ids=["format", "check"])
def test_ruff(command):
    out = subprocess.run([RUFF, *command, *FOLDERS], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, f"ruff {' '.join(command)}:\n{out.stdout[-4000:]}{out.stderr[-2000:]}"
