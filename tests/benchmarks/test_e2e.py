"""Smoke test of benchmarks/e2e.py on the 2-layer random model: the JSON's fields, ratios taken from the same run's
``full`` row, the skip-with-reason path (a tiny ``--memory-gb``) and ``--compile-only``. No timing is checked."""

from __future__ import annotations

import json

import pytest
from repo_scripts import load_script


@pytest.fixture(scope="module")
def e2e():
    return load_script("benchmarks/e2e.py", "bench_e2e")


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


# ---------------------------------------------------------------------------------------------------------------
# The 8B end-to-end run: the torch side (transformers, kvpress), resume, row order, the ceiling and the markdown table.


@pytest.mark.extended  # ~30 s: a torch process beside the JAX one
def test_torch_rows_and_resume(e2e, tmp_path, monkeypatch):
    """transformers' and kvpress's rows in the same run as kvjax's (kvpress from the carried wheel, on whichever
    transformers is here), in PRIORITY order; a second invocation at the same commit measures nothing again."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    monkeypatch.setenv("KVJAX_COMMIT", "e" * 40)  # fixed: a commit landing between the two runs changes nothing
    out = tmp_path / "torch.json"
    argv = SMALL + ["--contexts", "100", "--batch", "1", "--new-tokens", "3", "--out", str(out)]
    assert e2e.main(argv + ["--methods", "full,transformers,kvpress,snapkv"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["label"] for r in rows] == ["full", "transformers", "kvpress_snapkv@0.5", "snapkv@0.5"]
    hf, kvp = rows[1], rows[2]
    assert hf["status"] == "ok" and hf["decode_steps"] == 2 and hf["attn_implementation"] == "sdpa"
    assert hf["weights_bytes"] == e2e.tree_bytes(e2e.abstract_params(e2e.TINY, "float32", False))  # same shapes
    assert hf["tokens_held_per_seq"] == 100 + 2 and hf["full_row"] == 0
    assert kvp["status"] == "ok" and kvp["tokens_held_per_seq"] == 50 + 2, kvp.get("skipped")  # kvpress's 0.5
    md = out.with_suffix(".md").read_text()
    assert "| `transformers` |" in md and "| `snapkv@0.5` |" in md
    before = {r["key"]: r["measured_at"] for r in rows if r["status"] == "ok"}
    assert e2e.main(argv + ["--methods", "full,transformers,snapkv,streaming_llm"]) == 0
    data = json.loads(out.read_text())
    again = {r["key"]: r["measured_at"] for r in data["rows"] if r["key"] in before}
    assert again == before and len(data["commands"]) == 2
    assert [r["label"] for r in data["rows"]][-1] == "streaming_llm@0.5"  # only the new row was measured
    assert len(data["rows"]) == len(before) + 1  # a failed row is not kept: the next run that names it tries again


def test_torch_process_that_dies_fails_its_rows(e2e):
    side = e2e.TorchSide("/bin/false", "float32", timeout=30)
    rows = list(side.rows({"labels": ["transformers", "kvpress_snapkv@0.2"]}))
    assert [r["status"] for r in rows] == ["failed", "failed"] and "torch process ended (rc 1" in rows[0]["skipped"]


def _rows(commit):
    base = {"model": "tiny", "context": 64, "batch": 1, "new_tokens": 2, "commit": commit}
    return [
        {**base, "label": "full", "status": "ok", "row_id": 0, "full_row": 0, "key": "a"},
        {**base, "label": "transformers", "status": "failed", "row_id": 1, "full_row": None, "key": "b"},
        {**base, "label": "snapkv@0.5", "status": "ok", "row_id": 2, "full_row": 0, "key": "c"},
    ]


def test_resume_keeps_the_measured_rows_of_this_commit(e2e, tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"commit": "abc", "command": "first", "rows": _rows("abc")}))
    head = {"commit": "abc", "commands": ["second"]}
    rows = e2e.resume(path, head)
    assert [(r["key"], r["row_id"], r["full_row"]) for r in rows] == [("a", 0, 0), ("c", 1, 0)]
    assert head["commands"] == ["first", "second"]
    assert e2e.resume(path, {"commit": "def", "commands": []}) == []  # another commit: measured again
    assert not path.exists() and (tmp_path / "r.abc.json").exists()  # the old file moved aside, not lost


def test_row_key_separates_settings(e2e):
    row = _rows("x")[0]
    head = {"dtype": "bfloat16", "scan_layers": True, "repeats": 1}
    keys = {e2e.row_key(row, head), e2e.row_key({**row, "context": 32768}, head)}
    keys |= {e2e.row_key(row, {**head, "scan_layers": False}), e2e.row_key({**row, "label": "snapkv@0.5"}, head)}
    keys.add(e2e.row_key(row, {**head, "xla_flags": "--xla_gpu_enable_dynamic_slice_fusion=true"}))
    assert len(keys) == 5
    assert e2e.row_key(row, {**head, "xla_flags": ""}) == e2e.row_key(row, head)  # unset: the keys rows had before


def test_default_order_is_issue_58s(e2e):
    """full, transformers, kvpress, the five papers' methods, then the baselines (Quest first, PyramidKV last); the
    recall methods also at 2,048 tokens; every registered method once."""
    names = e2e.default_methods().split(",")
    labels = [v[0] for v in e2e.variants(names, [0.2], [2048], [1, 2])]
    head = ["full", "transformers", "kvpress_snapkv@0.2", "chelsea@0.2", "clusterkv@0.2", "clusterkv@2048"]
    head += ["pqcache@0.2", "pqcache@2048", "chunkkv@0.2", "chunkkv_reuse@0.2", "less@0.2"]
    head += ["quest@0.2", "quest@2048", "snapkv@0.2", "h2o@0.2", "streaming_llm@0.2", "pyramidkv@0.2"]
    assert labels == head
    assert e2e._parser().parse_args([]).methods == e2e.default_methods()


def _run_rows():
    """full, transformers and chelsea at 32k: weights 100 bytes, full's KV 300 read in 4 s (100 bytes/s)."""
    base = {"context": 32768, "batch": 1, "status": "ok", "weights_bytes_read_per_step": 100, "ttft_s": 10.0}
    return [
        {**base, "label": "full", "kv_bytes_read_per_step": 300, "tpot_s": 4.0, "throughput_tok_s": 0.25},
        {**base, "label": "transformers", "torch_version": "2", "kv_bytes_read_per_step": 300, "tpot_s": 8.0}
        | {"throughput_tok_s": 0.125, "peak_bytes_in_use": 2**31},
        {**base, "label": "chelsea@0.2", "kv_bytes_read_per_step": 50, "tpot_s": 2.0, "throughput_tok_s": 0.5}
        | {"ttft_s": 10.5, "prefill_compile_s": 3.0, "decode_compile_s": 4.0},
    ]


