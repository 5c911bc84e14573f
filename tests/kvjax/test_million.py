"""A million tokens: every count, index and budget of every registered method stays exact in traced int32 at and
beyond 2^20 prompt tokens (against Python ints), every method's prefill and decode step trace at a 2^20 bucket,
and the prefill scoring of h2o and less takes memory linear in the prompt (compiled temp bytes, tiny model)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.engine import core
from kvjax import engine, methods
from kvjax.budget import as_fraction, budget_tokens
from kvjax.methods.base import Capacity, evicting_budget
from kvjax.methods.chelsea import Chelsea
from kvjax.methods.chelsea.schedule import PRESETS, simulate
from kvjax.methods.chelsea.csm import RATIO_UNIT, merges_for, quantise_ratio
from kvjax.methods.snapkv import pyramid_budget
from kvjax.model import random_params
from methods_table import small
from tiny_models import tiny_config

MILLION = 1 << 20
#: Around the old overflow of Chelsea's ``r_q * mid`` (about 430k-610k tokens at r = 0.35-0.5), a million, and
#: beyond; the largest is 2^30 (a length + Gamma must still fit int32).
LENGTHS = (430_000, 610_000, 700_000, MILLION, 1 << 21, 1 << 24, (1 << 30) - 1)

CFG = tiny_config(intermediate_size=64, max_position_embeddings=4096)


def traced(fn, *arrays):
    """``fn`` jitted on int32 arrays (what prefill sees), back as Python ints."""
    out = jax.jit(fn)(*(jnp.asarray(a, jnp.int32) for a in arrays))
    return [int(x) for x in np.asarray(out).reshape(-1)]


# ---- Chelsea: merge counts, the host plan and the budget rule ------------------------------------------------


def ref_merges(length: int, budget: int, sink: int, recent: int, r_q: int) -> int:
    """The merge count of one round in Python ints (spec §2.4): ``min(max(floor(r M), 1), length - budget)``."""
    if length <= budget:
        return 0
    return min(max(r_q * (length - sink - recent) // RATIO_UNIT, 1), length - budget)


@pytest.mark.parametrize("r_q", sorted({quantise_ratio(r) for p in PRESETS.values() for r in p[:1]} | {5000, 500}))
def test_merge_count_is_exact_in_int32(r_q):
    lengths = np.array(LENGTHS)
    budgets = lengths // 5
    got = traced(lambda n, b: merges_for(n, b, 16, 64, r_q), lengths, budgets)
    want = [ref_merges(int(n), int(b), 16, 64, r_q) for n, b in zip(lengths, budgets)]
    assert got == want
    # per-sequence windows (arrays), as Chelsea's short-prompt path passes them
    got = traced(lambda n, b, s, r: merges_for(n, b, s, r, r_q), lengths, budgets, lengths * 0 + 3, lengths * 0 + 7)
    assert got == [ref_merges(int(n), int(b), 3, 7, r_q) for n, b in zip(lengths, budgets)]


@pytest.mark.parametrize("n", (430_000, 610_000, 700_000, MILLION, 1 << 21))
def test_chelsea_traced_rounds_match_the_host_plan(n):
    """The merge counts a bucket-length prompt gets in the traced round loop (int32, ``merges_for`` with the
    quantised ratio table, as ``chelsea_merge.compress``) equal the host plan's rounds for it (numpy int64) and an
    independent Python-int recurrence, bound by the bucket's plan, and land exactly on the budget (before the fix, at
    700k the first traced round merged 1 token where the plan expected 244,972)."""
    m = Chelsea(budget=0.2)
    b_max, _, pre, _, _ = m.sizes(None, Capacity(n, 0))
    table = m.ratio_table()
    sink, recent = m.windows(b_max)
    want, s, i = [], n, 0
    while s > b_max:
        want.append(ref_merges(s, b_max, sink, recent, table[min(i, len(table) - 1)]))
        s -= want[-1]
        i += 1
    assert s == b_max
    one = simulate(np.array([n]), np.array([b_max]), sink, recent, np.array([True]), table, idle=np.array([n]))
    assert [r.max_merges for r in one] == want  # the host plan (numpy int64) of this prompt length
    # the bucket's plan is the worst case over every length <= n: this one's counts first, never above it
    assert pre[0].max_merges == want[0] and all(r.max_merges >= w for r, w in zip(pre, want))

    def rounds(length):
        r_tab = jnp.asarray(table, jnp.int32)

        def body(i, carry):
            length, out = carry
            k = merges_for(length, b_max, sink, recent, r_tab[jnp.minimum(i, len(table) - 1)])
            return length - k, out.at[i].set(k[0])

        return jax.lax.fori_loop(0, len(want), body, (length, jnp.zeros(len(want), jnp.int32)))

    last, counts = jax.jit(rounds)(jnp.asarray([n], jnp.int32))
    assert [int(x) for x in counts] == want and int(last[0]) == b_max


def test_chelsea_budget_rules_are_exact_in_int32():
    m = Chelsea(budget=0.2)
    lengths = np.array(LENGTHS)
    gamma = 512
    for p, q in ((1, 5), (3, 10), (8123, 10000), (1, 10000), (9999, 10000)):
        got = traced(lambda n: m.target(("frac", p, q), n, gamma), lengths)
        assert got == [max((int(n) + gamma) * p // q, 1) for n in lengths]
    # token counts with outlier heads: B = floor((c H - O (n + Gamma)) / (H - O)), at least 1
    for c, h, o in ((4096, 8, 1), (200_000, 64, 3), (1_000_000, 640, 20), (100, 640, 600), (MILLION, 1024, 1)):
        got = traced(lambda n: m.target(("count", c, h, o), n, gamma), lengths)
        assert got == [max((c * h - o * (int(n) + gamma)) // (h - o), 1) for n in lengths], (c, h, o)


# ---- every method's per-sequence counts ------------------------------------------------------------------


@pytest.mark.parametrize("budget", [0.2, 0.3, 0.8123, 1.0, 1 / 3, 4096])
def test_budget_counts_are_exact_in_int32(budget):
    lengths = np.array(LENGTHS)
    if isinstance(budget, float):
        p, q = as_fraction(budget)
        want = [max(-(-int(n) * p // q), 1) for n in lengths]
    else:
        want = [min(budget, int(n)) for n in lengths]
    assert traced(lambda n: budget_tokens(budget, n), lengths) == want
    assert [int(x) for x in budget_tokens(budget, lengths)] == want  # numpy in (int64) too
    assert [budget_tokens(budget, int(n)) for n in lengths] == want
    most = lengths + 100
    assert traced(lambda n, m: evicting_budget(budget, n, m), lengths, most) == [
        w if isinstance(budget, float) else min(budget, int(m)) for w, m in zip(want, most)
    ]


def test_method_counts_are_exact_in_int32():
    """The traced per-sequence counts of h2o, streaming_llm, pyramidkv, pqcache, clusterkv and quest at and
    beyond 2^20 tokens against their host (Python int) versions."""
    lengths = np.array(LENGTHS)
    ns = [int(n) for n in lengths]
    h2o = methods.get("h2o", budget=0.2, recent=0.3)
    limit = [budget_tokens(0.2, n) for n in ns]
    assert traced(h2o.recent_tokens, limit) == [x * 3 // 10 for x in limit]
    st = methods.get("streaming_llm", budget=0.2)
    assert traced(st.sinks_for, limit) == [min(4, x - 1) for x in limit]
    for layer in (0, 5, 31):
        got = traced(lambda n: pyramid_budget(budget_tokens(0.2, n), n, layer, 32, 8, 20), lengths)
        assert got == [pyramid_budget(budget_tokens(0.2, n), n, layer, 32, 8, 20) for n in ns]
    pq = methods.get("pqcache", budget=0.2)
    w, k = jax.jit(pq.split_dynamic)(jnp.asarray(lengths, jnp.int32))
    assert list(zip(np.asarray(w).tolist(), np.asarray(k).tolist())) == [pq.split(n) for n in ns]
    ck = methods.get("clusterkv", budget=0.2)
    s, bsel, c0 = jax.jit(lambda n: ck._split_dynamic(n, 64))(jnp.asarray(lengths, jnp.int32))
    assert list(zip(np.asarray(s).tolist(), np.asarray(bsel).tolist())) == [ck.split(n, 64) for n in ns]
    assert np.asarray(c0).tolist() == [ck.clusters_for(n) for n in ns]
    qu = methods.get("quest", budget=0.2)
    assert traced(qu.page_budget, lengths) == [qu.page_budget(n) for n in ns]
    cur, keep = jax.jit(qu.kept_pages)(jnp.asarray(lengths, jnp.int32), jnp.asarray(lengths + 7, jnp.int32))
    assert np.asarray(cur).tolist() == [(n + 7) // 16 for n in ns]
    assert np.asarray(keep).tolist() == [min(qu.page_budget(n) - 1, (n + 7) // 16) for n in ns]


# ---- every method traces at a 2^20 bucket ------------------------------------------------------------------


@pytest.mark.parametrize("name", methods.names())
def test_prefill_and_decode_trace_at_a_million_tokens(name):
    """``jax.eval_shape`` of the engine's prefill and one decode step for a 2^20-token bucket (nothing is
    compiled or run): every method builds its state, compresses and decodes at fixed shapes there."""
    m = small(name)  # its small options: the tiny model's layers compress, LESS's kernels small
    cap = Capacity(MILLION, 8)
    params = jax.eval_shape(lambda: random_params(CFG, jax.random.PRNGKey(0)))
    states = jax.eval_shape(lambda: engine.init_states(CFG, m, 1, cap, jnp.float32))
    tokens = jax.ShapeDtypeStruct((1, MILLION), jnp.int32)
    one = jax.ShapeDtypeStruct((1,), jnp.int32)
    new, logits = jax.eval_shape(lambda *a: core.prefill(CFG, m, *a), params, tokens, one, states)
    assert logits.shape == (1, CFG.vocab_size)
    assert jax.tree.structure(new) == jax.tree.structure(states)
    assert [x.shape for x in jax.tree.leaves(new)] == [x.shape for x in jax.tree.leaves(states)]
    logits, after = jax.eval_shape(lambda *a: core.decode_step(CFG, m, *a), params, new, one, one)
    assert logits.shape == (1, CFG.vocab_size)
    assert [x.shape for x in jax.tree.leaves(after)] == [x.shape for x in jax.tree.leaves(states)]


# ---- prefill memory is linear in T ----------------------------------------------------------------------


def prefill_temp_bytes(name: str, t: int, m=None) -> int:
    m = m or small(name)  # its small options: the tiny model's layers compress, LESS's kernels small
    params = jax.eval_shape(lambda: random_params(CFG, jax.random.PRNGKey(0)))
    states = jax.eval_shape(lambda: engine.init_states(CFG, m, 1, Capacity(t, 8), jnp.float32))
    lowered = jax.jit(core.prefill, static_argnums=(0, 1)).lower(
        CFG, m, params, jax.ShapeDtypeStruct((1, t), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32), states
    )
    return lowered.compile().memory_analysis().temp_size_in_bytes


def test_h2o_and_less_prefill_memory_is_linear():
    """Compiled prefill temp bytes at T = 4096 and 8192: h2o's accumulated scores and LESS's fold add no more
    per prompt token than twice what full attention's prefill itself takes (before the tiling, h2o's query
    chunks took a ``[512, T]`` block per head: 13x full's per-token growth), and at most double with T. Their
    prefill also computes the prompt's attention (``attends_prompt``: zero-padded tiles of q, k, v and the output in
    float32 beside the score tiles, where full's attention writes over ``q``; measured 3.1x), hence 3.5x rather
    than 2x."""
    full = [prefill_temp_bytes("full", t) for t in (4096, 8192)]
    for name in [n for n in methods.names() if methods.get(n).attends_prompt]:  # h2o, less
        a, b = (prefill_temp_bytes(name, t) for t in (4096, 8192))
        assert b <= 2.1 * a, (name, a, b)
        assert b - a <= 3.5 * (full[1] - full[0]), (name, a, b, full)


@pytest.mark.slow
def test_clusterkv_prefill_memory_is_linear():
    """ClusterKV clusters into ``C0 = L / 80`` centroids: the CPU assignment's similarity block ``[N, L, C0]`` was
    quadratic in T (900 MiB of temp at 2^16 against full's 119); tiled over rows it grows like full's prefill."""
    full = [prefill_temp_bytes("full", t) for t in (16384, 32768)]
    m = methods.get("clusterkv", n_full=1)  # the paper's L / 80 centroids, layer 1 clustered
    a, b = (prefill_temp_bytes("clusterkv", t, m) for t in (16384, 32768))
    assert b <= 2.1 * a and b - a <= 2 * (full[1] - full[0]), (a, b, full)
