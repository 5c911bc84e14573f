"""H2O's decode step and prefill scores as loops over the live slots / causal tiles, against the NumPy references
(``ref_baselines.py``) and the masked decode-attention reference: several chunks with a shifted last chunk, a new
token evicted at once (no recent window), sequences of different lengths; and the compiled step's structure (no
copy of a cache buffer, nothing over all ``S`` slots but in-place updates and the step's score scratch)."""

from __future__ import annotations

import os
import re
import sys
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.decode_attention import decode_attention_reference
from kvjax.model import attention
from kvjax import methods
from kvjax.methods.core import select
from kvjax.methods.base import Capacity

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_baselines as ref  # noqa: E402
import test_baselines as tb  # noqa: E402
from test_causal_attention import np_accumulated  # noqa: E402


@pytest.mark.parametrize("chunk", [1, 5, 64])
@pytest.mark.parametrize("seed", range(3))
def test_attend_with_scores_matches_the_reference(seed, chunk):
    r = np.random.default_rng(seed)
    b, hkv, g, s, d = 2, 2, 3, 37, 8
    q = jnp.asarray(r.normal(size=(b, hkv * g, d)), jnp.float32)
    k = jnp.asarray(r.normal(size=(b, hkv, s, d)), jnp.float32)
    v = jnp.asarray(r.normal(size=(b, hkv, s, d)), jnp.float32)
    pos = np.where(r.random((b, hkv, s)) < 0.8, r.integers(0, 99, (b, hkv, s)), -1).astype(np.int32)
    lengths = np.array([s, 23], np.int32)
    part, sc, taken, free = jax.jit(lambda *a: attention.attend_with_scores(*a, chunk=chunk))(
        q, k, v, jnp.asarray(pos), jnp.asarray(lengths)
    )
    want = decode_attention_reference(q, k, v, jnp.asarray(pos >= 0), jnp.asarray(lengths))
    for x, y in zip(part, want):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
    qk = np.einsum("bhgd,bhsd->bhgs", np.asarray(q).reshape(b, hkv, g, d), np.asarray(k)) / np.sqrt(d)
    for bi, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(sc)[bi, ..., :n], qk[bi, ..., :n], rtol=1e-5, atol=1e-5)
        live = pos[bi, :, :n] >= 0
        np.testing.assert_array_equal(np.asarray(taken)[bi], live.sum(-1))
        first = [int(np.argmin(row)) if not row.all() else n for row in live]
        np.testing.assert_array_equal(np.asarray(free)[bi], first)


@pytest.mark.parametrize("lengths", [(0, 0), (5, 0)])
def test_one_pass_equals_the_loop_when_nothing_is_live(lengths):
    """``attention.chunk_loop`` runs the body once where one chunk covers the buffer, also when the loop would
    have run no trip (every length 0): the result is the loop's (the empty partial, nothing taken)."""
    r = np.random.default_rng(0)
    b, hkv, g, s, d = 2, 2, 2, 12, 8
    q = jnp.asarray(r.normal(size=(b, hkv * g, d)), jnp.float32)
    k, v = (jnp.asarray(r.normal(size=(b, hkv, s, d)), jnp.float32) for _ in range(2))
    valid, lengths = jnp.ones((b, hkv, s), bool), jnp.asarray(lengths, jnp.int32)
    one = attention.attend_with_scores(q, k, v, valid, lengths, chunk=s)
    loop = attention.attend_with_scores(q, k, v, valid, lengths, chunk=5)
    for x, y in zip(jax.tree.leaves((one[0], one[2], one[3])), jax.tree.leaves((loop[0], loop[2], loop[3]))):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)
    for bi, n in enumerate(np.asarray(lengths)):  # scores: defined below the length (the visited rows past it vary)
        np.testing.assert_allclose(np.asarray(one[1])[bi, ..., :n], np.asarray(loop[1])[bi, ..., :n], rtol=1e-6)
    assert np.asarray(one[2])[1].sum() == 0 and float(np.asarray(one[0][2])[1].max()) == 0.0  # nothing taken


