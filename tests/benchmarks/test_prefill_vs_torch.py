"""Smoke test of benchmarks/prefill_vs_torch.py: one random-weight layer of SmolLM2's shapes, a 300-token prompt,
both sides in their own processes; the JSON's fields and the logits' agreement. No timing is checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_smoke(tmp_path):
    from kvjax import assets

    try:
        assets.smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    out = tmp_path / "p.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "prefill_vs_torch.py"),
            "--random",
            "--layers",
            "1",
            "--lengths",
            "300",
            "--threads",
            "1",
            "--reps",
            "1",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--out",
            str(out),
        ],
        check=True,
        cwd=ROOT,
        timeout=600,
    )
    data = json.loads(out.read_text())
    for key in ("jax", "torch", "transformers", "device", "commit", "command", "cpu", "rows"):
        assert key in data, key
    (row,) = data["rows"]
    assert row["threads"] == 1 and row["length"] == 300
    for side in ("kvjax", "torch"):
        for key in ("median_s", "median_cpu_s", "prefill_peak", "setup_peak", "process_peak", "rss_loaded"):
            assert row[side][key] > 0, (side, key)
        assert row[side]["cpus"] == row["torch"]["cpus"] and len(row[side]["cpus"]) == 1
    assert row["kvjax"]["bucket"] == 512 and row["torch"]["torch_threads"] == 1
    assert row["kvjax"]["same_argmax"] and row["kvjax"]["max_abs_logit_diff"] < 1e-3