def test_ceiling_by_hand(e2e):
    full, _, chelsea = _run_rows()
    c = e2e.ceiling(chelsea, full)
    # 100 bytes/s; chelsea reads 100 + 50 bytes: 1.5 s a step at that bandwidth, 4 / 1.5 = 2.67x; 2 s is 33% over
    assert c["bandwidth_bytes_s"] == pytest.approx(100.0) and c["tpot_s"] == pytest.approx(1.5)
    assert c["speedup"] == pytest.approx(8 / 3) and c["short"] == pytest.approx(1 / 3)
    assert e2e.ceiling(full, full)["speedup"] == pytest.approx(1.0) and e2e.ceiling(full, full)["short"] == 0


def test_markdown_table(e2e):
    rows = _run_rows() + [{"context": 65536, "batch": 1, "label": "full", "status": "skipped", "skipped": "too big"}]
    data = {"model": "m", "dtype": "bfloat16", "device_kind": "H200", "backend": "gpu", "jax_version": "0.11"}
    data.update(commit="0123456789abc", new_tokens=256, scan_layers=True, rows=rows)
    md = e2e.markdown(data)
    assert md.startswith("m (bfloat16), H200 (gpu), jax 0.11, torch 2,") and "commit `0123456789`" in md
    lines = {line.split(" | ")[0]: line for line in md.splitlines() if line.startswith("| `")}
    # TTFT s | TTFT vs full | TPOT ms | tok/s | x full | x transformers | ceiling x | short | papers | peak | compile
    assert lines["| `chelsea@0.2`"] == (
        "| `chelsea@0.2` | 10.500 | +5.0% | 2000.00 | 0.5 | 2.00 | 4.00 | 2.67 | +33% **profile** | "
        "Chelsea T3: TPOT 1.97x, TTFT +2.2% | 0.0 | 7.0 |"
    )
    assert lines["| `transformers`"].split(" | ")[5:10] == ["0.50", "1.00", "1.00", "+100%", ""]  # no profile flag
    assert "**64k tokens, batch 1**" in md and "| `full` | skipped: too big |" in md
