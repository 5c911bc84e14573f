"""Harness on a tiny random model: streaming perplexity and the question-after-context protocol against the
dense forward pass (kvjax.model.forward, an independent full-attention path), compile reuse, bad input."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eval import harness, perplexity, report, runner
from kvjax import engine, methods
from kvjax.methods.base import Capacity
from kvjax.model import forward


_forward = jax.jit(forward, static_argnums=0)


def dense_logits(model, seqs, pad=48):
    """Dense-forward logits ``[B, T, V]`` computed on a fixed padded length (causal: padding never leaks back)."""
    seqs = np.asarray(seqs, np.int32)
    x = np.zeros((seqs.shape[0], pad), np.int32)
    x[:, : seqs.shape[1]] = seqs
    return np.asarray(_forward(model.config, model.params, jnp.asarray(x)), np.float64)[:, : seqs.shape[1]]


# the sizes and seed of the tiny fixture's model (tests/conftest.py)
pytestmark = pytest.mark.tiny(max_position_embeddings=256, seed=0)


def test_streaming_nll_full_equals_dense_forward(tiny):
    rng = np.random.RandomState(0)
    seqs = rng.randint(3, 64, size=(2, 40)).astype(np.int32)
    nll = perplexity.streaming_nll(tiny, methods.get("full"), seqs, prefix=32)
    logits = dense_logits(tiny, seqs)  # [B, T, V]
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    ref = -np.take_along_axis(logp[:, 31:-1], seqs[:, 32:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(nll, ref, rtol=1e-4, atol=1e-4)
    assert perplexity.perplexity(nll) == pytest.approx(float(np.exp(ref.mean())), rel=1e-4)


def test_compressed_perplexity_differs_and_is_finite(tiny):
    seqs = np.random.RandomState(1).randint(3, 64, size=(2, 40)).astype(np.int32)
    full = perplexity.streaming_nll(tiny, methods.get("full"), seqs, prefix=32)
    nll = perplexity.streaming_nll(tiny, methods.get("streaming_llm", budget=0.5), seqs, prefix=32)
    assert np.isfinite(nll).all() and nll.shape == full.shape and not np.allclose(nll, full)


def _dense_greedy(model, ids, n):
    seq = list(ids)
    for _ in range(n):
        seq.append(int(np.argmax(dense_logits(model, [seq])[0, -1])))
    return seq[len(ids) :]


def test_question_after_context_full_equals_dense_greedy(tiny):
    rng = np.random.RandomState(2)
    contexts = [list(rng.randint(3, 64, size=n)) for n in (20, 27)]
    questions = [list(rng.randint(3, 64, size=n)) for n in (3, 5)]
    out = harness.answer_after_context(tiny, methods.get("full"), contexts, questions, bucket=32, max_new_tokens=6)
    for c, q, a in zip(contexts, questions, out):
        ref = _dense_greedy(tiny, c + q, 6)
        eos = set(tiny.config.eos_token_ids)
        cut = next((i for i, t in enumerate(ref) if t in eos), len(ref))
        assert a == ref[:cut]


def test_question_after_context_compiles_once(tiny):
    rng = np.random.RandomState(3)
    method = methods.get("snapkv", budget=0.5, window=4)
    args = dict(bucket=32, max_new_tokens=4, capacity_new=12)
    harness.answer_after_context(tiny, method, [list(rng.randint(3, 64, 30))], [[5, 6]], **args)
    before = dict(engine.TRACE_COUNTS)
    harness.answer_after_context(tiny, method, [list(rng.randint(3, 64, 25))], [[7, 8, 9]], **args)
    assert dict(engine.TRACE_COUNTS) == before


def test_runner_perplexity_rows_and_timings(tiny):
    # PerplexityTask needs a tokenizer to build text; run its batch function on token ids directly.
    task = runner.PerplexityTask(num_sequences=2, prefix=32, continuation=8)
    seqs = np.random.RandomState(4).randint(3, 64, size=(2, 40)).astype(np.int32)
    rows = task.run_batch(
        tiny, methods.get("full"), None, seqs, {"task": "perplexity", "method": "full", "budget": None}
    )
    assert [r["tokens"] for r in rows] == [8, 8] and all(np.isfinite(r["nll"]) for r in rows)
    # memory beside the score: the full cache at Capacity(32, 8) holds 32 + 7 tokens per sequence at the end
    cap_bytes = harness.bytes_per_seq(tiny.config, methods.get("full"), task.capacity(None), tiny.dtype)
    for r in rows:
        assert r["tokens_held"] == 39.0 and r["cache_bytes"] == cap_bytes and r["kib_per_seq"] == cap_bytes / 1024
    rows = task.run_batch(tiny, methods.get("snapkv", budget=0.25), None, seqs, {})
    assert all(r["tokens_held"] == 8 + 7 for r in rows)  # ceil(0.25 * 32) prompt tokens + 7 decoded


def test_equal_bytes_budget_search(tiny):
    """``--equal-bytes``: the largest budget whose bytes held at the end of generation (mean over the task's
    prompts) fit the reference's; the prediction from shapes and the budget contract equals what generations of
    those prompts hold, measured from their states."""
    cap, ends = Capacity(128, 8), [(64, 7), (128, 7)]
    ref = harness.held_at_end(tiny.config, methods.get("h2o", budget=0.2), cap, tiny.dtype, ends)
    step = 1 / harness.FRACTION_STEPS
    found = {}
    for name in ("snapkv", "streaming_llm", "chelsea"):
        f, got = harness.equal_bytes_budget(tiny.config, name, ref, cap, tiny.dtype, ends, fraction=True)
        assert isinstance(f, float) and 0 < f < 1 and got <= ref, (name, f, got, ref)
        assert harness.held_at_end(tiny.config, methods.get(name, budget=f + step), cap, tiny.dtype, ends) > ref
        t, got_t = harness.equal_bytes_budget(tiny.config, name, ref, cap, tiny.dtype, ends)
        assert isinstance(t, int) and got_t <= ref
        assert harness.held_at_end(tiny.config, methods.get(name, budget=t + 1), cap, tiny.dtype, ends) > ref
        found[name] = f
    # snapkv keeps its 7 decoded tokens and h2o does not: a smaller share of each prompt; streaming_llm holds no
    # scores, so at least h2o's share
    assert found["snapkv"] < 0.2 <= found["streaming_llm"]
    with pytest.raises(ValueError, match="more than the reference"):  # keeps every token's K/V whatever the budget
        harness.equal_bytes_budget(tiny.config, "pqcache", ref, cap, tiny.dtype, ends)
    rng = np.random.RandomState(5)
    prompts = [[int(x) for x in rng.randint(3, 64, n)] for n, _ in ends]
    for m, want in ((methods.get("h2o", budget=0.2), ref), (methods.get("snapkv", budget=found["snapkv"]), None)):
        out = engine.generate(tiny, prompts, m, 8, driver="python", stop_at_eos=False, prompt_len=128)
        measured = np.mean([st["held_bytes"] for st in out.stats])
        assert measured == pytest.approx(want or harness.held_at_end(tiny.config, m, cap, tiny.dtype, ends))
    task = runner.PerplexityTask(num_sequences=3, prefix=128, continuation=8)
    configs, records = runner.equal_bytes_grid(
        tiny, task, None, harness.method_grid(["full", "h2o", "snapkv", "pqcache"], [0.2]), "h2o"
    )
    f, _ = harness.equal_bytes_budget(
        tiny.config,
        "snapkv",
        harness.held_at_end(tiny.config, methods.get("h2o", budget=0.2), cap, tiny.dtype, [(128, 7)]),
        cap,
        tiny.dtype,
        [(128, 7)],
        fraction=True,
    )
    assert configs == [("full", None, None), ("h2o", 0.2, 0.2), ("snapkv", f, 0.2)]
    assert records[0]["budget"] == f and "skipped" in records[1]


def test_bad_input(tiny):
    with pytest.raises(ValueError, match="method='nope' is not registered"):
        harness.method_grid(["full", "nope"], [0.2])
    for bad in (0.0, 1.5, -0.2, 0, -1, float("nan"), True, "0.2"):
        with pytest.raises(ValueError, match="--budgets"):
            harness.method_grid(["snapkv"], [bad])
    # a float is a fraction of each prompt, an int a token count (at most the model context when given)
    assert harness.method_grid(["full", "snapkv"], [0.2, 1.0, 64]) == [
        ("full", None),
        ("snapkv", 0.2),
        ("snapkv", 1.0),
        ("snapkv", 64),
    ]
    with pytest.raises(ValueError, match="--budgets=300 tokens exceeds the model context of 256"):
        harness.method_grid(["snapkv"], [300], max_tokens=tiny.config.max_position_embeddings)
    with pytest.raises(ValueError, match="longer than the model's context of 256"):
        runner.NeedleTask(lengths=(300,)).prepare(tiny)
    with pytest.raises(ValueError, match="longer than the model's context of 256"):
        perplexity.streaming_nll(tiny, methods.get("full"), np.zeros((1, 300), np.int32), prefix=256)
    with pytest.raises(ValueError, match="longer than bucket=32"):
        harness.answer_after_context(tiny, methods.get("full"), [[3] * 40], [[4]], bucket=32, max_new_tokens=2)


@dataclasses.dataclass(frozen=True)
class _IdsTask:
    """Random prompts of 40 and 64 tokens, 6 greedy tokens each without stopping (the needle task's protocol)."""

    name = "ids"

    def prepare(self, model):
        rng = np.random.RandomState(6)
        return 64, [[[int(x) for x in rng.randint(3, 64, n)] for n in (40, 64)]]

    def capacity(self, prepared):
        return Capacity(64, 6)

    def ends(self, prepared):
        return [(40, 5), (64, 5)]

    def prefill_batch(self, prepared, batch):
        return engine.pad_prompts(batch, 64)

    def run_batch(self, model, method, prepared, batch, meta, prefilled=None):
        out = engine.generate(
            model, batch, method, 6, driver="python", prompt_len=64, stop_at_eos=False, prefilled=prefilled
        )
        return [{**meta, "score": 0.0, "tokens": out.tokens, **harness.memory_from_stats(st)} for st in out.stats]


def test_shared_prefill_is_made_once_and_kept_within_its_limit(tiny):
    task = _IdsTask()
    prepared = task.prepare(tiny)
    batch = prepared[1][0]
    shared = runner.Shared(tiny)
    pre = shared.get(task, prepared, 0, batch)
    assert shared.get(task, prepared, 0, batch) is pre and pre.tokens.shape == (2, 64)
    np.testing.assert_array_equal(pre.lengths, [40, 64])
    assert runner.Shared(tiny, limit=pre.q.nbytes).get(task, prepared, 0, batch) is None  # over the limit: none


@pytest.mark.extended  # CI's second line (.ci/run), whose main job runs the second pass too (docs/testing.md)
def test_second_pass_at_the_references_bytes_held(tiny):
    """``also_equal_bytes``: each other compressed method reruns at the budget whose bytes held at the end match
    the reference's (measured from the states); a budget that keeps the nominal token counts reuses the nominal
    run's rows instead of running again."""
    res = runner.run(
        tiny, [_IdsTask()], ["full", "h2o", "streaming_llm", "snapkv"], [0.25], progress=False, also_equal_bytes="h2o"
    )
    alone = runner.run(tiny, [_IdsTask()], ["snapkv"], [0.25], progress=False, share_prefill=False)["rows"]
    assert [r["tokens"] for r in res["rows"] if r["method"] == "snapkv"][:2] == [r["tokens"] for r in alone]
    rows = lambda m, second: [
        r for r in res["rows"] if r["method"] == m and (r.get("setting") == "equal_bytes") == second
    ]
    ref = np.mean([r["held_bytes"] for r in rows("h2o", False)])
    snap = rows("snapkv", True)
    assert snap[0]["budget"] < 0.25 and np.mean([r["held_bytes"] for r in snap]) <= ref
    assert np.mean([r["held_bytes"] for r in rows("snapkv", False)]) > ref  # nominal: it keeps its decoded tokens
    stream = rows("streaming_llm", True)  # no per-slot score: at least h2o's share, here the same token counts
    assert [r["budget"] for r in stream] == [0.25, 0.25] and all(r.get("reused") for r in stream)
    assert [r["held_bytes"] for r in stream] == [r["held_bytes"] for r in rows("streaming_llm", False)]
    assert not rows("h2o", True) and not rows("full", True)


@dataclasses.dataclass(frozen=True)
class _RandomText(runner.PerplexityTask):
    """Perplexity on random ids (the tiny model has no tokenizer): two batches of two sequences."""

    num_sequences: int = 4
    prefix: int = 32
    continuation: int = 6

    def prepare(self, model):
        harness.check_context(model, self.prefix, self.continuation, "prefix")
        seqs = np.random.RandomState(2).randint(3, 64, size=(4, self.prefix + self.continuation)).astype(np.int32)
        return self.prefix, [seqs[:2], seqs[2:]]


def test_a_run_into_a_folder_resumes_and_grows(tiny, tmp_path, monkeypatch):
    """``out=``: a run killed after its first cell (the next line cut short) computes only the missing cells and
    gives the same rows; a run adding a method computes only that method's cells and reports the whole folder; a
    run with other task settings, or other options for a method the folder ran, is refused, naming them. Progress
    inside a cell names the decode step."""
    calls, phases = [], []
    real = perplexity.streaming_nll

    def counted(model, method, seqs, prefix, **kw):
        calls.append(type(method).__name__)
        kw["on_phase"] = phases.append
        return real(model, method, seqs, prefix, **kw)

    monkeypatch.setattr(perplexity, "streaming_nll", counted)
    nll = lambda res: [(r["method"], r["sequence"], round(r["nll"], 5)) for r in res["rows"]]
    whole = runner.run(tiny, [_RandomText()], ["full", "h2o"], [0.5], progress=False, out=tmp_path / "a")
    assert len(calls) == 4 and phases[:3] == ["compress", "decode 1/5", "decode 2/5"]
    lines = (tmp_path / "a" / "rows.jsonl").read_text().splitlines()
    assert len(lines) == 5 and json.loads(lines[0])["settings"]["methods"] == ["full", "h2o"]
    (tmp_path / "a" / "rows.jsonl").write_text("\n".join(lines[:2]) + "\n" + lines[2][:40])
    calls.clear()
    resumed = runner.run(tiny, [_RandomText()], ["full", "h2o"], [0.5], progress=False, out=tmp_path / "a")
    assert calls == ["Full", "H2O", "H2O"] and nll(resumed) == nll(whole)
    calls.clear()
    snap = {"snapkv": {"window": 4}}  # options of a method new to the folder: its cells run with them
    grown = runner.run(tiny, [_RandomText()], ["snapkv"], [0.5], progress=False, out=tmp_path / "a", options=snap)
    assert calls == ["SnapKV", "SnapKV"]
    assert nll(grown)[:8] == nll(whole) and [m for m, _, _ in nll(grown)[8:]] == ["snapkv"] * 4
    assert grown["config"]["methods"] == ["full", "h2o", "snapkv"] and grown["config"]["options"] == snap
    this_run = sum(r["seconds"] for r in grown["timings"]["runs"])  # the snapkv cells only
    assert grown["timings"]["cell_seconds_all_runs"] > this_run  # and the full and h2o cells of the runs before
    assert "the folder's cells took" in report.header(grown)
    for other in ({"h2o": {"recent": 2}}, {"snapkv": {"window": 5}}):  # the folder's rows ran without these
        with pytest.raises(ValueError, match=r"options\.(h2o|snapkv) differs \((its defaults|\{'window': 4\}) there"):
            runner.run(tiny, [_RandomText()], ["full"], [0.5], progress=False, out=tmp_path / "a", options=other)
    with pytest.raises(ValueError, match="tasks.*--restart"):
        runner.run(tiny, [_RandomText(continuation=7)], ["full"], [0.5], progress=False, out=tmp_path / "a")
    for bad, error in [({"prefix": 10**6}, "prefix: a context"), ({"continuation": 7, "budgets": [2.0]}, "budget")]:
        budgets = bad.pop("budgets", [0.5])  # bad input is named first, not the folder's other settings
        with pytest.raises(ValueError, match=error):
            runner.run(tiny, [_RandomText(**bad)], ["full", "h2o"], budgets, progress=False, out=tmp_path / "a")
    calls.clear()
    runner.run(tiny, [_RandomText()], ["full"], [0.5], progress=False, out=tmp_path / "a", restart=True)
    assert calls == ["Full", "Full"]
