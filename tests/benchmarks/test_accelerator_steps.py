"""scripts/accelerator_steps.sh tried on the CPU (``SMOKE=<dir>``: the same commands at tiny sizes), so a GPU run
cannot fail on a typo: the ``head`` part verifies and times, writes its JSON and the packed archive to
``$OUT``, and a second run resumes (no verification again, no variant measured twice)."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "accelerator_steps.sh"


def _run(part, tmp_path, **env):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    env = {**os.environ, "SMOKE": str(tmp_path / "gpu"), "OUT": str(out), "KVJAX_COMMIT": "c" * 40, **env}
    return subprocess.run(["bash", str(SCRIPT), part], env=env, capture_output=True, text=True, timeout=600)


def test_usage_and_syntax():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    got = subprocess.run(["bash", str(SCRIPT), "nothing"], capture_output=True, text=True, env={**os.environ,
                         "KVJAX_COMMIT": "c" * 40, "SMOKE": "/tmp/kvjax-steps-usage"})  # fmt: skip
    assert got.returncode == 2 and "head" in got.stdout and "embedded" in got.stdout


@pytest.mark.extended
def test_head_part_runs_and_resumes(tmp_path):
    first = _run("head", tmp_path, METHODS="full,snapkv")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "=== verify_accumulated" in first.stdout and "=== roofline rc=0" in first.stdout, first.stdout
    data = json.loads((tmp_path / "gpu" / "roofline_h200_32k_b8.json").read_text())
    assert data["commit"] == "c" * 40
    assert [(r["label"], r["status"]) for r in data["rows"]] == [("full", "ok"), ("snapkv@0.2", "ok")]
    assert (tmp_path / "gpu" / f"kernel_tests_accumulated_{'c' * 12}.xml").is_file()
    out = tmp_path / "out"
    assert json.loads((out / "roofline_h200_32k_b8.json").read_text()) == data
    with tarfile.open(out / "steps_head.tgz") as tar:
        names = tar.getnames()
    assert "./roofline.log" in names and "./roofline_h200_32k_b8.json" in names
    second = _run("head", tmp_path, METHODS="full,snapkv")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "verify_accumulated" not in second.stdout  # recorded at this commit
    log = (Path("/tmp/steps_head") / "roofline.log").read_text()
    assert "--resume: keeping 2 rows" in log and "planning" not in log
    assert json.loads((tmp_path / "gpu" / "roofline_h200_32k_b8.json").read_text())["rows"] == data["rows"]
