"""Smoke test of benchmarks/roofline.py at tiny sizes (a 4-head, 32-dim config, 256 tokens, 2 methods): the JSON's
fields, the efficiency and TTFT ratios recomputed from the stored times and bytes, the plot and the ``--report``
redraw; the skip rules (memory, prefill time) and the projection's arithmetic against a hand computation. No
timing is checked."""

from __future__ import annotations

import json

import pytest
from repo_scripts import load_script


@pytest.fixture(scope="module")
def roofline():
    return load_script("benchmarks/roofline.py", "bench_roofline")


@pytest.fixture(scope="module")
def measure(roofline):
    import roofline_measure

    return roofline_measure


@pytest.fixture(scope="module")
def project(roofline):
    import roofline_project

    return roofline_project


TINY = [
    "--tiny",
    "--batch",
    "1",
    "--dtypes",
    "float32",
    "--budgets",
    "0.2",
    "--token-budgets",
    "",
    "--steps",
    "2",
    "--rounds",
    "1",
    "--bandwidth-mib",
    "8",
]


def test_tiny_run(roofline, tmp_path):
    out = tmp_path / "r.json"
    argv = TINY + ["--lengths", "256", "--methods", "full,snapkv", "--model-ttft", "--out", str(out)]
    assert roofline.main(argv) == 0
    data = json.loads(out.read_text())
    for key in (
        "jax_version",
        "device",
        "device_kind",
        "backend",
        "commit",
        "command",
        "load_average_1min",
        "read_gbs",
        "copy_gbs",
        "timing",
        "layers",
        "memory_limit_bytes",
        "max_prefill_s",
        "papers",
        "rows",
    ):
        assert key in data, key
    rows = data["rows"]
    assert [r["label"] for r in rows] == ["full", "snapkv@0.2"] and all(r["status"] == "ok" for r in rows)
    full = rows[0]
    for r in rows:
        for key in (
            "step_s",
            "bytes_read",
            "xla_bytes",
            "gbs",
            "time_ratio",
            "bytes_ratio",
            "efficiency",
            "speedup",
            "prefill_s",
            "attention_s",
            "ttft_s",
            "ttft_ratio",
            "compress_share",
            "load_average_1min",
        ):
            assert key in r, key
        assert r["step_s"] > 0 and r["bytes_read"] > 0 and r["xla_bytes"] is None  # --timing loop: not counted
        assert rows[r["full_row"]] is full
        # independent recomputation from the stored times and bytes
        assert r["efficiency"] == pytest.approx((r["step_s"] / full["step_s"]) / (r["bytes_read"] / full["bytes_read"]))
        assert r["speedup"] == pytest.approx(full["step_s"] / r["step_s"])
        assert r["gbs"] == pytest.approx(r["bytes_read"] / r["step_s"] / 1e9)
        assert r["ttft_s"] == pytest.approx(r["attention_s"] + r["prefill_s"])
        assert r["ttft_ratio"] == pytest.approx(r["ttft_s"] / full["ttft_s"])
        assert r["compress_share"] == pytest.approx(1 - full["ttft_s"] / r["ttft_s"])
        dense = r["layers"] * r["dense_s"]  # --model-ttft: the same measured dense layer added to every TTFT
        assert r["dense_s"] > 0 and r["dense_s"] == full["dense_s"]
        assert r["model_ttft_ratio"] == pytest.approx((dense + r["ttft_s"]) / (dense + full["ttft_s"]))
        assert min(1, r["ttft_ratio"]) <= r["model_ttft_ratio"] <= max(1, r["ttft_ratio"])
    assert full["efficiency"] == pytest.approx(1.0) and full["compress_share"] == pytest.approx(0.0)
    assert rows[1]["bytes_ratio"] < 0.5  # snapkv at 0.2 reads a fraction of full's bytes
    pytest.importorskip("matplotlib")
    png, txt = out.with_suffix(".png"), out.with_suffix(".txt")
    assert png.stat().st_size > 0 and "PROJECTION (not a measurement)" in txt.read_text()
    assert "model TTFT x" in txt.read_text()
    text = txt.read_text()
    png.unlink()
    txt.unlink()
    assert roofline.main(["--report", str(out)]) == 0  # redraws from the JSON alone
    assert png.exists() and txt.read_text() == text
    merged = tmp_path / "merged.json"  # runs made in pieces, drawn as one
    assert roofline.main(["--report", f"{out},{out}", "--out", str(merged)]) == 0
    m = json.loads(merged.read_text())
    assert [r["full_row"] for r in m["rows"]] == [0, 0, 2, 2] and len(m["sources"]) == 2
    assert merged.with_suffix(".png").exists()


