"""``kvjax-eval longgen``: perplexity of a long teacher-forced continuation with the bytes held along it
(eval.runner.LongGenTask), on a tiny random model and, CPU-sized, through the command line on the embedded SmolLM2."""

import json

import numpy as np
import pytest

from eval import cli, perplexity, runner
from kvjax import methods


# the sizes and seed of the tiny fixture's model (tests/conftest.py)
pytestmark = pytest.mark.tiny(max_position_embeddings=512, seed=0)


def test_bytes_held_along_a_long_continuation(tiny):
    """SnapKV's held bytes grow with every token; under a decode budget they are flat from the first
    re-compression on; a decode budget the continuation fits gives the unbounded NLL (to float rounding); ``score``
    is the last length's NLL."""
    task = runner.LongGenTask(num_sequences=2, prefix=64, continuations=(40, 120, 200))
    seqs = np.random.RandomState(0).randint(2, 60, size=(2, 264)).astype(np.int32)
    meta = {"task": "longgen"}
    grow = task.run_batch(tiny, methods.get("snapkv", budget=0.2, window=4), None, seqs, meta)
    flat = task.run_batch(
        tiny, methods.get("snapkv", budget=0.2, window=4, decode_budget=24, every=8), None, seqs, meta
    )
    fits = task.run_batch(
        tiny, methods.get("snapkv", budget=0.2, window=4, decode_budget=250, every=8), None, seqs, meta
    )
    for g, f, w in zip(grow, flat, fits):
        held = [s["held_bytes"] for s in g["sweep"]]
        assert held[0] < held[1] < held[2]
        bounded = [s["held_bytes"] for s in f["sweep"]]
        assert bounded[1] == bounded[2] < held[0]  # steps 119 and 199: both 24 + 119 % 8 = 31 = 24 + 199 % 8 tokens
        assert [s["continuation"] for s in g["sweep"]] == [40, 120, 200]
        assert g["score"] == pytest.approx(g["sweep"][-1]["nll"]) and g["held_bytes"] == held[-1]
        # the same tokens held; float rounding differs with the slot count (the attention's summation tiles)
        assert [s["nll"] for s in w["sweep"]] == pytest.approx([s["nll"] for s in g["sweep"]], rel=1e-6)
        assert np.isfinite(f["score"])
    nll = perplexity.streaming_nll(tiny, methods.get("snapkv", budget=0.2, window=4), seqs, 64)
    assert grow[0]["score"] == pytest.approx(float(nll[0].mean()))
    with pytest.raises(ValueError, match="ascending"):
        runner.LongGenTask(continuations=(64, 32))


@pytest.mark.extended  # CI's second line (.ci/run); not the default run, for time (docs/testing.md)
def test_the_command_line_on_the_embedded_model(tmp_path):
    """A CPU-sized run of the subcommand: full, and SnapKV with a decode budget (``--option``), perplexity and bytes
    held at the end beside it in results.json."""
    argv = [
        "longgen",
        "--methods",
        "full,snapkv",
        "--budgets",
        "0.25",
        "--prefix",
        "64",
        "--continuations",
        "24,72",
        "--sequences",
        "1",
        "--option",
        "snapkv.decode_budget=24",
        "--option",
        "snapkv.every=8",
        "--out",
        str(tmp_path),
        "--no-progress",
    ]
    assert cli.main(argv) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    by = {r["method"]: r for r in rows}
    assert set(by) == {"full", "snapkv"} and all(r["task"] == "longgen" for r in rows)
    full, snap = by["full"], by["snapkv"]
    assert snap["tokens_held"] == 24 + 71 % 8 and full["tokens_held"] == 64 + 71  # 71 decode steps
    assert snap["held_bytes"] < full["held_bytes"] / 3 and np.isfinite(snap["score"])
    assert (tmp_path / "results.md").read_text().count("long-gen perplexity") >= 1
