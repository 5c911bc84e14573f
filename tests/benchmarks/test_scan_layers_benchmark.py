"""Smoke test of benchmarks/scan_layers.py at tiny sizes: both prefills (the model's, random ``q, k, v`` through the
method's own prefill), the JSON's fields, and the scanned layout generating the unrolled layout's tokens. No timing
is checked."""

from __future__ import annotations

import json

import pytest
from repo_scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/scan_layers.py", "bench_scan_layers", beside=True)


@pytest.mark.parametrize(
    "prefill, names", [("model", "full"), pytest.param("random", "full,h2o", marks=pytest.mark.slow)]
)
def test_scan_layers_smoke(bench, tmp_path, prefill, names):
    out = tmp_path / "scan.json"
    assert (
        bench.main(
            [
                "--layers",
                "3",
                "--methods",
                names,
                "--hidden",
                "32",
                "--heads",
                "4",
                "--kv-heads",
                "2",
                "--head-dim",
                "8",
                "--vocab",
                "64",
                "--prompt",
                "40",
                "--steps",
                "3",
                "--prefill",
                prefill,
                "--out",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert data["args"]["prefill"] == prefill and data["jax_version"] and "commit" in data
    rows = data["rows"]
    assert [r["method"] for r in rows] == names.split(",")
    for r in rows:
        assert r["same_tokens"] and r["scan_segments"] == [3]
        assert r["step_ms_unrolled"] > 0 and r["step_ms_scan"] > 0