def test_group_size_writes_each_piece(roofline, tmp_path):
    """--group-size 1: each variant is planned, timed beside its own full and written before the next is
    compiled (a run cut short keeps what it timed); the ratios compare rows of the same piece."""
    out = tmp_path / "g.json"
    argv = TINY + ["--lengths", "128", "--methods", "full,snapkv,streaming_llm", "--group-size", "1", "--timing"]
    argv += ["calls", "--out", str(out)]
    written = []
    real = roofline._run_piece

    def spy(*a, **kw):
        got = real(*a, **kw)
        written.append([r["label"] for r in json.loads(out.read_text())["rows"]])
        return got

    roofline._run_piece = spy
    try:
        assert roofline.main(argv) == 0
    finally:
        roofline._run_piece = real
    assert written == [["full", "snapkv@0.2"], ["full", "snapkv@0.2", "full", "streaming_llm@0.2"]]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["label"], r["group"], r["full_row"]) for r in rows] == [
        ("full", 0, 0),
        ("snapkv@0.2", 0, 0),
        ("full", 1, 2),
        ("streaming_llm@0.2", 1, 2),
    ]
    assert all(r["xla_bytes"] > 0 for r in rows)  # --timing calls: XLA's bytes of each compiled step
    assert rows[3]["efficiency"] == pytest.approx(
        (rows[3]["step_s"] / rows[2]["step_s"]) / (rows[3]["bytes_read"] / rows[2]["bytes_read"])
    )


