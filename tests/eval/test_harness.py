"""Harness on a tiny random model: streaming perplexity and the question-after-context protocol against the
dense forward pass (kvjax.model.forward, an independent full-attention path), compile reuse, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eval import harness, perplexity, runner
from kvjax import engine, methods
from kvjax.config import ModelConfig
from kvjax.loading import Model
from kvjax.model import forward, random_params


_forward = jax.jit(forward, static_argnums=0)


def dense_logits(model, seqs, pad=48):
    """Dense-forward logits ``[B, T, V]`` computed on a fixed padded length (causal: padding never leaks back)."""
    seqs = np.asarray(seqs, np.int32)
    x = np.zeros((seqs.shape[0], pad), np.int32)
    x[:, : seqs.shape[1]] = seqs
    return np.asarray(_forward(model.config, model.params, jnp.asarray(x)), np.float64)[:, : seqs.shape[1]]


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                      sliding_windows=(None, None))
    return Model(cfg, random_params(cfg, jax.random.PRNGKey(0), scale=0.3), None, "tiny")


def test_streaming_nll_full_equals_dense_forward(tiny):
    rng = np.random.RandomState(0)
    seqs = rng.randint(3, 64, size=(2, 40)).astype(np.int32)
    nll = perplexity.streaming_nll(tiny, methods.get("full"), seqs, prefix=32)
    logits = dense_logits(tiny, seqs)  # [B, T, V]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
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
    return seq[len(ids):]


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
    rows = task.run_batch(tiny, methods.get("full"), None, seqs, {"task": "perplexity",
                                                                        "method": "full", "budget": None})
    assert [r["tokens"] for r in rows] == [8, 8] and all(np.isfinite(r["nll"]) for r in rows)


def test_bad_input(tiny):
    with pytest.raises(ValueError, match="method='nope' is not registered"):
        harness.method_grid(["full", "nope"], [0.2])
    for bad in (0.0, 1.5, -0.2, True, "0.2"):
        with pytest.raises(ValueError, match="budget=.* must be a fraction of the context in \\(0, 1\\]"):
            harness.method_grid(["snapkv"], [bad])
    assert harness.method_grid(["full", "snapkv"], [0.2, 1]) == [("full", None), ("snapkv", 0.2), ("snapkv", 1.0)]
    with pytest.raises(ValueError, match="longer than the model's context of 256"):
        runner.NeedleTask(lengths=(300,)).prepare(tiny)
    with pytest.raises(ValueError, match="longer than the model's context of 256"):
        perplexity.streaming_nll(tiny, methods.get("full"), np.zeros((1, 300), np.int32), prefix=256)
    with pytest.raises(ValueError, match="longer than bucket=32"):
        harness.answer_after_context(tiny, methods.get("full"), [[3] * 40], [[4]], bucket=32, max_new_tokens=2)