@pytest.mark.parametrize("chunk", [1, 4, 7, 1000])  # 1000: one pass, no loop (GPU/TPU; attention.chunk_loop)
@pytest.mark.parametrize("budget,recent", [(0.5, 0.5), (0.5, 0), (20, 3)])
def test_h2o_decode_in_chunks_matches_reference(budget, recent, chunk):
    """``decode_partial`` with small chunks (many loop steps, a shifted last chunk) keeps, scores and attends
    exactly as the NumPy H2O head; ``recent=0`` makes the new token itself a candidate for eviction."""
    hq, hkv = 4, 2
    m = methods.get("h2o", budget=budget, recent=recent)
    q, k, v, lengths, dq, dk, dv = data = tb.inputs(hq, hkv)
    g = hq // hkv
    st = m.init(tb.model_cfg(hq, hkv), tb.B, Capacity(tb.T, tb.MAX_NEW), 0, jnp.float32)
    st = jax.jit(lambda st, *a: m.prefill(st, 0, *a))(st, *(jnp.asarray(x) for x in (q, k, v, lengths)))
    step = jax.jit(lambda st, *a: m.decode_partial(st, 0, *a, chunk=chunk)[:2])
    heads = {}
    for b in range(tb.B):
        n = int(lengths[b])
        acc = ref.accumulated_attention(q[b], k[b], n)
        bud = ref.sequence_budget(budget, n) if isinstance(budget, float) else min(budget, tb.T + tb.MAX_NEW)
        rec = int(Fraction(repr(recent)) * bud) if isinstance(recent, float) else max(min(recent, bud - 1), 0)
        for h in range(hkv):
            heads[b, h] = ref.H2OHead(bud, rec)
            heads[b, h].prefill(acc[h], k[b, h], v[b, h], n)
    for s in range(tb.STEPS):
        part, st = step(st, jnp.asarray(dq[s]), jnp.asarray(dk[s]), jnp.asarray(dv[s]), jnp.asarray(lengths + s))
        out = np.asarray(attention.normalise(part))
        got, score, pos = tb.kept(st), np.asarray(st.score), np.asarray(st.pos)
        for (b, h), head in heads.items():
            outs, _ = head.decode(dq[s, b, h * g : (h + 1) * g], dk[s, b, h], dv[s, b, h], int(lengths[b]) + s)
            np.testing.assert_allclose(out[b, h * g : (h + 1) * g], outs, atol=tb.ATOL, rtol=tb.ATOL)
            assert got[b, h] == sorted(head.held), f"step {s} b={b} h={h}"
            for slot in np.nonzero(pos[b, h] >= 0)[0]:
                np.testing.assert_allclose(
                    score[b, h, slot], head.held[int(pos[b, h, slot])], atol=tb.ATOL, rtol=tb.ATOL
                )
    tb.check_slot_contents(st, data, tb.STEPS)


@pytest.mark.parametrize("heads_at_once", [False, True])
@pytest.mark.parametrize("chunk,rows", [(16, 4), (16, 16), (12, 3), (64, None)])
def test_accumulated_scores_row_blocks_match_numpy(chunk, rows, heads_at_once):
    """Query blocks smaller than the key tiles (the diagonal tile masked, tiles past it skipped), per head or all
    heads at once, ragged lengths (an empty and a 1-token sequence) and garbage in the padding."""
    rng = np.random.default_rng(chunk + (rows or 0))
    lengths = np.array([45, 30, 1, 0])
    q = rng.standard_normal((4, 4, 45, 8)).astype(np.float32)
    k = rng.standard_normal((4, 2, 45, 8)).astype(np.float32)
    for b, n in enumerate(lengths):
        q[b, :, n:] = np.nan
        k[b, :, n:] = np.inf
    fn = jax.jit(lambda q, k, n: select.accumulated_scores(q, k, n, chunk, rows, heads_at_once))
    got = np.asarray(fn(q, k, lengths))
    want = np_accumulated(np.nan_to_num(q), np.nan_to_num(k, posinf=0.0), lengths)
    np.testing.assert_allclose(got, want, atol=1e-5)


def _spanning(fn, args, s: int) -> list[tuple[str, str, tuple]]:
    """(op, name, shape) of every instruction of the compiled program (its entry and loop bodies; a fusion counts
    once, not its inner ops) with ``s`` in its shape that computes or copies (parameters, tuple plumbing, bitcasts
    and loops only alias their operands)."""
    text = jax.jit(fn, donate_argnums=0).lower(*args).compile().as_text()
    out, fused = [], False
    for line in text.splitlines():
        head = re.match(r"(?:ENTRY )?%(\S+) .*\{$", line)
        if head:
            fused = "computation" in head.group(1)  # the body of a fusion (fused_/wrapped_..._computation)
            continue
        m = None if fused else re.match(r"\s*(?:ROOT )?%(\S+) = \w+\[([\d,]*)\]\S* (\S+?)\(", line)
        if m and m.group(3) not in ("parameter", "get-tuple-element", "tuple", "bitcast", "while"):
            shape = tuple(int(x) for x in m.group(2).split(",") if x)
            if s in shape:
                out.append((m.group(3), m.group(1), shape))
    return out


