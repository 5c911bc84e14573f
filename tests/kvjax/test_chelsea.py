"""Chelsea (kvjax.methods.chelsea / csm) against the independent numpy reference ``ref_chelsea``: one CSM round,
count conservation and cache invariants through prefill and decode, the log-count attention, full-cache
equivalence, outlier heads, schedules, Theorem 6.1 by brute force, calibration, no retracing, bad input."""

import functools
import itertools
import json
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.model import attention
from kvjax import engine, methods
from kvjax.config import ModelConfig
from kvjax.methods.base import Capacity, LayerContext
from kvjax.methods.chelsea import Chelsea
from kernels_pallas.decode_attention import block_plan_bytes
from kvjax.methods.chelsea.csm import csm_round, merges_for, plan

import ref_chelsea as ref
from tiny_models import tiny_config

SMALL = dict(n_sink=2, n_recent=4, chunk=8, interval=4)


# the sizes and seed of the tiny fixture's model (tests/conftest.py)
pytestmark = pytest.mark.tiny(max_position_embeddings=512, seed=0)


def prompts(lengths, seed=0):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(1, 60, size=n)) for n in lengths]


# ---- one CSM round vs the numpy reference -------------------------------------------------------------


@pytest.mark.parametrize("chunk", [4, 8, 64])  # 64 >= the middle: one chunk, i.e. plain bipartite soft matching
def test_csm_round_matches_numpy(chunk):
    rng = np.random.RandomState(chunk)
    b, h, s, d = 2, 3, 40, 8
    lengths = np.array([40, 29])
    merges = np.array([7, 5])
    k = rng.randn(b, h, s, d).astype(np.float32)
    v = rng.randn(b, h, s, d).astype(np.float32)
    n = rng.randint(1, 4, size=(b, h, s)).astype(np.float32)
    n[:, :, :2] = 1
    n *= np.arange(s) < lengths[:, None, None]
    (k2, v2, n2), (src, dst) = csm_round(
        jnp.asarray(k),
        jnp.asarray(v),
        jnp.asarray(n),
        jnp.asarray(lengths),
        jnp.asarray(merges),
        n_sink=2,
        n_recent=3,
        chunk=chunk,
        max_merges=7,
        out_slots=s,
        impl="xla",
        return_matches=True,
    )
    for bi in range(b):
        for hi in range(h):
            L, m = int(lengths[bi]), int(merges[bi])
            pairs, rk, rv, rn = ref.csm_round(k[bi, hi], v[bi, hi], n[bi, hi], L, m, 2, 3, chunk)
            s_, d_ = np.asarray(src[bi, hi]), np.asarray(dst[bi, hi])
            got = sorted((int(a), int(c)) for a, c in zip(s_, d_) if a >= 0)
            assert got == pairs
            for a, c in pairs:  # chunk locality: A at an even, B at an odd offset of the same chunk
                assert (a - 2) // chunk == (c - 2) // chunk and (a - 2) % 2 == 0 and (c - 2) % 2 == 1
            np.testing.assert_allclose(np.asarray(k2[bi, hi, : L - m]), rk, atol=1e-5)
            np.testing.assert_allclose(np.asarray(v2[bi, hi, : L - m]), rv, atol=1e-5)
            np.testing.assert_array_equal(np.asarray(n2[bi, hi, : L - m]), rn)
            assert np.all(np.asarray(n2[bi, hi, L - m :]) == 0)
            assert float(n2[bi, hi].sum()) == float(n[bi, hi].sum())  # sum of counts conserved


def test_csm_round_per_sequence_windows_match_numpy():
    """[B] sinks/recent (Chelsea's shrunk windows for short budgets) against the reference, sequence by sequence;
    an array equal to the static value gives exactly the static result."""
    rng = np.random.RandomState(11)
    b, h, s, d, chunk = 3, 2, 40, 8, 8
    lengths, merges = np.array([40, 29, 17]), np.array([7, 5, 4])
    ns, nr = np.array([2, 0, 1]), np.array([3, 5, 0])
    k = rng.randn(b, h, s, d).astype(np.float32)
    v = rng.randn(b, h, s, d).astype(np.float32)
    n = rng.randint(1, 4, size=(b, h, s)).astype(np.float32) * (np.arange(s) < lengths[:, None, None])
    args = (jnp.asarray(k), jnp.asarray(v), jnp.asarray(n), jnp.asarray(lengths), jnp.asarray(merges))
    (k2, v2, n2), (src, dst) = csm_round(
        *args,
        n_sink=jnp.asarray(ns),
        n_recent=jnp.asarray(nr),
        chunk=chunk,
        max_merges=7,
        out_slots=s,
        impl="xla",
        return_matches=True,
    )
    for bi in range(b):
        for hi in range(h):
            L, m = int(lengths[bi]), int(merges[bi])
            pairs, rk, rv, rn = ref.csm_round(k[bi, hi], v[bi, hi], n[bi, hi], L, m, int(ns[bi]), int(nr[bi]), chunk)
            got = sorted((int(a), int(c)) for a, c in zip(np.asarray(src[bi, hi]), np.asarray(dst[bi, hi])) if a >= 0)
            assert got == pairs
            np.testing.assert_allclose(np.asarray(k2[bi, hi, : L - m]), rk, atol=1e-5)
            np.testing.assert_allclose(np.asarray(v2[bi, hi, : L - m]), rv, atol=1e-5)
            np.testing.assert_array_equal(np.asarray(n2[bi, hi, : L - m]), rn)
            assert np.all(np.asarray(n2[bi, hi, L - m :]) == 0)
    static = csm_round(*args, n_sink=2, n_recent=3, chunk=chunk, max_merges=7, out_slots=s, impl="xla")
    traced = csm_round(
        *args,
        n_sink=jnp.full((b,), 2, jnp.int32),
        n_recent=jnp.full((b,), 3, jnp.int32),
        chunk=chunk,
        max_merges=7,
        out_slots=s,
        impl="xla",
    )
    for x, y in zip(static, traced):  # the same merges; float sums may differ in the last bit (fusion)
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(static[2]), np.asarray(traced[2]))


