"""benchmarks/serving.py on the 2-layer random model: the fit's arithmetic against a brute-force count of the byte
model, the states' bytes against the method's own accounting, and (extended) the whole run: the fitted batch against
a hand computation at a limit where it is 3, the JSON's fields, full's row first, ratios from the same run, resume
without measuring again, an interrupted row measured again once and then skipped, the batch rows, and the step-down
on a forced failure. No timing is checked."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from repo_scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sv():
    return load_script("benchmarks/serving.py", "bench_serving", beside=True)


def _need(b, prefill_peak, points, fixed, per_seq):
    """need(B) of the module docstring, in exact rationals, the decode line through ``points`` (flat at the lower
    batch's peak where it does not rise)."""
    from fractions import Fraction

    (ba, pa), (bb, pb) = sorted((int(k), v) for k, v in points.items())
    decode = pa + Fraction((b - ba) * max(pb - pa, 0), bb - ba)
    return max(prefill_peak + fixed + b * per_seq, decode + fixed + per_seq)


def _largest(limit, prefill_peak, points, fixed, per_seq, max_batch=1000):
    """Counting up from 1 while the next batch fits (need(B) rises with B)."""
    b = 0
    while b < max_batch and _need(b + 1, prefill_peak, points, fixed, per_seq) <= limit:
        b += 1
    return b


def test_fit_batch_is_the_largest_that_fits(sv):
    import random

    rng = random.Random(0)
    cases = [
        (1000, 300, {1: 250, 4: 400}, 0, 50)
    ]  # by hand: prefill 300 + 50 B <= 1000: 14; decode 250 + 50 (B - 1) + 50 <= 1000: 15
    for _ in range(200):
        ba = rng.choice([1, 2])
        bb = ba + rng.randint(1, 8)
        pa = rng.randint(0, 5000)
        cases.append(
            (
                rng.randint(0, 20000),
                rng.randint(0, 5000),
                {ba: pa, bb: pa + rng.randint(-50, 3000)},
                rng.choice([0, rng.randint(0, 500)]),
                rng.randint(20, 700),
            )
        )
    for limit, p, points, fixed, s in cases:
        got = sv.fit_batch(limit, p, points, fixed, s, max_batch=1000)
        assert got["batch"] == _largest(limit, p, points, fixed, s), (limit, p, points, fixed, s, got)
    assert sv.fit_batch(1000, 300, {1: 250, 4: 400}, 0, 50, 4096)["batch"] == 14
    assert sv.fit_batch(1000, 300, {"1": 250, "4": 400}, 0, 50, 5)["batch"] == 5  # JSON's string keys; the cap


def test_state_bytes_follow_the_methods_accounting(sv):
    import jax.numpy as jnp

    from kvjax import engine, methods
    from kvjax.methods.base import Capacity, tree_bytes

    cfg, cap = sv.MODELS["tiny"], Capacity(64, 5)
    for name in ("full", "snapkv", "less", "pqcache"):
        m = methods.get(name) if name == "full" else methods.get(name, budget=0.5)
        fixed, per_seq = sv.state_bytes(cfg, m, cap, jnp.float32, False)
        st = [sv.abstract_states(cfg, m, b, cap, jnp.float32, False) for b in (1, 2, 3)]
        assert per_seq == engine.memory_bytes(m, st[1]) - engine.memory_bytes(m, st[0]) > 0, name
        assert tree_bytes(st[2]) == fixed + 3 * per_seq, name  # what batch 3 allocates
        assert (fixed > 0) == (name == "less"), name  # only LESS's kernels are not per sequence


def test_variants_order(sv):
    labels = [v[0] for v in sv.serving_variants(["snapkv", "quest", "less", "full", "chelsea"], 0.2, 2048)]
    assert labels == ["full", "chelsea@0.2", "less@0.2", "snapkv@0.2", "quest@2048"]


SMALL = ["--model", "tiny", "--context", "64", "--new-tokens", "3", "--repeats", "1", "--dtype", "float32"]


@pytest.mark.extended  # ~70 s on 2 cores: a dozen tiny compiles (CI's second line, docs/testing.md)
def test_tiny_run(sv, tmp_path, monkeypatch, capsys):
    import jax.numpy as jnp

    from kvjax import methods
    from kvjax.methods.base import Capacity

    cfg, full = sv.MODELS["tiny"], methods.get("full")
    cap = Capacity(64, 2 * 2 + 1)  # (repeats + 1) * (new_tokens - 1) steps
    shapes = sv.abstract_params(cfg, jnp.float32, False)
    _, _, inputs = sv.probe(cfg, full, shapes, cap, jnp.float32, False, 4, 3)
    args = (inputs["prefill_peak"], inputs["decode_peaks"], inputs["state_fixed"], inputs["state_per_seq"])
    limit = (_need(3, *args) + _need(4, *args)) / 2  # between batch 3's need and batch 4's: full fits 3
    gb = f"{float(limit) / 2**30!r}"

    out, out_b = tmp_path / "serving.json", tmp_path / "batch.json"
    run = SMALL + ["--methods", "snapkv,full", "--memory-gb", gb, "--rows", "fit"]
    assert sv.main(run + ["--out", str(out)]) == 0
    data = json.loads(out.read_text())
    for key in ("jax_version", "device_kind", "backend", "commit", "command", "model_config", "memory_limit_bytes"):
        assert key in data, key
    rows = data["rows"]
    assert [(r["kind"], r["label"], r["status"]) for r in rows] == [("fit", "full", "ok"), ("fit", "snapkv@0.2", "ok")]
    f, s = rows
    limit = data["memory_limit_bytes"]
    assert f["fit"]["limit"] == limit and f["fit"]["batch"] == _largest(limit, *args) == 3  # by hand
    assert f["fit"]["decode_peaks"] == {str(k): v for k, v in inputs["decode_peaks"].items()}
    assert f["batch"] == 3 and [t["batch"] for t in f["tries"]] == [3]
    assert s["batch"] > f["batch"]  # SnapKV holds half the prompt: more sequences fit
    for r in rows:
        assert r["throughput_tok_s"] == pytest.approx(r["batch"] * r["decode_steps"] / r["decode_s"])
        assert r["decode_steps"] == 2 and r["tries"][-1]["status"] == "ok" and r["ttft_1_s"] > 0
        assert r["cache_bytes"] == r["fit"]["state_fixed"] + r["batch"] * r["fit"]["state_per_seq"]
    assert s["full_row"] == 0 and s["throughput_ratio_vs_full"] == pytest.approx(
        s["throughput_tok_s"] / f["throughput_tok_s"]
    )
    assert s["batch_ratio_vs_full"] == pytest.approx(s["batch"] / 3)
    assert "== the largest batch at a fixed memory" in out.with_suffix(".txt").read_text()

    capsys.readouterr()
    assert sv.main(run + ["--out", str(out)]) == 0  # resume: nothing measured again
    assert json.loads(out.read_text())["rows"] == rows
    assert capsys.readouterr().out.count("already measured") == 2

    data["rows"][1]["status"] = "running"  # as a run stopped inside that row leaves it: measured again, in place
    out.write_text(json.dumps(data))
    assert sv.main(run + ["--out", str(out)]) == 0
    again = json.loads(out.read_text())["rows"]
    assert again[0] == rows[0] and (again[1]["status"], again[1]["interrupted"], again[1]["row_id"]) == ("ok", 1, 1)
    again[1]["status"] = "running"  # stopped inside it a second time: skipped with the reason
    out.write_text(json.dumps({**data, "rows": again}))
    assert sv.main(run + ["--out", str(out)]) == 0
    last = json.loads(out.read_text())["rows"][1]
    assert last["status"] == "skipped" and "interrupted 2 times" in last["skipped"]

    batch = ["--rows", "batch", "--batch", "2", "--batch-contexts", "40", "--memory-gb", "1", "--out", str(out_b)]
    assert sv.main(SMALL + ["--methods", "snapkv,full"] + batch) == 0  # the batch rows, e2e.py's path
    bf, bs = json.loads(out_b.read_text())["rows"]
    assert (bf["label"], bf["status"], bs["status"]) == ("full", "ok", "ok") and bf["batch"] == bs["batch"] == 2
    assert bs["full_row"] == bf["row_id"] == 0 and bs["tpot_speedup_vs_full"] == pytest.approx(
        bf["tpot_s"] / bs["tpot_s"]
    )
    assert bs["ttft_s"] > 0 and bs["throughput_tok_s"] == pytest.approx(2 * 2 / bs["decode_s"])

    real = sv.run_at

    def fail_at_3(cfg, method, params, states, first, *a):
        if first.shape[0] == 3:
            raise RuntimeError("RESOURCE_EXHAUSTED: forced by the test")
        return real(cfg, method, params, states, first, *a)

    monkeypatch.setattr(sv, "run_at", fail_at_3)
    out2 = tmp_path / "stepdown.json"
    assert sv.main(SMALL + ["--methods", "full", "--memory-gb", gb, "--batch-contexts", "", "--out", str(out2)]) == 0
    (r,) = json.loads(out2.read_text())["rows"]
    assert [(t["batch"], t["status"]) for t in r["tries"]] == [(3, "failed"), (2, "ok")]
    assert "RESOURCE_EXHAUSTED" in r["tries"][0]["reason"] and r["batch"] == 2 and r["status"] == "ok"


@pytest.mark.extended  # ~2 min on 2 cores: every phase of the GPU script, then its resume
def test_gpu_script_tiny(tmp_path):
    """scripts/gpu_serving.sh end to end with TINY=1 (its phases at tiny shapes on the CPU): the files it leaves in
    $OUT (at most 8), the serving rows, the Gemma rows at batch 8 in bfloat16 with the hybrid and
    the all-global plan, then a second call that resumes from the first's files and measures nothing again."""
    import os
    import subprocess

    out = tmp_path / "out"
    env = {**os.environ, "TINY": "1", "OUT": str(out), "METHODS": "full,snapkv"}  # Gemma: snapkv,quest as on the GPU
    env["PYTHON"] = sys.executable
    env["KVJAX_COMMIT"] = "d" * 40  # the resume key: fixed, so a commit landing between the two calls changes nothing
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_serving.sh")], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and "serving_tiny_cpu.json" in files and "gpu_serving.log" in files, files
    rows = json.loads((out / "serving_tiny_cpu.json").read_text())["rows"]
    assert [(r["kind"], r["label"], r["context"], r["status"]) for r in rows] == [
        ("fit", "full", 64, "ok"),
        ("fit", "snapkv@0.2", 64, "ok"),
        ("batch", "full", 40, "ok"),
        ("batch", "snapkv@0.2", 40, "ok"),
        ("batch", "full", 64, "ok"),
        ("batch", "snapkv@0.2", 64, "ok"),
    ]
    for shape, plan in (("gemma3", "5 local layers"), ("gemma3_global", "6 layers")):
        data = json.loads((out / f"roofline_{shape}_tiny_cpu_64_b8.json").read_text())
        assert [(r["label"], r["status"], r["batch"], r["dtype"]) for r in data["rows"]] == [
            (label, "ok", 8, "bfloat16") for label in ("full", "snapkv@0.2", "quest@0.2", "full", "quest@2048")
        ]  # --group-size 2: each pair of variants beside its own full
        assert all(r["layer_plan"].startswith(plan) for r in data["rows"]), shape
        assert (out / f"roofline_{shape}_tiny_cpu_64_b8.txt").exists()

    again = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_serving.sh")],
        env={**env, "OUT": str(tmp_path / "again"), "PREV": str(out)},
        capture_output=True,
        text=True,
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    log = (tmp_path / "again" / "gpu_serving.log").read_text()
    assert log.count("already measured") == 6 and log.count("already in") == 2, log[-3000:]
    assert json.loads((tmp_path / "again" / "serving_tiny_cpu.json").read_text())["rows"] == rows