@pytest.mark.parametrize("prompt", [8194, 40], ids=["chunks", "one-chunk"])
@pytest.mark.parametrize("name", ["h2o", "less"])
def test_step_copies_nothing_and_spans_no_slot_loop(name, prompt):
    """The compiled step (H2O, and LESS around it) has no ``copy`` of a slot-sized buffer, and every instruction
    spanning the ``S`` slots is an in-place update (scatter or dynamic-update-slice) or the step's score scratch
    ``[B, Hkv, G, S]`` being initialised: the loops read cache-sized chunks. With one chunk covering the buffer (a
    short cache; on GPU/TPU every cache) the score update and victim search run once without a loop
    (``attention.chunk_loop``), but the read of K and V stays a loop: straight-line, XLA copies K, V and the
    positions twice each, since the victim's slot, written after the read, depends on it. (A copy of the score
    scratch ``[B, Hkv, G, S]`` is there with one chunk either way.)"""
    cfg = tb.model_cfg(8, 2)
    m = methods.get(name, budget=0.5) if name == "h2o" else methods.get(name, budget=0.5, rank=4, hidden=16)
    st = m.init(cfg, 1, Capacity(prompt, 4), 0, jnp.float32)
    s = (st if name == "h2o" else st.sparse).k.shape[2]
    q = jax.ShapeDtypeStruct((1, 8, tb.D), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, 2, tb.D), jnp.float32)
    pos = jax.ShapeDtypeStruct((1,), jnp.int32)
    found = _spanning(lambda st, q, k, v, p: m.decode(st, 0, q, k, v, p), (st, q, kv, kv, pos), s)
    assert found
    copies = [f for f in found if f[0] == "copy"]
    if prompt < 8194:  # one chunk: no copy of the cache (K, V, positions); the score update spans the slots
        assert not [f for f in copies if f[2] in ((1, 2, s, tb.D), (1, 2, s))], copies
        return
    assert not copies, copies
    scratch = [f for f in found if f[2] == (1, 2, 4, s) and "broadcast" in f[1]]
    other = [f for f in found if f not in scratch and not re.search("scatter|dynamic-update-slice", f[1] + f[0])]
    assert len(scratch) <= 1 and not other, (scratch, other)


@pytest.mark.parametrize("heads_at_once", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_accumulated_attention_is_attention_and_scores(dtype, heads_at_once):
    """The fused prompt pass equals the prefill attention (real rows) and the accumulated scores."""
    from kvjax.model.prefill_attention import prefill_attention

    rng = np.random.default_rng(5)
    lengths = np.array([45, 30, 1])
    q, k, v = (rng.standard_normal((3, h, 45, 8)).astype(np.float32) for h in (4, 2, 2))
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    out, acc = jax.jit(lambda *a: select.accumulated_attention(*a, 16, 4, heads_at_once))(q, k, v, lengths)
    want = prefill_attention(q, k, v, jnp.asarray(lengths), impl="chunked", chunk=16)
    tol = 1e-5 if dtype == "float32" else 3e-2
    assert out.dtype == q.dtype
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(
            np.asarray(out[b, :, :n], np.float32), np.asarray(want[b, :, :n], np.float32), atol=tol, rtol=tol
        )
    np.testing.assert_allclose(
        np.asarray(acc),
        np_accumulated(np.asarray(q, np.float32), np.asarray(k, np.float32), lengths),
        atol=1e-5 if dtype == "float32" else 2e-2,
    )


@pytest.mark.parametrize("name", ["h2o", "less"])
def test_engine_prefill_takes_the_methods_attention(name, monkeypatch):
    """H2O and LESS (policy h2o) declare ``attends_prompt``: the engine's prefill takes the prompt's attention from
    their ``prefill_attend`` (one pass with the scores) instead of ``causal_attention``. The prefill logits equal
    full's (whose attention is ``causal_attention``), and the kept tokens those of the two-pass path."""
    from kvjax import engine, model as M
    from kvjax.config import ModelConfig

    cfg = ModelConfig("llama", 256, 64, 128, 2, 4, 2, 16, max_position_embeddings=512)
    params = M.random_params(cfg, jax.random.PRNGKey(3), scale=0.15)
    rng = np.random.RandomState(1)
    tokens, lengths = engine.pad_prompts([list(rng.randint(1, 255, size=n)) for n in (40, 23)], 48)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    cap = Capacity(48, 2)

    def prefill(m):
        states = engine.init_states(cfg, m, 2, cap, jnp.float32)
        return engine.prefill(cfg, m, params, tokens, lengths, states)

    m = methods.get(name, budget=0.5, **({"hidden": 16} if name == "less" else {}))
    assert m.attends_prompt
    calls = []
    real = M.causal_attention
    jax.clear_caches()  # the engine's compiled prefill is cached per (method, shapes)
    monkeypatch.setattr(M, "causal_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    states, logits = prefill(m)
    assert not calls, "the engine ran causal_attention beside the method's own prompt attention"
    monkeypatch.setattr(M, "causal_attention", real)
    _, want = prefill(methods.get("full"))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(type(m), "attends_prompt", False)
    jax.clear_caches()
    two_pass, _ = prefill(m)
    jax.clear_caches()
    for a, b in zip(jax.tree.leaves(states), jax.tree.leaves(two_pass)):
        if jnp.issubdtype(a.dtype, jnp.integer) or a.dtype == jnp.bool_:  # kept positions, counts: exactly equal
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:  # layer 2's K/V derive from layer 1's attention output: float32 rounding, as the logits above
            np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-5, atol=1e-5)
