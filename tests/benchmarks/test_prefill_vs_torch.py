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


@pytest.mark.extended  # CI's second line (.ci/run); not the default run, for time (docs/testing.md)
def test_smoke(tmp_path):
    from kvjax.loading import assets

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
        keys = ("median_s", "median_cpu_s", "prefill_peak", "setup_peak", "process_peak", "rss_loaded")
        for key in keys + ("matmul_peak_gflops", "gflops", "of_peak", "prefill_gflop"):
            assert row[side][key] > 0, (side, key)
        assert row[side]["cpus"] == row["torch"]["cpus"] and len(row[side]["cpus"]) == 1
    assert row["kvjax"]["bucket"] == 512 and row["torch"]["torch_threads"] == 1
    assert row["kvjax"]["same_argmax"] and row["kvjax"]["max_abs_logit_diff"] < 1e-3


def test_prefill_flops_against_torch_flop_counter():
    """``prefill_flops`` against torch's own count of a transformers model's forward (``FlopCounterMode``, 2 per
    multiply-add): with SDPA it counts the projections, MLP and LM head; eager attention adds ``QK^T`` and ``PV``
    over all ``n^2`` pairs, of which a causal prefill needs ``n (n + 1) / 2``."""
    import torch
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from prefill_vs_torch import prefill_flops

    hf = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    hf.update(num_key_value_heads=2, max_position_embeddings=256)
    n, ids = 50, torch.randint(0, 300, (1, 50), generator=torch.Generator().manual_seed(0))
    counts = {}
    for impl in ("sdpa", "eager"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf, attn_implementation=impl)).eval()
        with torch.inference_mode(), FlopCounterMode(display=False) as fc:
            model(ids, use_cache=True, logits_to_keep=1)
        counts[impl] = fc.get_total_flops()
    square = counts["eager"] - counts["sdpa"]
    assert square > 0
    assert prefill_flops(hf, n) == counts["sdpa"] + square * (n + 1) / (2 * n)
