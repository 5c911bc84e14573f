"""The engine's prefill over a long bucket: position-wise work in token blocks over the live blocks only
(``kvjax.model.layer_step`` with ``live``) and chunked attention over the live query blocks give the logits and the
cache of the plain, unblocked layer loop with the one-shot dense softmax (``prefill_attention.dense_attention``).

A tiny random Llama (2 layers, 4 query / 2 KV heads) on a 1024-token bucket with prompts of 700 and 333 tokens:
``TOKEN_BLOCK`` is set to 16 here, so 44 of the 64 token blocks run and 20 are skipped; the attention runs 3 of
its 4 query chunks of 256. Unrolled and scanned layers (``scan_layers``).
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.engine import core
from kvjax import engine, methods
from kvjax import model as M
from kvjax.model import prefill_attention as P
from kvjax.methods.base import Capacity
from tiny_models import tiny_config

CFG = tiny_config(vocab_size=96, max_position_embeddings=2048)
T, LENGTHS = 1024, (700, 333)


def reference(params, tokens, lengths):
    """Last-token logits ``[B, V]`` and each layer's k, v from the unblocked loop with dense attention."""
    positions = jnp.broadcast_to(jnp.arange(T), tokens.shape)

    def dense(layer, x, q, k, v, kv):
        return P.dense_attention(q, k, v, lengths), kv + ((k, v),)

    x, kv = M.run_layers(CFG, params, M.embed(params, tokens), positions, dense, ())
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)
    return M.logits(CFG, params, last)[:, 0], kv


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_blocked_prefill_equals_unblocked_dense(monkeypatch, scan):
    monkeypatch.setattr(M, "TOKEN_BLOCK", 16)
    params = M.random_params(CFG, jax.random.PRNGKey(0), scale=0.2)
    rng = np.random.RandomState(0)
    tokens = np.zeros((2, T), np.int32)
    for i, n in enumerate(LENGTHS):
        tokens[i, :n] = rng.randint(1, 96, size=n)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(LENGTHS, jnp.int32)
    want_logits, want_kv = jax.jit(reference)(params, tokens, lengths)

    method = methods.get("full")
    states = engine.init_states(CFG, method, 2, Capacity(T, 4), jnp.float32, scan_layers=scan)
    run = M.stack_layers(params) if scan else params
    states, logits = engine.prefill(CFG, method, run, tokens, lengths, states)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), atol=2e-5, rtol=0)
    for layer, st in enumerate(engine.layer_states(states)):
        for got, want in zip((st.k, st.v), want_kv[layer]):
            for i, n in enumerate(LENGTHS):
                np.testing.assert_allclose(np.asarray(got[i, :, :n]), np.asarray(want[i, :, :n]), atol=2e-5, rtol=0)


def test_live_blocks_skip_padding():
    """Only the blocks before the longest prompt run: the compiled prefill's loops have dynamic trip counts, and
    rows past it are left as they were (finite)."""
    assert int(P.live_chunks(jnp.asarray([700, 333]), T, 256)) == 3
    assert int(P.live_chunks(jnp.asarray([0]), T, 256)) == 0
    assert int(P.live_chunks(None, 1000, 256)) == 4
    q = jnp.ones((1, 4, 512, 16))
    k = v = jnp.zeros((1, 2, 512, 16))
    out = P.chunked_attention(q, k, v, jnp.asarray([100]), None, 128)
    np.testing.assert_array_equal(np.asarray(out[:, :, 128:]), 1.0)  # past the one live block: q's values
    np.testing.assert_array_equal(np.asarray(out[:, :, :100]), 0.0)  # attended: v is 0


# ------------------------------------------------------------------ every method: what padding holds does not matter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sharding"))
import test_sharded_generate as tsg  # noqa: E402

#: the default run: one method of each prefill kind (nothing scored, the prompt's attention scored, a window's
#: queries scored with the previous layer's selection reused, keys quantised for recall); every method with --runslow
DEFAULT_METHODS = methods.cover("attends_prompt", "reuses_previous_layer", "recalls")
STEPS = 3


def steps(name, token_block, monkeypatch):
    """Prefill (bucket T, prompts of LENGTHS) and STEPS greedy decode steps: logits ``[STEPS + 1, B, V]``."""
    monkeypatch.setattr(M, "TOKEN_BLOCK", token_block)
    method = tsg.method(name, budget=0.3)
    params = M.random_params(CFG, jax.random.PRNGKey(1), scale=0.2)
    rng = np.random.RandomState(1)
    ids = [list(rng.randint(1, 96, size=n)) for n in LENGTHS]
    tokens, lengths = engine.pad_prompts(ids, T)
    states = engine.init_states(CFG, method, len(ids), Capacity(T, STEPS + 1), jnp.float32)
    # a fresh jit per setting: TOKEN_BLOCK is read while tracing
    prefill = jax.jit(core.prefill, static_argnums=(0, 1))
    states, logits = prefill(CFG, method, params, jnp.asarray(tokens), jnp.asarray(lengths), states)
    out, pos = [logits], jnp.asarray(lengths)
    step = jax.jit(core.decode_step, static_argnums=(0, 1))
    for _ in range(STEPS):
        logits, states = step(CFG, method, params, states, jnp.argmax(out[-1], -1).astype(jnp.int32), pos)
        out.append(logits)
        pos = pos + 1
    return np.asarray(jnp.stack(out))


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n in DEFAULT_METHODS else pytest.mark.slow) for n in methods.names()]
)
def test_methods_ignore_what_padding_holds(name, monkeypatch):
    """Token blocks of 16 (44 of 64 run: rows past the longest prompt stay 0) against one pass over the whole
    bucket (padding rows computed from the padding tokens): every method keeps and attends the same tokens, so
    the prefill logits and the next decode steps' logits agree."""
    blocked = steps(name, 16, monkeypatch)
    whole = steps(name, 10**9, monkeypatch)
    np.testing.assert_allclose(blocked, whole, atol=1e-4, rtol=0)