def test_equal_key_merge_is_exact_only_with_log_counts():
    """Eq. (2), the mechanism: merging clusters of identical keys (any values) with ``csm_round`` reproduces full
    attention with + log N through ``attention.attend`` (the bias built here; the method's own decode step is
    checked by the next test and by :func:`test_decode_outputs_match_reference`)."""
    rng = np.random.RandomState(1)
    s, d, n_sink, n_recent, chunk = 36, 16, 2, 2, 8
    k = rng.randn(s, d).astype(np.float32)
    for a in range(n_sink, s - n_recent, 2):  # every A token equals its right B neighbour
        k[a] = k[a + 1]
    v = rng.randn(s, d).astype(np.float32)
    q = rng.randn(4, d).astype(np.float32)  # 4 query heads sharing the KV head (GQA)
    m = (s - n_sink - n_recent) // 2
    kk, vv, nn = csm_round(
        jnp.asarray(k)[None, None],
        jnp.asarray(v)[None, None],
        jnp.ones((1, 1, s)),
        jnp.asarray([s]),
        jnp.asarray([m]),
        n_sink=n_sink,
        n_recent=n_recent,
        chunk=chunk,
        max_merges=m,
        out_slots=s - m,
        impl="xla",
    )
    assert float(nn.max()) == 2.0 and float(nn.sum()) == s
    valid = nn > 0
    with_bias = attention.normalise(attention.attend(jnp.asarray(q)[None], kk, vv, valid, bias=jnp.log(nn)))
    without = attention.normalise(attention.attend(jnp.asarray(q)[None], kk, vv, valid))
    for g in range(4):
        full = ref.attention_with_counts(q[g], k, v, np.ones(s), use_log_counts=False)
        np.testing.assert_allclose(np.asarray(with_bias[0, g]), full, atol=1e-5)
        assert np.abs(np.asarray(without[0, g]) - full).max() > 1e-3


