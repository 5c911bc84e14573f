"""Smoke test of benchmarks/e2e.py on the 2-layer random model: the JSON's fields, ratios taken from the same run's
``full`` row, the skip-with-reason path (a tiny ``--memory-gb``) and ``--compile-only``. No timing is checked."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "benchmarks" / "e2e.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SMALL = ["--model", "tiny", "--new-tokens", "2", "--budgets", "0.5", "--token-budgets", "", "--dtype", "float32"]


@pytest.mark.extended  # CI's second line (.ci/run); test_compile_only in the default run (docs/testing.md)
def test_run_fields_and_ratios(e2e, tmp_path):
    out = tmp_path / "e2e.json"
    assert (
        e2e.main(
            SMALL
            + ["--contexts", "40,60", "--batch", "1,2", "--methods", "full,snapkv,streaming_llm", "--out", str(out)]
        )
        == 0
    )
    data = json.loads(out.read_text())
    for key in (
        "jax_version",
        "jaxlib_version",
        "device_kind",
        "backend",
        "commit",
        "command",
        "python",
        "papers",
        "model_config",
        "memory_limit_bytes",
    ):
        assert key in data, key
    rows = data["rows"]
    assert len(rows) == 2 * 2 * 3 and all(r["status"] == "ok" for r in rows)
    for r in rows:
        for key in (
            "ttft_s",
            "tpot_s",
            "throughput_tok_s",
            "decode_steps",
            "prefill_compile_s",
            "decode_compile_s",
            "memory_analysis",
            "cache_bytes",
            "estimate_bytes",
            "compress_share_of_prefill",
        ):
            assert key in r, key
        assert r["decode_steps"] == 1 and r["tpot_s"] > 0
        full = rows[r["full_row"]]
        assert full["label"] == "full" and (full["context"], full["batch"]) == (r["context"], r["batch"])
        assert r["tpot_speedup_vs_full"] == pytest.approx(full["tpot_s"] / r["tpot_s"])
        assert r["ttft_overhead_vs_full"] == pytest.approx(r["ttft_s"] / full["ttft_s"] - 1)
        assert r["throughput_ratio_vs_full"] == pytest.approx(r["throughput_tok_s"] / full["throughput_tok_s"])
        assert r["compress_share_of_prefill"] == pytest.approx((r["ttft_s"] - full["ttft_s"]) / r["ttft_s"])
        assert r["throughput_tok_s"] == pytest.approx(r["batch"] * r["decode_steps"] / r["decode_s"])
    assert [r["label"] for r in rows[:3]] == ["full", "snapkv@0.5", "streaming_llm@0.5"]
    assert [r["compile_reused"] for r in rows] == [False] * 6 + [True] * 6  # 40 and 60 share the 64 bucket
    text = out.with_suffix(".txt").read_text()
    assert "papers vs this run" in text and text.startswith("e2e: tiny")
    out.with_suffix(".txt").unlink()
    assert e2e.main(["--report", str(out)]) == 0  # redraws the table from the JSON alone
    assert out.with_suffix(".txt").read_text() == text


def test_skip_with_reason(e2e, tmp_path):
    out = tmp_path / "skip.json"
    assert (
        e2e.main(
            SMALL
            + ["--contexts", "64", "--batch", "1", "--methods", "full,snapkv", "--memory-gb", "1e-6", "--out", str(out)]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["status"] for r in rows] == ["skipped", "skipped"]
    assert all("exceeds the device's" in r["skipped"] for r in rows)
    assert rows[1]["tpot_speedup_vs_full"] is None if "tpot_speedup_vs_full" in rows[1] else True


def test_compile_only(e2e, tmp_path):
    out = tmp_path / "compile.json"
    assert (
        e2e.main(
            SMALL
            + [
                "--compile-only",
                "--contexts",
                "64",
                "--batch",
                "1",
                "--methods",
                "full",
                "--layouts",
                "scan,unrolled",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["label"], r["layout"]) for r in rows] == [("full", "scan"), ("full", "unrolled")]
    assert all(r["prefill_compile_s"] > 0 and r["decode_compile_s"] > 0 and "ttft_s" not in r for r in rows)


def test_contexts_and_variants(e2e):
    assert e2e.parse_contexts("8k,16k,100") == [8192, 16384, 100]
    labels = [v[0] for v in e2e.variants(["full", "chunkkv", "quest", "snapkv"], [0.1], [1024], [1, 2])]
    assert labels == ["full", "chunkkv@0.1", "chunkkv_reuse@0.1", "quest@0.1", "quest@1024", "snapkv@0.1"]


@pytest.mark.extended  # CI's second line (.ci/run); test_compile_only in the default run (docs/testing.md)
def test_scanned_run(e2e, tmp_path):
    out = tmp_path / "scan.json"
    assert (
        e2e.main(
            SMALL
            + ["--contexts", "40", "--batch", "2", "--methods", "full,snapkv", "--scan-layers", "on", "--out", str(out)]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert data["scan_layers"] and [r["status"] for r in data["rows"]] == ["ok", "ok"]


def test_llama31_8b_shapes(e2e):
    """The 8B config as Llama-3.1-8B's config.json has it: 8.03e9 parameters, 16.06 GB in bf16 (abstract only)."""
    import jax.numpy as jnp

    cfg = e2e.LLAMA31_8B
    assert (cfg.rope.rope_type, cfg.rope.factor, cfg.max_position_embeddings) == ("llama3", 8.0, 131072)
    assert e2e.tree_bytes(e2e.abstract_params(cfg, jnp.bfloat16, scan=True)) == 2 * 8_030_261_248