def test_skips_with_reasons(roofline, tmp_path):
    out = tmp_path / "mem.json"
    assert (
        roofline.main(TINY + ["--lengths", "128", "--methods", "full,snapkv", "--memory-gb", "1e-6", "--out", str(out)])
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["status"] for r in rows] == ["skipped", "skipped"]
    assert "full cannot run" in rows[0]["skipped"] and all("--memory-gb" in r["skipped"] for r in rows)
    out = tmp_path / "time.json"  # every prefill, calibrated at 64 tokens, is estimated above 0 s
    assert (
        roofline.main(
            TINY
            + [
                "--lengths",
                "128",
                "--methods",
                "full,snapkv",
                "--max-prefill-s",
                "0",
                "--calibration-len",
                "64",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["status"] for r in rows] == ["skipped", "skipped"]
    assert all("prefill estimated at" in r["skipped"] for r in rows)


def test_prefill_clock_and_groups(measure):
    clock = measure.PrefillClock()
    assert clock.estimate("h2o", "float32", 8192, 1, 1) is None
    clock.record("h2o", "float32", 4096, 1, 1.25)
    assert clock.estimate("h2o", "float32", 32768, 4, 2) == pytest.approx(1.25 * 64 * 4 * 2)
    clock.record("h2o", "float32", 2048, 1, 9.0)  # a smaller measurement does not replace the reference
    assert clock.refs[("h2o", "float32")] == (4096, 1, 1.25)

    V = measure.Variant
    full = V("full", None, None, state_bytes=10, prefill_temp=1)
    a, b, c, big = (
        V(x, None, None, state_bytes=s, prefill_temp=2) for x, s in (("a", 30), ("b", 30), ("c", 30), ("big", 100))
    )
    groups, too_big = measure.plan_groups(full, [a, b, big, c], base=5, limit=80)
    assert [[v.label for v in g] for g in groups] == [["a", "b"], ["c"]]  # 5 + 10 + 60 + 2 = 77 <= 80
    assert [v.label for v, _ in too_big] == ["big"] and "--memory-gb" in too_big[0][1]
    groups, too_big = measure.plan_groups(full, [a, b, c], base=5, limit=None)
    assert [[v.label for v in g] for g in groups] == [["a", "b", "c"]] and not too_big


def _row(label, dtype, step_s, bytes_read, context=32768, batch=1, method=None, budget=None):
    return {
        "context": context,
        "batch": batch,
        "dtype": dtype,
        "label": label,
        "method": method or label.split("@")[0],
        "budget": budget,
        "status": "ok",
        "layers": 1,
        "step_s": step_s,
        "bytes_read": bytes_read,
    }


def test_projection_arithmetic(project):
    # full at 32k, float32, 1 layer: K + V = 2 * 8 heads * 32768 * 128 * 4 bytes = 268,435,456 bytes.
    rows = [
        _row("full", "float32", 0.020, 268435456),
        _row("chelsea@0.2", "float32", 0.006, 268435456 // 5, budget=0.2),  # bytes 0.2, time 0.3: eff 1.5
        _row("full", "float32", 0.010, 1000, batch=4),
    ]  # batch 4: not projected
    project.add_ratios(rows[:2], 0)
    project.add_ratios(rows[2:], 2)
    proj = project.projection(rows)
    assert len(proj) == 1
    p = proj[0]
    # By hand: KV_full at bf16 over 32 layers = 268,435,456 / 2 * 32 = 4,294,967,296 bytes;
    # full: 16.06e9 + 4,294,967,296 = 20,354,967,296 bytes -> / 3.35e12 B/s = 6.0761 ms on the H100,
    #       / 819e9 = 24.8534 ms on the v5e;
    # chelsea: KV 0.2 * 4,294,967,296 = 858,993,459.2 bytes, x eff 1.5 = 1,288,490,188.8;
    #          16.06e9 + 1,288,490,188.8 = 17,348,490,188.8 bytes -> 5.1787 ms (H100), 21.1825 ms (v5e);
    # speed-up 20,354,967,296 / 17,348,490,188.8 = 1.17330; ideal (eff 1) 20,354,967,296 / 16,918,993,459.2 = 1.20309.
    assert p["label"] == "chelsea@0.2" and p["measured_dtype"] == "float32"
    assert p["efficiency"] == pytest.approx(1.5)
    assert p["kv_full_bytes"] == pytest.approx(4_294_967_296)
    assert p["tpot_full_s[H100]"] == pytest.approx(6.0761e-3, rel=1e-4)
    assert p["tpot_full_s[TPU v5e]"] == pytest.approx(24.8534e-3, rel=1e-4)
    assert p["tpot_s[H100]"] == pytest.approx(5.1787e-3, rel=1e-4)
    assert p["tpot_s[TPU v5e]"] == pytest.approx(21.1825e-3, rel=1e-4)
    assert p["speedup"] == pytest.approx(1.17330, rel=1e-5)
    assert p["ideal_speedup"] == pytest.approx(1.20309, rel=1e-5)
    text = project.projection_text(proj)
    assert "PROJECTION" in text and "Chelsea Table 3: TPOT 1.97x" in text and "1.17x" in text

    # a bfloat16 row at the same context is preferred; full's bytes are then taken as they are
    bf = [
        _row("full", "bfloat16", 0.030, 134217728),
        _row("chelsea@0.2", "bfloat16", 0.015, 134217728 // 5, budget=0.2),
    ]  # bytes 0.2, time 0.5: eff 2.5
    project.add_ratios(bf, 3)
    (p,) = project.projection(rows + bf)
    assert p["measured_dtype"] == "bfloat16" and p["efficiency"] == pytest.approx(2.5)
    assert p["kv_full_bytes"] == pytest.approx(4_294_967_296)
    assert p["speedup"] == pytest.approx(20_354_967_296 / (16.06e9 + 0.5 * 4_294_967_296))


def test_quick_preset(roofline):
    args = roofline.parse_args(["--quick"])
    assert (args.lengths, args.batch, args.dtypes, args.budgets, args.token_budgets) == (
        [16384],
        [1],
        ["float32"],
        [0.2],
        [2048],
    )
    args = roofline.parse_args(["--quick", "--lengths", "8k"])
    assert args.lengths == [8192] and args.rounds == 3


def test_failures_are_recorded_and_the_run_goes_on(roofline, measure, tmp_path, monkeypatch):
    """A variant that fails to compile its prefill, or whose decode raises while timed, gets a ``failed`` row with
    its error; the others are timed beside full as usual (a kernel failing on a device must not end a GPU
    run's step)."""
    out = tmp_path / "f.json"
    real_compile, real_time = measure.compile_prefill, roofline.time_runs

    def compile_prefill(method, *a, **kw):
        if method.name == "streaming_llm":
            raise RuntimeError("Mosaic lowering failed (a test's)")
        return real_compile(method, *a, **kw)

    def time_runs(runs, *a, **kw):
        if any(r.label == "snapkv@0.2" for r in runs):
            raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS (a test's)")
        return real_time(runs, *a, **kw)

    monkeypatch.setattr(measure, "compile_prefill", compile_prefill)  # where plan_variant looks it up
    monkeypatch.setattr(roofline, "time_runs", time_runs)
    argv = TINY + ["--lengths", "128", "--methods", "full,snapkv,streaming_llm,quest", "--out", str(out)]
    assert roofline.main(argv) == 0
    rows = {r["label"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["streaming_llm@0.2"]["status"] == "failed" and "Mosaic" in rows["streaming_llm@0.2"]["error"]
    assert rows["streaming_llm@0.2"]["error"].startswith("prefill compile: RuntimeError")
    assert rows["snapkv@0.2"]["status"] == "failed" and rows["snapkv@0.2"]["error"].startswith("decode: RuntimeError")
    assert rows["full"]["status"] == rows["quest@0.2"]["status"] == "ok"
    assert rows["quest@0.2"]["speedup"] == pytest.approx(rows["full"]["step_s"] / rows["quest@0.2"]["step_s"])
    monkeypatch.setattr(roofline, "time_runs", real_time)
    monkeypatch.setattr(  # full fails: its configuration's variants are recorded failed with it
        measure, "compile_prefill", lambda m, *a, **kw: (_ for _ in ()).throw(RuntimeError(m.name))
    )
    assert roofline.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["status"] for r in rows] == ["failed"] * 4
    assert {r["label"]: r["error"] for r in rows} == {
        "full": "prefill compile: RuntimeError: full",
        "snapkv@0.2": "full failed: prefill compile: RuntimeError: full",
        "streaming_llm@0.2": "full failed: prefill compile: RuntimeError: full",
        "quest@0.2": "full failed: prefill compile: RuntimeError: full",
    }
    assert "failed: full failed" in out.with_suffix(".txt").read_text()


def test_resume_measures_only_what_is_missing(roofline, tmp_path, monkeypatch):
    """--resume keeps the rows of a run at the same commit and settings and builds only the variants it lacks (full
    again beside them); another commit or other settings measure everything again."""
    out = tmp_path / "r.json"
    monkeypatch.setenv("KVJAX_COMMIT", "a" * 40)
    monkeypatch.setattr(roofline, "git_dirty", lambda *paths: False)
    base = TINY + ["--lengths", "128", "--out", str(out), "--resume"]
    assert roofline.main(base + ["--methods", "full,snapkv"]) == 0
    built = []
    real = roofline.build
    monkeypatch.setattr(
        roofline, "build", lambda cfg, var, *a, **kw: built.append(var.label) or real(cfg, var, *a, **kw)
    )
    assert roofline.main(base + ["--methods", "full,snapkv,streaming_llm"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert built == ["full", "streaming_llm@0.2"]
    assert [(r["label"], r["full_row"]) for r in rows] == [
        ("full", 0),
        ("snapkv@0.2", 0),
        ("full", 2),
        ("streaming_llm@0.2", 2),
    ]
    built.clear()
    assert roofline.main(base + ["--methods", "full,snapkv,streaming_llm"]) == 0  # all measured: nothing built
    assert built == [] and len(json.loads(out.read_text())["rows"]) == 4
    monkeypatch.setenv("KVJAX_COMMIT", "b" * 40)  # another commit
    assert roofline.main(base + ["--methods", "full,snapkv"]) == 0
    assert built == ["full", "snapkv@0.2"] and len(json.loads(out.read_text())["rows"]) == 2
    old = json.loads(out.read_text())  # other settings, or a tree that differs from its commit: nothing kept
    assert roofline.resumable_rows(old, dict(old)) == old["rows"]
    assert roofline.resumable_rows(old, {**old, "steps": old["steps"] + 1}) == []
    assert roofline.resumable_rows(old, {**old, "commit_dirty": True}) == []