def test_equal_key_merge_through_decode_equals_full_attention(tiny):
    """Eq. (2) through the method, not the mechanism: a prompt whose every A token has the key of its B neighbour
    is merged by Chelsea's prefill (one round, pairs of identical keys, counts 2); the next decode step's output
    (``Chelsea.decode``: its own ``log N`` bias) equals full softmax attention over all the prompt's tokens and
    the new one (numpy), for each of the group's query heads. Without the bias it does not."""
    cfg = tiny.config
    n, d, hq, hkv = 40, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    rng = np.random.default_rng(5)
    k = rng.standard_normal((1, hkv, n, d)).astype(np.float32)
    for a in range(2, n - 4, 2):  # n_sink=2, n_recent=4, chunk 8: A tokens at even slots of the middle
        k[:, :, a] = k[:, :, a + 1]
    v = rng.standard_normal((1, hkv, n, d)).astype(np.float32)
    q = rng.standard_normal((1, hq, n, d)).astype(np.float32)
    method = Chelsea(budget=30, **SMALL)  # B = 30, trigger 34 <= 40: one round of 10 merges (<= 0.35 x 34)
    st = method.init(cfg, 1, Capacity(n, 8), 0, jnp.float32)
    st = method.prefill(st, 0, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray([n]))
    assert int(st.length[0]) == 30 and float(st.n.max()) == 2.0 and float(st.n.sum()) == hkv * n
    qn, kn, vn = (rng.standard_normal((1, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
    out, _ = method.decode(st, 0, jnp.asarray(qn), jnp.asarray(kn), jnp.asarray(vn), jnp.asarray([n]))
    g = hq // hkv
    for qh in range(hq):
        h = qh // g
        keys, vals = np.concatenate([k[0, h], kn[0, h][None]]), np.concatenate([v[0, h], vn[0, h][None]])
        full = ref.attention_with_counts(qn[0, qh], keys, vals, np.ones(n + 1), use_log_counts=False)
        np.testing.assert_allclose(np.asarray(out)[0, qh], full, atol=1e-5)


# ---- the decode step's attention output against the numpy reference ------------------------------------


@pytest.mark.parametrize("outliers", [(), ((0, 1),)], ids=["compressed", "outlier-head"])
def test_decode_outputs_match_reference(tiny, outliers):
    """Prefill then 18 decode steps of one layer (GQA: 4 query heads on 2 KV heads), three sequences: two merged in
    prefill (slots with counts > 1), one that first compresses during decode; every sequence runs several
    re-compression rounds. Each step's attention output equals the numpy reference's (Eq. 2: ``softmax(q K^T /
    sqrt(d) + log N) V`` over the merged slots), so a lost ``log N`` bias, a wrong count or merge, an
    off-by-one trigger or window fails here."""
    cfg = tiny.config
    t, gamma, steps, hq, hkv, d = 48, 20, 18, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    method = Chelsea(budget=0.3, outlier_heads=outliers, reallocate=False, **SMALL)
    lengths = np.array([40, 23, 10])  # B_b = 18, 12, 9: triggers 22, 16 (merged in prefill), 13 (in decode)
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((3, h, t, d)).astype(np.float32) for h in (hq, hkv, hkv))
    st = method.init(cfg, 3, Capacity(t, gamma), 0, jnp.float32)
    st = jax.jit(lambda st, q, k, v, n: method.prefill(st, 0, q, k, v, n))(st, q, k, v, jnp.asarray(lengths))
    outl = [h for (l_, h) in outliers if l_ == 0]
    seqs = [ref.Sequence(k[b, :, :n], v[b, :, :n], 0.3, gamma, 2, 4, 8, 4, outl) for b, n in enumerate(lengths)]
    assert [s.B for s in seqs] == [18, 12, 9]
    assert np.asarray(st.n).max() > 1  # merged slots in prefill
    decode = jax.jit(lambda st, q, k, v, p: method.decode(st, 0, q, k, v, p))
    pos, merges = lengths.copy(), 0
    for _ in range(steps):
        qn, kn, vn = (rng.standard_normal((3, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
        before = np.asarray(st.length)
        out, st = decode(st, *(jnp.asarray(x) for x in (qn, kn, vn, pos)))
        merges += int(np.sum(np.asarray(st.length) < before + 1))
        for b, seq in enumerate(seqs):
            np.testing.assert_allclose(np.asarray(out)[b], seq.step(qn[b], kn[b], vn[b]), atol=2e-5, rtol=1e-4)
        for b, seq in enumerate(seqs):  # the held slots and their counts too
            for ci, h in enumerate(st.comp_heads):
                length = int(np.asarray(st.length)[b])
                np.testing.assert_allclose(np.asarray(st.n)[b, ci, :length], seq.heads[h][2])
                np.testing.assert_allclose(np.asarray(st.k)[b, ci, :length], seq.heads[h][0], atol=1e-5)
        pos = pos + 1
    assert merges >= 10  # re-compression rounds in decode, in every sequence


# ---- through the engine ----------------------------------------------------------------------------------


def test_budget_covering_everything_reproduces_full(tiny):
    ps = prompts([60, 45, 12])
    full = engine.generate(tiny, ps, "full", max_new_tokens=24, stop_at_eos=False, prompt_len=64)
    for budget in (1.0, 64 + 24):
        ch = engine.generate(
            tiny,
            ps,
            methods.get("chelsea", budget=budget, **SMALL),
            max_new_tokens=24,
            stop_at_eos=False,
            prompt_len=64,
        )
        assert ch.tokens == full.tokens


def test_prefill_and_decode_invariants_no_retrace(tiny):
    """Per-sequence budgets B_b = floor(R (n_b + Gamma)) (was: one B from the bucket): compression to exactly B_b
    at B_b + g, counts conserved, sinks/recent kept, and no retrace through re-compression."""
    cfg, params = tiny.config, tiny.params
    method = methods.get("chelsea", budget=0.3, **SMALL)
    cap = Capacity(64, 40)
    b_max, slots, pre, dec, per_seq = method.sizes(cfg, cap)
    assert (b_max, slots, per_seq) == (31, 35, False) and len(pre) >= 3 and len(dec) >= 1
    ps = prompts([64, 50, 20])
    lengths = np.array([len(p) for p in ps])
    b_tok = (3 * (lengths + 40)) // 10  # [31, 27, 18]
    trigger = b_tok + 4
    tokens = np.zeros((3, 64), np.int32)
    for i, p in enumerate(ps):
        tokens[i, : len(p)] = p
    states = engine.init_states(cfg, method, 3, cap, jnp.float32)
    states, logits = engine.prefill(cfg, method, params, jnp.asarray(tokens), jnp.asarray(lengths), states)
    np.testing.assert_array_equal(np.asarray(states[0].target), b_tok)
    seen = lengths.copy()
    before = engine.TRACE_COUNTS["decode_step"]
    compressed_in_decode = 0
    for step in range(40):
        for st in states:
            n, length = np.asarray(st.n), np.asarray(st.length)
            for bi in range(3):
                L = length[bi]
                assert L <= trigger[bi] - 1 or (step == 0 and seen[bi] < trigger[bi])
                assert np.all(n[bi, :, :L] >= 1) and np.all(n[bi, :, L:] == 0)
                np.testing.assert_array_equal(n[bi].sum(-1), seen[bi])  # token conservation per head
                np.testing.assert_array_equal(n[bi, :, :2], 1)  # sinks
                np.testing.assert_array_equal(n[bi, :, L - 4 : L], 1)  # recent window
            assert np.all(np.isfinite(np.asarray(st.k)))
        if step == 0:  # after prefill: compressed to exactly B_b when n >= B_b + g, else untouched
            np.testing.assert_array_equal(np.asarray(states[0].length), np.where(lengths >= trigger, b_tok, lengths))
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)
        prev = np.asarray(states[0].length).copy()
        logits, states = engine.decode_step(cfg, method, params, states, nxt, jnp.array(seen, copy=True))
        seen = seen + 1  # never mutate a buffer jnp may alias (see _run_and_check)
        now = np.asarray(states[0].length)
        compressed_in_decode += int(np.any(now < prev))
        np.testing.assert_array_equal(now, np.where(prev + 1 >= trigger, b_tok, prev + 1))
        for bi in range(3):
            assert method.held(int(lengths[bi]), step + 1, LayerContext(capacity=cap)) == now[bi]
    assert compressed_in_decode >= 5
    assert engine.TRACE_COUNTS["decode_step"] - before == 1


def test_generate_compiles_once_per_bucket(tiny):
    method = methods.get("chelsea", budget=0.3, **SMALL)
    start = dict(engine.TRACE_COUNTS)
    for seed in range(2):
        engine.generate(
            tiny, prompts([50, 33], seed), method, max_new_tokens=20, stop_at_eos=False, prompt_len=64, driver="scan"
        )
    assert engine.TRACE_COUNTS["loop_scan"] - start.get("loop_scan", 0) == 1
    assert engine.TRACE_COUNTS["prefill"] - start.get("prefill", 0) == 1


def test_outlier_heads_keep_full_cache(tiny):
    cfg = tiny.config
    ps = prompts([60, 41])
    full = engine.generate(tiny, ps, "full", max_new_tokens=20, stop_at_eos=False, prompt_len=64)
    every = tuple((l, h) for l in range(2) for h in range(2))
    all_out = methods.get("chelsea", budget=0.3, outlier_heads=every, reallocate=False, **SMALL)
    assert engine.generate(tiny, ps, all_out, max_new_tokens=20, stop_at_eos=False, prompt_len=64).tokens == full.tokens
    # One outlier head: its buffer equals the full cache, the others are compressed; memory is honest.
    one = methods.get("chelsea", budget=0.3, outlier_heads=((0, 1),), reallocate=False, **SMALL)
    none = methods.get("chelsea", budget=0.3, **SMALL)
    cap = Capacity(64, 20)
    tokens = np.zeros((2, 64), np.int32)
    for i, p in enumerate(ps):
        tokens[i, : len(p)] = p
    lens = jnp.asarray([len(p) for p in ps])
    got = {}
    for name, m in (("full", methods.get("full")), ("one", one), ("none", none)):
        st = engine.init_states(cfg, m, 2, cap, jnp.float32)
        got[name], _ = engine.prefill(cfg, m, tiny.params, jnp.asarray(tokens), lens, st)
    s1 = got["one"][0]
    assert s1.k.shape[1] == 1 and s1.ko.shape[1] == 1 and got["one"][1].ko.shape[1] == 0
    for i, p in enumerate(ps):
        np.testing.assert_array_equal(np.asarray(s1.ko[i, 0, : len(p)]), np.asarray(got["full"][0].k[i, 1, : len(p)]))
    np.testing.assert_array_equal(np.asarray(s1.k[:, 0]), np.asarray(got["none"][0].k[:, 0]))
    f = cap.prompt_len + cap.max_new_tokens
    assert one.memory_bytes(s1) - none.memory_bytes(got["none"][0]) == 2 * 2 * f * 16 * 4 - 2 * (
        2 * s1.k.shape[2] * 16 * 4 + s1.k.shape[2] * 4
    )


def test_budget_reallocation_for_outliers(tiny):
    cfg = tiny.config
    cap = Capacity(1000, 0 + 24)
    m = Chelsea(budget=0.2, outlier_heads=((0, 1),), **SMALL)
    # (0.2 * 4 - 1) / 3 < 0: four heads cannot pay for one full head at 20%.
    with pytest.raises(ValueError, match="outlier"):
        m.budget_tokens(cfg, cap)
    m = Chelsea(budget=0.4, outlier_heads=((0, 1),), **SMALL)
    assert m.budget_tokens(cfg, cap) == int((0.4 * 4 - 1) / 3 * 1024)
    assert m.rule(cfg) == ("frac", 1, 5)  # (0.4 * 4 - 1) / 3 = 1/5 exactly
    # R_c with a denominator <= 10000 is exact (3 outliers of 4 heads: R_c = 4 R - 3 = 623/2500) ...
    m3 = Chelsea(budget=0.8123, outlier_heads=((0, 0), (0, 1), (1, 0)), **SMALL)
    exact = (Fraction(8123, 10000) * 4 - 3) / 1
    assert m3.rule(cfg) == ("frac", exact.numerator, exact.denominator)
    big = ModelConfig(
        model_type="llama",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_layers=7,
        num_heads=4,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=512,
        sliding_windows=(None,) * 7,
    )
    # ... beyond 10000 it is rounded down to the 1/10000 grid (int32-safe, still a ceiling)
    m7 = Chelsea(budget=0.8123, outlier_heads=((0, 0),), **SMALL)
    rc = (Fraction(8123, 10000) * 7 - 1) / 6  # denominator 60000 > 10000
    _, p, q = m7.rule(big)
    assert 10000 % q == 0 and Fraction(p, q) <= rc < Fraction(p, q) + Fraction(1, 10000)
    for n in (1, 37, 1000, 12345):
        assert m7.budget_tokens(big, Capacity(n, 24)) == math.floor(Fraction(p, q) * (n + 24)) <= rc * (n + 24)


# ---- schedule -------------------------------------------------------------------------------------------


def test_schedule_matches_paper_example():
    """Spec §2.4: Llama-2 schedule at n = 16384, B = 2752: 16384 -> 9048 -> 5461 -> 3578 -> 2752."""
    m = Chelsea(schedule="llama2")
    rounds = plan(16384, 2752, 16, 64, m.ratio, floor_slots=0)
    assert [r.out_slots for r in rounds] == [9048, 5461, 3578, 2752]
    assert [m.ratio(i) for i in range(5)] == pytest.approx([0.45, 0.40, 0.35, 0.30, 0.30])
    assert [Chelsea(schedule="qwen2").ratio(i) for i in range(4)] == pytest.approx([0.2, 0.1, 0.05, 0.05])
    # a decode call merges exactly g in one round
    assert [r.max_merges for r in plan(2752 + 64, 2752, 16, 64, m.ratio, 0)] == [64]
    for s in (100, 1000, 2817):  # traced and host merge counts agree
        assert int(merges_for(jnp.asarray(s), 90, 16, 64, 3500)) == merges_for(s, 90, 16, 64, 3500)


# ---- Theorem 6.1 ----------------------------------------------------------------------------------------


def c_closed(two_n, l):
    n = two_n // 2
    if l % 2 == 0:
        return -(l**3) / 12 + (2 * n - 1) * l**2 / 4 + (6 * n - 1) * l / 6
    return -(l**3) / 12 + (2 * n - 1) * l**2 / 4 + (12 * n - 5) * l / 12 + (2 * n - 1) / 4


def test_theorem_6_1_brute_force():
    rng = np.random.RandomState(0)
    for two_n in range(2, 13, 2):
        n = two_n // 2
        alternating = list(range(1, two_n + 1, 2))
        parts = list(itertools.combinations(range(1, two_n + 1), n))
        for _ in range(20):
            # convex non-increasing f on 1..2n-1: non-increasing, non-negative decrements a_i, then cumulate
            dec = np.sort(rng.rand(max(two_n - 2, 0)))[::-1]
            f = np.concatenate([[0.0], -np.cumsum(dec)]) + rng.randn()
            best = max(ref.partition_objective(set(a), f) for a in parts)
            assert ref.partition_objective(set(alternating), f) >= best - 1e-9
        for l in range(1, two_n):  # closed form of eq. (9)/(14)
            direct = sum((two_n - 2 * i + 1) * (l - 2 * i + 2) for i in range(1, (l + 1) // 2 + 1))
            assert c_closed(two_n, l) == pytest.approx(direct)
    # and a concave f breaks it (the hypothesis matters): f = [1, 1, 0] on 2n = 4 prefers {1,2},{3,4}? check
    f = np.array([1.0, 1.0, 0.0])
    vals = {a: ref.partition_objective(set(a), f) for a in itertools.combinations(range(1, 5), 2)}
    assert max(vals.values()) >= vals[(1, 3)]


# ---- calibration ----------------------------------------------------------------------------------------


def test_calibration_ranks_random_heads_as_outliers(tmp_path, tiny):
    from kvjax import calibrate_chelsea as cal

    rng = np.random.RandomState(0)
    t, d = 96, 16
    drift = np.cumsum(rng.randn(t, d) * 0.05, axis=0) + rng.randn(d)  # slowly drifting keys: high cosine
    noise = rng.randn(t, d)  # i.i.d. keys: low cosine
    keys = jnp.asarray(np.stack([drift, noise, drift * 2])[None], jnp.float32)  # [1, 3, T, D]
    frac = np.asarray(cal.no_edge_fraction(keys, jnp.asarray([t]), n_sink=2, n_recent=4, chunk=8, threshold=0.8))
    assert frac.shape == (1, 3) and frac[0, 1] > 0.9 and frac[0, 0] < 0.1 and frac[0, 2] < 0.1
    # end to end on the tiny model with token ids; deterministic; the method loads the JSON
    out = tmp_path / "outliers.json"
    toks = np.random.RandomState(1).randint(1, 60, size=200)
    r1 = cal.calibrate(tiny, out, token_ids=toks, window=64, windows=2, ratio=0.25, n_sink=2, n_recent=4, chunk=8)
    r2 = cal.calibrate(
        tiny, tmp_path / "again.json", token_ids=toks, window=64, windows=2, ratio=0.25, n_sink=2, n_recent=4, chunk=8
    )
    assert r1["outlier_heads"] == r2["outlier_heads"] and len(r1["outlier_heads"]) == 1
    data = json.loads(out.read_text())
    assert data["num_layers"] == 2 and data["num_kv_heads"] == 2
    m = methods.get("chelsea", budget=0.5, outlier_heads=str(out), **SMALL)
    assert m.outliers(tiny.config) == frozenset(tuple(x) for x in data["outlier_heads"])
    engine.generate(tiny, prompts([50]), m, max_new_tokens=8, prompt_len=64)


def test_outlier_file_edited_in_place_is_read_again(tiny, tmp_path):
    """The outlier JSON is cached by content, not by path: rewriting it (same size, same second) changes the
    heads a fresh or the same config uses, and the states it builds."""
    path = tmp_path / "heads.json"
    write = lambda pairs: path.write_text(json.dumps({"outlier_heads": pairs, "num_layers": 2, "num_kv_heads": 2}))
    write([[0, 1]])
    m = Chelsea(budget=0.5, outlier_heads=str(path), **SMALL)
    assert m.outliers(tiny.config) == {(0, 1)}
    assert m.init(tiny.config, 1, Capacity(64, 8), 0, jnp.float32).out_heads == (1,)
    write([[1, 0]])  # same length: a (path, mtime, size) key written within one clock tick could miss it
    assert m.outliers(tiny.config) == {(1, 0)}
    assert Chelsea(budget=0.5, outlier_heads=str(path), **SMALL).outliers(tiny.config) == {(1, 0)}
    assert m.init(tiny.config, 1, Capacity(64, 8), 0, jnp.float32).out_heads == ()
    assert m.init(tiny.config, 1, Capacity(64, 8), 1, jnp.float32).out_heads == (0,)
    path.write_text(json.dumps({"heads": []}))
    with pytest.raises(ValueError, match="not a calibration file"):
        m.outliers(tiny.config)


# ---- bad input ------------------------------------------------------------------------------------------


def test_bad_input(tiny):
    with pytest.raises(ValueError, match="chunk=7"):
        Chelsea(chunk=7)
    with pytest.raises(ValueError, match="chunk=0"):
        Chelsea(chunk=0)
    with pytest.raises(ValueError, match="r_init=0.6"):
        Chelsea(schedule=(0.6, 0.1, 2))
    with pytest.raises(ValueError, match="r_init=0.0"):
        Chelsea(schedule=(0.0, 0.1, 2))
    with pytest.raises(ValueError, match="r_floor=0"):
        Chelsea(r_floor=0.0)
    with pytest.raises(ValueError, match="schedule='gpt'"):
        Chelsea(schedule="gpt")
    with pytest.raises(ValueError, match="budget=1.5"):
        Chelsea(budget=1.5)
    engine.generate(tiny, prompts([60]), Chelsea(budget=0.05, **SMALL), max_new_tokens=8, prompt_len=64)  # no error
    with pytest.raises(FileNotFoundError, match="calibrate-chelsea"):
        Chelsea(outlier_heads="/nonexistent.json").outliers(tiny.config)
    with pytest.raises(ValueError, match="outside the model"):
        Chelsea(outlier_heads=((5, 0),)).outliers(tiny.config)
    with pytest.raises(ValueError, match="impl"):
        Chelsea(impl="cuda")


def test_cli_has_calibrate_subcommand():
    from kvjax import cli

    args = cli.build_parser().parse_args(
        ["calibrate-chelsea", "--text", "t.txt", "--out", "o.json", "--keep-layers", "0", "--windows", "4"]
    )
    assert args.func is cli.cmd_calibrate_chelsea and args.windows == 4 and args.keep_layers == "0"


def test_slots_are_means_of_their_members_after_many_rounds():
    """Spec §8.8.6: after several rounds every slot's key is the plain mean of the original keys it holds and
    its count is their number; surviving slots keep the original order. Membership is tracked by values that
    are one-hot token ids (the merged value is the member indicator divided by the count)."""
    rng = np.random.RandomState(5)
    s, d = 48, 8
    k = rng.randn(s, d).astype(np.float32)
    v = np.eye(s, dtype=np.float32)
    kk, vv, nn = jnp.asarray(k)[None, None], jnp.asarray(v)[None, None], jnp.ones((1, 1, s))
    length = s
    step = jax.jit(
        lambda k, v, n, length, m: csm_round(
            k, v, n, length, m, n_sink=2, n_recent=3, chunk=8, max_merges=10, out_slots=s, impl="xla"
        )
    )
    for m in (10, 8, 6, 4, 3):  # one compile: m is dynamic, the first m of the top-10 are merged
        kk, vv, nn = step(kk, vv, nn, jnp.asarray([length]), jnp.asarray([m]))
        length -= m
    kk, vv, nn = (np.asarray(x[0, 0]) for x in (kk, vv, nn))
    for slot in range(length):
        members = np.nonzero(vv[slot] > 1e-6)[0]
        assert len(members) == nn[slot]
        np.testing.assert_allclose(vv[slot][members], 1.0 / nn[slot], rtol=1e-5)
        np.testing.assert_allclose(kk[slot], k[members].mean(0), atol=1e-5)
    assert sorted(set(np.nonzero(vv[:length].sum(0))[0])) == list(range(s))  # every token is somewhere
    assert np.all(nn[length:] == 0) and nn[:length].sum() == s
    order = [np.nonzero(vv[slot] > 1e-6)[0].min() for slot in range(length)]
    assert order[:2] == [0, 1] and order[-3:] == [s - 3, s - 2, s - 1]  # sinks first, recent last


def test_scanned_rounds_equal_unrolled_rounds(tiny):
    """The prefill rounds as one lax.scan at full size give exactly the unrolled, shrinking-size rounds."""
    cfg = tiny.config
    ps = prompts([64, 47, 38], seed=3)
    tokens = np.zeros((3, 64), np.int32)
    for i, p in enumerate(ps):
        tokens[i, : len(p)] = p
    got = []
    for unroll in (False, True):
        m = methods.get("chelsea", budget=0.3, unroll_rounds=unroll, **SMALL)
        st = engine.init_states(cfg, m, 3, Capacity(64, 24), jnp.float32)
        got.append(engine.prefill(cfg, m, tiny.params, jnp.asarray(tokens), jnp.asarray([64, 47, 38]), st)[0])
    assert len(got[0][0].prefill_rounds) >= 3
    for a, b in zip(*got):
        for x, y in ((a.k, b.k), (a.v, b.v), (a.n, b.n), (a.length, b.length)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)


# ---- per-sequence budgets (budget contract, kvjax.budget) --------------------------------------------------


def _batch(ps, bucket):
    tokens = np.zeros((len(ps), bucket), np.int32)
    for i, p in enumerate(ps):
        tokens[i, : len(p)] = p
    return jnp.asarray(tokens), jnp.asarray([len(p) for p in ps], jnp.int32)


@pytest.mark.slow  # test_budget_contract runs the same-prompts-any-bucket check for chelsea by default
def test_bucket_invariance(tiny):
    """The same prompts (40, 70, 120 tokens) in buckets 128, 256, 512 keep the same merged slots (values up to
    float rounding) and identical counts, and give identical greedy output: B_b comes from each sequence's own n,
    never from the bucket."""
    cfg = tiny.config
    ps = prompts([40, 70, 120], seed=7)
    method = methods.get("chelsea", budget=0.25, **SMALL)
    got, toks = [], []
    for bucket in (128, 256, 512):
        tokens, lens = _batch(ps, bucket)
        st = engine.init_states(cfg, method, 3, Capacity(bucket, 16), jnp.float32)
        got.append(engine.prefill(cfg, method, tiny.params, tokens, lens, st)[0])
        toks.append(
            engine.generate(
                tiny, ps, method, max_new_tokens=16, stop_at_eos=False, prompt_len=bucket, driver="scan"
            ).tokens
        )
    want = [(n + 16) // 4 for n in (40, 70, 120)]
    for layers in got:
        for a, b in zip(got[0], layers):
            np.testing.assert_array_equal(np.asarray(b.length), want)  # all three compress in prefill
            np.testing.assert_array_equal(np.asarray(b.target), want)
            for i, L in enumerate(want):
                np.testing.assert_array_equal(np.asarray(a.n[i, :, :L]), np.asarray(b.n[i, :, :L]))
                # the merged values up to float rounding: the model's position-wise matmuls run in blocks of
                # the bucket's live tokens, whose size changes the summation order (the counts are exact)
                np.testing.assert_allclose(np.asarray(a.k[i, :, :L]), np.asarray(b.k[i, :, :L]), rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(np.asarray(a.v[i, :, :L]), np.asarray(b.v[i, :, :L]), rtol=1e-5, atol=1e-5)
                assert np.all(np.asarray(b.n[i, :, L:]) == 0)
    assert toks[0] == toks[1] == toks[2]


def test_per_sequence_budget_is_exact():
    """B_b = floor(R (n_b + Gamma)) with R the decimal as written (Fraction), on ints, numpy and int32 arrays."""
    cfg = tiny_config(max_position_embeddings=512)
    n = np.array([1, 5, 40, 70, 99, 100, 130, 1000, 4099, 32767, 100_000, 2_000_000])
    for budget in (0.1, 0.2, 0.25, 0.3, 0.7, 0.123, 0.33333, 1.0):
        m = Chelsea(budget=budget, **SMALL)
        rule = m.rule(cfg)
        for gamma in (0, 16, 1000):
            want = [
                max(
                    math.floor(Fraction(str(budget)) * (int(x) + gamma))
                    if budget != 0.33333
                    else math.floor(Fraction(3333, 10000) * (int(x) + gamma)),
                    1,
                )
                for x in n
            ]
            assert [m.target(rule, int(x), gamma) for x in n] == want
            assert m.target(rule, n, gamma).tolist() == want
            assert np.asarray(m.target(rule, jnp.asarray(n, jnp.int32), gamma)).tolist() == want


def _run_and_check(tiny, method, ps, bucket, gamma, outliers=False):
    """Prefill + decode step by step: tokens held never exceed B_b + g - 1 after a step and equal B_b right after a
    Chelsea call; held() predicts them; bytes_read_per_step is the block plan of the live slots."""
    cfg = tiny.config
    tokens, lens = _batch(ps, bucket)
    lengths = np.asarray(lens)
    g = method.interval
    st = engine.init_states(cfg, method, len(ps), Capacity(bucket, gamma), jnp.float32)
    states, logits = engine.prefill(cfg, method, tiny.params, tokens, lens, st)
    b_tok = np.asarray(states[0].target)
    seen = lengths.copy()
    calls = np.zeros(len(ps), int)
    for step in range(gamma - 1):
        for s in states:
            held = np.asarray(method.tokens_held(s))
            comp = np.asarray(jnp.sum(s.n > 0, axis=-1))  # [B, Hc]
            for i in range(len(ps)):
                assert np.all(comp[i] == s.length[i])
                if seen[i] >= b_tok[i] + g or step > 0 and comp[i, 0] < min(seen[i], b_tok[i] + g):
                    assert comp[i, 0] <= b_tok[i] + g - 1
                if not outliers:
                    ctx = LayerContext(capacity=Capacity(bucket, gamma))
                    assert held[i] == comp[i, 0] == method.held(int(lengths[i]), step, ctx)
                    assert held[i] <= max(b_tok[i] + g - 1, seen[i] if seen[i] < b_tok[i] + g else 0)
            hc, ho = s.k.shape[1], s.ko.shape[1]
            gq = cfg.num_heads // cfg.num_kv_heads
            want = block_plan_bytes(s.k, s.length, num_heads=hc * gq, with_mask=True) if hc else 0
            if ho:
                want += block_plan_bytes(s.ko, s.seen, num_heads=ho * gq, with_mask=True)
                np.testing.assert_array_equal(np.asarray(s.seen), seen)
            assert method.bytes_read_per_step(s, cfg.num_heads) == want
        if step == 0:  # a prefill Chelsea call lands exactly on B_b
            hit = lengths >= b_tok + g
            np.testing.assert_array_equal(np.asarray(states[0].length)[hit], b_tok[hit])
        prev = np.asarray(states[0].length).copy()
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)
        # a copy: jnp.asarray may alias the numpy buffer on CPU, and an in-place ``seen += 1`` would then race
        # with the asynchronously dispatched step (seen as pos + 1 under load)
        logits, states = engine.decode_step(cfg, method, tiny.params, states, nxt, jnp.array(seen, copy=True))
        seen = seen + 1
        now = np.asarray(states[0].length)
        called = prev + 1 >= b_tok + g
        calls += called
        np.testing.assert_array_equal(now[called], b_tok[called])  # right after a decode call: exactly B_b
        assert np.all(now <= b_tok + g - 1)
    return states, b_tok, calls


def test_tokens_held_and_bytes_read(tiny):
    method = methods.get("chelsea", budget=0.25, **SMALL)
    ps = prompts([40, 70, 120], seed=2)
    _, b_tok, calls = _run_and_check(tiny, method, ps, 128, 16)
    np.testing.assert_array_equal(b_tok, [(n + 16) // 4 for n in (40, 70, 120)])
    assert np.all(calls >= 3)


@pytest.mark.extended  # CI's second line (.ci/run); test_outlier_heads_keep_full_cache in the default run
def test_tokens_held_and_bytes_read_with_an_outlier_head(tiny):
    ps = prompts([40, 70, 120], seed=2)
    one = methods.get("chelsea", budget=0.25, outlier_heads=((0, 1),), reallocate=False, **SMALL)
    states, _, _ = _run_and_check(tiny, one, ps, 128, 12, outliers=True)
    s0 = states[0]  # layer 0: one compressed + one outlier head; tokens_held is their mean
    np.testing.assert_allclose(np.asarray(one.tokens_held(s0)), (np.asarray(s0.length) + np.asarray(s0.seen)) / 2)
    ctx = functools.partial(LayerContext, capacity=Capacity(40, 12), model_cfg=tiny.config)
    assert one.held(40, 11, ctx(layer=0)) == (one.held(40, 11, ctx(layer=1)) + 40 + 11) // 2


def test_short_prompts_with_default_windows(tiny):
    """A 100-token prompt at budget 0.25 (B = 31 <= n_sink + n_recent = 80) and a 5-token one work with the
    default n_sink=16/n_recent=64: the windows shrink (recent first) and the budget stays a ceiling."""
    method = methods.get("chelsea", budget=0.25, interval=8)
    ps = prompts([100, 5], seed=4)
    states, b_tok, calls = _run_and_check(tiny, method, ps, 128, 24)
    np.testing.assert_array_equal(b_tok, [31, 7])
    assert calls[1] >= 1  # the 5-token prompt reaches its trigger 15 during decode and is compressed to 7
    assert method.windows(31) == (0, 30) and method.windows(7) == (0, 6) and method.windows(100) == (16, 64)
    for s in states:
        n = np.asarray(s.n)
        for i, L in enumerate(np.asarray(s.length)):  # the recent window (n_recent_b = B_b - 1) stays unmerged
            assert np.all(n[i, :, L - min(L, b_tok[i] - 1) : L] == 1) or L < b_tok[i]
    engine.generate(tiny, ps, methods.get("chelsea", budget=0.25), max_new_tokens=8, prompt_len=128)


@pytest.mark.slow
def test_scanned_rounds_equal_unrolled_rounds_short_prompts(tiny):
    """The while_loop and the static worst-case plan agree with per-sequence (shrunk) windows too."""
    cfg = tiny.config
    ps = prompts([100, 61, 23], seed=9)
    tokens, lens = _batch(ps, 128)
    got = []
    for unroll in (False, True):
        m = methods.get("chelsea", budget=0.3, n_sink=4, n_recent=32, chunk=16, interval=8, unroll_rounds=unroll)
        st = engine.init_states(cfg, m, 3, Capacity(128, 8), jnp.float32)
        assert st[0].per_seq_windows
        got.append(engine.prefill(cfg, m, tiny.params, tokens, lens, st)[0])
    np.testing.assert_array_equal(np.asarray(got[0][0].length), [(n + 8) * 3 // 10 for n in (100, 61, 23)])  # 32 20 9
    for a, b in zip(*got):
        for x, y in ((a.k, b.k), (a.v, b.v), (a.n, b.n), (a.length, b.length)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)


# ---- the compiled decode step: in place -------------------------------------------------------------------


def _cache_copies(hlo: str, shapes) -> dict[str, list[str]]:
    """Per computation of a compiled program (name -> lines), the instructions that copy a buffer of one of
    ``shapes`` (e.g. ``"f32[2,2,35,16]"``), and whether the computation is a CSM round (it holds the top-k)."""
    out, name, lines = {}, None, []
    for line in hlo.splitlines():
        if line.startswith(("%", "ENTRY")):
            name, lines = line.split(" ", 2)[1 if line.startswith("ENTRY") else 0], []
        elif line.startswith("}") and name:
            copies = [
                l.strip()[:160]
                for l in lines
                if " copy(" in l and any(s in l.split("=", 1)[1].split("copy(")[0] for s in shapes)
            ]
            if copies:
                out[name] = (copies, any("TopK" in l or " sort(" in l for l in lines))
            name = None
        else:
            lines.append(line)
    return out


def test_decode_updates_the_cache_in_place(tiny):
    """The compiled decode step never copies a cache buffer (k, v ``[B, Hc, S, D]``, counts ``[B, Hc, S]``) on a
    plain step: no ``lax.cond`` whose identity branch copies its operands, no copy to order the attention's reads
    before the compression's in-place writes. The only such copy allowed is inside a CSM round's loop body (the
    compaction gathers out of place: a round writes its result once, into a fresh buffer or the carry), which
    runs on a compressing step only."""
    import kvjax

    cfg = tiny.config
    method = methods.get("chelsea", budget=0.3, **SMALL)
    cap = Capacity(64, 40)
    states = engine.init_states(cfg, method, 2, cap, jnp.float32)
    st = states[0]
    assert st.decode_rounds  # the step can compress
    b, hc, s, d = st.k.shape
    shapes = (f"f32[{b},{hc},{s},{d}]", f"f32[{b},{hc},{s}]")
    loop = engine.DecodeLoop(cfg, method, kvjax.engine.sampling.Greedy(), 16, (95,))
    args = (tiny.params, states, jnp.zeros((2,), jnp.int32), jnp.asarray([50, 64]), jax.random.PRNGKey(0))
    hlo = engine.run_loop.lower(loop, "while", *args).compile().as_text()
    assert hlo.count(shapes[0]) > 0 and ("TopK" in hlo or " sort(" in hlo)  # the rounds are in the program
    outside = {k: c for k, (c, in_round) in _cache_copies(hlo, shapes).items() if not in_round}
    assert outside == {}
    # the method's own step, jitted with the state donated (what benchmarks/roofline.py times)
    q, k = jnp.zeros((b, cfg.num_heads, d)), jnp.zeros((b, cfg.num_kv_heads, d))
    step = jax.jit(lambda st, q, k, v, pos: method.decode(st, 0, q, k, v, pos), donate_argnums=0)
    hlo = step.lower(st, q, k, k, jnp.asarray([50, 64])).compile().as_text()
    outside = {k: c for k, (c, in_round) in _cache_copies(hlo, shapes).items() if not in_round}
    assert outside == {}
