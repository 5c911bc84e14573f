"""ChunkKV (``kvjax.methods.chunkkv``) against the NumPy reference in ``ref_chunkkv.py``: kept positions per
(batch, KV head) for MHA/GQA, a batch of 3 lengths not divisible by the chunk size, both modes; whole-chunk,
window, count and order invariants; decode appends and attends over exactly the kept tokens; chunk_size=1 equals
SnapKV without pooling (kept positions and generated tokens); budgets covering the prompt equal full; layer-wise
index reuse (Algorithm 2); no decode retracing; bad input; the layer-Jaccard analysis helpers."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import analysis, engine, methods
from kvjax.methods.base import Capacity
from kvjax.methods.chunkkv import ChunkKV

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_chunkkv as ref  # noqa: E402
from test_baselines import (
    B,
    LENGTHS,
    MAX_NEW,
    T,
    check_decode_out,
    check_slot_contents,
    inputs,
    kept,  # noqa: E402
    model_cfg,
    run,
)

import ref_baselines as rb  # noqa: E402


def seq_budget(budget, n, slots):
    return min(rb.sequence_budget(budget, n), slots)  # exact ceil(b n) of the sequence's own n


def slots_of(budget):
    return min(rb.sequence_budget(budget, T), T)


def check_near_tie(got_chunks, want_chunks, scores, n, what, tol=1e-5):
    """Equal chunk sets, except for chunks that differ only across a near-tie at the top-n boundary."""
    if got_chunks == want_chunks:
        return
    diff = sorted(set(got_chunks) ^ set(want_chunks))
    boundary = np.sort(scores)[::-1][n - 1]
    assert all(abs(scores[i] - boundary) <= tol for i in diff), f"{what}: chunks {got_chunks} != {want_chunks}"


# ----------------------------------------------------------------------------------------------------------
# kept positions vs the reference, invariants, decode


# (Hq, Hkv, budget, window, chunk_size, mode, head_mode): lengths 48, 37, 29 are not multiples of 3, 5, 7 or 10
CASES = [
    pytest.param(4, 4, 0.5, 4, 5, "prefix_exclusive", "per_kv_head", id="mha-0.5-w4-c5"),
    pytest.param(4, 2, 20, 4, 7, "prefix_exclusive", "per_kv_head", id="gqa2-20-w4-c7"),
    pytest.param(6, 2, 0.5, 4, 5, "prefix_exclusive", "per_kv_head", id="gqa3-0.5-w4-c5"),
    pytest.param(6, 2, 0.75, 8, 10, "prefix_exclusive", "per_kv_head", id="gqa3-0.75-w8-c10"),
    # 6 chunks > 16 slots: cut
    pytest.param(4, 2, 20, 4, 3, "paper_literal", "per_kv_head", id="literal-gqa2-20-w4-c3"),
    pytest.param(4, 4, 0.5, 4, 5, "paper_literal", "per_kv_head", id="literal-mha-0.5-w4-c5"),
    pytest.param(6, 2, 20, 4, 7, "paper_literal", "per_kv_head", id="literal-gqa3-20-w4-c7"),
    pytest.param(4, 4, 0.5, 4, 5, "prefix_exclusive", "shared", id="shared-mha-0.5-w4-c5"),
    pytest.param(6, 2, 20, 4, 7, "prefix_exclusive", "shared", id="shared-gqa3-20-w4-c7"),
    pytest.param(4, 2, 20, 4, 3, "paper_literal", "shared", id="shared-literal-gqa2-20-w4-c3"),
]


@pytest.mark.parametrize("hq,hkv,budget,window,chunk,mode,head_mode", CASES)
def test_kept_positions_match_reference(hq, hkv, budget, window, chunk, mode, head_mode):
    m = ChunkKV(budget=budget, window=window, chunk_size=chunk, mode=mode, head_mode=head_mode)
    first, trace, data = run(m, hq, hkv, steps=3, peak=window)
    q, k, v, lengths = data[:4]
    slots = slots_of(budget)
    assert first.prompt_slots == slots
    pos = np.asarray(first.pos)
    compressed = 0
    for b in range(B):
        n = int(lengths[b])
        bud = seq_budget(budget, n, slots)
        want, scores, nsel = ref.chunkkv_keep(q[b], k[b], n, window, chunk, bud, mode, head_mode=head_mode)
        if head_mode == "shared":  # every KV head keeps the same positions
            assert all(list(pos[b, h]) == list(pos[b, 0]) for h in range(hkv)), f"b={b}: heads differ"
        for h in range(hkv):
            stored = [int(p) for p in pos[b, h, :slots] if p >= 0]
            if scores is None:
                assert stored == want[h], f"b={b} h={h}: a prompt within its budget is kept whole"
                continue
            compressed += 1
            limit = n - window if mode == "prefix_exclusive" else n
            got_chunks = sorted({p // chunk for p in stored[:-window]})
            want_chunks = sorted({p // chunk for p in want[h][:-window]})
            check_near_tie(got_chunks, want_chunks, scores[h], nsel, f"b={b} h={h}")
            if got_chunks == want_chunks:
                assert stored == want[h], f"b={b} h={h}: storage order"
            # invariants, independent of the reference
            assert stored[-window:] == list(range(n - window, n)), "window kept, last"
            body = stored[:-window]
            assert all(0 <= p < limit for p in body)
            if mode == "prefix_exclusive":
                assert np.all(np.diff(stored) > 0), "strictly increasing, no duplicates"
                for c in got_chunks:  # whole chunks (the one straddling the prefix end is cut there)
                    assert set(range(c * chunk, min(c * chunk + chunk, limit))) <= set(body)
                assert len(body) <= bud - window and len(got_chunks) == (bud - window) // chunk
            else:
                assert np.all(np.diff(body) > 0) and len(body) <= bud - window
                full_chunks = [t for c in got_chunks for t in range(c * chunk, min(c * chunk + chunk, limit))]
                assert body == full_chunks[: bud - window], "the first budget - window tokens of whole chunks"
            assert len(stored) <= slots
    assert compressed > 0
    check_slot_contents(first, data, 0)
    prompt_keep = {(b, h): sorted(int(p) for p in pos[b, h] if p >= 0) for b in range(B) for h in range(hkv)}
    for s, (out, st) in enumerate(trace):  # decode appends after the compressed prompt and attends over it all
        keep = lambda b, h: prompt_keep[b, h] + [int(lengths[b]) + i for i in range(s + 1)]  # noqa: E731
        assert kept(st) == {(b, h): keep(b, h) for b in range(B) for h in range(hkv)}
        dup = lambda b, h: [int(p) for p in np.asarray(st.pos)[b, h] if p >= 0]  # noqa: E731  (duplicates count)
        check_decode_out(out, data, s, dup)


def test_per_batch_element_and_per_head_choices_differ():
    """Each sequence and each KV head picks its own chunks (not batch element 0's for everybody)."""
    m = ChunkKV(budget=0.5, window=4, chunk_size=5)
    first, _, _ = run(m, 4, 2, steps=0, peak=4)
    pos = np.asarray(first.pos)
    sets = {
        (b, h): frozenset(int(p) // 5 for p in pos[b, h] if 0 <= p < LENGTHS[b] - 4) for b in range(B) for h in range(2)
    }
    assert len(set(sets.values())) > 2


def test_reference_hand_example():
    """The reference itself on a hand-checkable case: chunk sums, top-k, the cut straddling chunk."""
    votes = np.array([0.1, 0.1, 0.9, 0.9, 0.2, 0.3, 5.0, 0.0])
    np.testing.assert_allclose(ref.chunk_scores(votes, 7, 3), [1.1, 1.4, 5.0])
    assert ref.top_chunks(np.array([1.0, 2.0, 2.0, 0.5]), 2) == [1, 2]
    assert ref.top_chunks(np.array([1.0, 1.0, 1.0]), 2) == [0, 1]  # ties to the lower index
    assert [ref.reuse_leader(l, 3) for l in range(7)] == [0, 0, 0, 3, 3, 3, 6]


def test_chunk_select_hand_example():
    """chunk_select on given votes (T=12, len 12, budget 10, window 2, chunk 3), checked by hand."""
    from kvjax.methods.chunkkv import chunk_select

    votes = jnp.asarray([[[0, 0, 0, 1, 1, 1, 0, 0, 0, 5, 9, 9]]], jnp.float32)
    n, bud = jnp.asarray([12]), jnp.asarray([10])
    # prefix [0, 10): chunk sums 0, 3, 0, 5 (chunk 3 = position 9 only); 2 chunks -> 1 and 3, then the window.
    idx, ok = chunk_select(votes, n, bud, 2, 3, 10)
    assert [int(i) for i in idx[0, 0] if i >= 0] == [3, 4, 5, 9, 10, 11]
    # paper_literal: sums 0, 3, 0, 23; 3 chunks -> 0 (tie with 2 goes to the lower), 1, 3; first 8 tokens
    # [0..5, 9, 10], then the window [10, 11]: position 10 is stored twice.
    idx, ok = chunk_select(votes, n, bud, 2, 3, 10, "paper_literal")
    assert [int(i) for i in idx[0, 0] if i >= 0] == [0, 1, 2, 3, 4, 5, 9, 10, 10, 11]
    # constant votes: the lowest-index whole chunks win over the partial one
    idx, _ = chunk_select(jnp.ones((1, 1, 12)), n, bud, 2, 3, 10)
    assert [int(i) for i in idx[0, 0] if i >= 0] == [0, 1, 2, 3, 4, 5, 10, 11]
    # within budget: everything
    idx, _ = chunk_select(votes, jnp.asarray([9]), bud, 2, 3, 10)
    assert [int(i) for i in idx[0, 0] if i >= 0] == list(range(9))


# ----------------------------------------------------------------------------------------------------------
# chunk_size = 1 is SnapKV without pooling


@pytest.mark.parametrize("hq,hkv,budget,window", [(4, 4, 0.5, 4), (6, 2, 20, 8)], ids=["mha", "gqa3"])
def test_chunk_size_one_equals_snapkv_without_pooling(hq, hkv, budget, window):
    a, ta, _ = run(ChunkKV(budget=budget, window=window, chunk_size=1), hq, hkv, steps=2, peak=window)
    b, tb, _ = run(methods.get("snapkv", budget=budget, window=window, kernel=1), hq, hkv, steps=2, peak=window)
    np.testing.assert_array_equal(np.asarray(a.pos), np.asarray(b.pos))
    for (oa, _), (ob, _) in zip(ta, tb):
        np.testing.assert_array_equal(oa, ob)


# the sizes and seed of the tiny fixture's model (tests/conftest.py)
pytestmark = pytest.mark.tiny(num_layers=4, max_position_embeddings=512, seed=0)


def prompts(lengths, seed=0):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(1, 60, size=n)) for n in lengths]


PS = prompts([60, 41, 29], seed=2)  # one batch for the engine tests: shared compilations
BASE = dict(budget=0.4, window=4, chunk_size=5)
NEW = 6


def test_chunk_size_one_equals_snapkv_on_the_tiny_model(tiny):
    c1 = ChunkKV(budget=0.4, window=4, chunk_size=1)
    snap = methods.get("snapkv", budget=0.4, window=4, kernel=1)
    # max_new_tokens as in generate: the prefill compiled here is the one generate uses
    kc = analysis.kept_prompt_positions(tiny, c1, PS, max_new_tokens=NEW)
    ks = analysis.kept_prompt_positions(tiny, snap, PS, max_new_tokens=NEW)
    assert kc.counts().min() < 29  # compressed
    np.testing.assert_array_equal(kc.mask, ks.mask)
    got = engine.generate(tiny, PS, c1, max_new_tokens=NEW, driver="scan", stop_at_eos=False).tokens
    want = engine.generate(tiny, PS, snap, max_new_tokens=NEW, driver="scan", stop_at_eos=False).tokens
    assert got == want
    # chunking changes the choice (the test above is not vacuous)
    k5 = analysis.kept_prompt_positions(tiny, ChunkKV(**BASE), PS, max_new_tokens=NEW)
    assert not np.array_equal(k5.mask, ks.mask)


# ----------------------------------------------------------------------------------------------------------
# budgets covering the prompt are no-ops


@pytest.mark.parametrize("options", [{"budget": T + MAX_NEW, "reuse": 2}, {"budget": 1.0, "mode": "paper_literal"}])
def test_budget_covering_prompt_equals_full(options):
    _, full_trace, data = run(methods.get("full"), 6, 2, layer=0)
    first, trace, _ = run(ChunkKV(window=4, chunk_size=5, **options), 6, 2, layer=0)
    lengths = data[3]
    assert kept(first) == {(b, h): list(range(int(lengths[b]))) for b in range(B) for h in range(2)}
    for (out, _), (fout, _) in zip(trace, full_trace):
        np.testing.assert_allclose(out, fout, atol=1e-6, rtol=1e-6)


def test_budget_covering_prompt_generates_like_full(tiny):
    full = engine.generate(tiny, PS, "full", max_new_tokens=NEW, driver="scan", stop_at_eos=False).tokens
    m = ChunkKV(budget=64, window=4, chunk_size=5, reuse=2)
    got = engine.generate(tiny, PS, m, max_new_tokens=NEW, driver="scan", stop_at_eos=False).tokens
    assert got == full


# ----------------------------------------------------------------------------------------------------------
# layer-wise index reuse (Algorithm 2)


def _init(m, hq, hkv, layer):
    return m.init(model_cfg(hq, hkv), B, Capacity(T, MAX_NEW), layer, jnp.float32)


@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 4)], ids=["gqa2", "mha"])
def test_reuse_equals_recomputation_for_identical_layers(hq, hkv):
    """Layers with identical q/k/v: the reused state equals the state a recomputing layer stores."""
    q, k, v, lengths = (jnp.asarray(x) for x in inputs(hq, hkv, peak=4)[:4])
    base = dict(budget=0.5, window=4, chunk_size=5)
    r2, r1 = ChunkKV(reuse=2, **base), ChunkKV(reuse=1, **base)
    lead = jax.jit(lambda st: r2.prefill(st, 0, q, k, v, lengths))(_init(r2, hq, hkv, 0))
    follow = jax.jit(lambda st, prev: r2.prefill(st, 1, q, k, v, lengths, previous=prev))(_init(r2, hq, hkv, 1), lead)
    again = jax.jit(lambda st: r1.prefill(st, 1, q, k, v, lengths))(_init(r1, hq, hkv, 1))
    for a, b in zip(jax.tree.leaves(follow), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert follow.prompt_slots == again.prompt_slots


def test_follower_gathers_its_own_kv_at_the_leaders_positions():
    hq, hkv = 6, 2
    q, k, v, lengths = (jnp.asarray(x) for x in inputs(hq, hkv, peak=4)[:4])
    q2, k2, v2 = (jnp.asarray(x) for x in inputs(hq, hkv, seed=7)[:3])
    m = ChunkKV(budget=0.5, window=4, chunk_size=5, reuse=3)
    lead = m.prefill(_init(m, hq, hkv, 3), 3, q, k, v, lengths)
    fol = m.prefill(_init(m, hq, hkv, 4), 4, q2, k2, v2, lengths, previous=lead)
    fol2 = m.prefill(_init(m, hq, hkv, 5), 5, q2 * 0, k2, v2, lengths, previous=fol)  # q unused by followers
    np.testing.assert_array_equal(np.asarray(fol.pos), np.asarray(lead.pos))
    np.testing.assert_array_equal(np.asarray(fol2.pos), np.asarray(lead.pos))
    mine = m.prefill(_init(m, hq, hkv, 0), 0, q2, k2, v2, lengths)
    assert not np.array_equal(np.asarray(mine.pos), np.asarray(lead.pos))  # layer 4 alone would choose otherwise
    pos, sk = np.asarray(fol.pos), np.asarray(fol.k)
    k2n = np.asarray(k2)
    for b in range(B):
        for h in range(hkv):
            for s in np.nonzero(pos[b, h] >= 0)[0]:
                np.testing.assert_array_equal(sk[b, h, s], k2n[b, h, pos[b, h, s]])


@pytest.mark.parametrize("reuse", [2, 3])
def test_engine_reuse_follows_algorithm_2(tiny, reuse):
    """reuse=R: layer l keeps exactly what layer floor(l/R)*R keeps with reuse=1 (prefill attention is full, so
    leader layers see the same hidden states in both runs). reuse=3 with 4 layers: leaders 0 and 3."""
    k1 = analysis.kept_prompt_positions(tiny, ChunkKV(**BASE), PS, max_new_tokens=NEW)
    kr = analysis.kept_prompt_positions(tiny, ChunkKV(reuse=reuse, **BASE), PS, max_new_tokens=NEW)
    for layer in range(tiny.config.num_layers):
        np.testing.assert_array_equal(kr.mask[layer], k1.mask[ref.reuse_leader(layer, reuse)], err_msg=str(layer))
    assert not np.array_equal(k1.mask[0], k1.mask[1])  # the layers do differ without reuse


def test_follower_without_previous_is_an_error():
    m = ChunkKV(budget=0.5, window=4, chunk_size=5, reuse=2)
    q, k, v, lengths = (jnp.asarray(x) for x in inputs(4, 2)[:4])
    with pytest.raises(ValueError, match="previous"):
        m.prefill(_init(m, 4, 2, 1), 1, q, k, v, lengths)
    m.prefill(_init(m, 4, 2, 2), 2, q, k, v, lengths)  # a leader needs none


# ----------------------------------------------------------------------------------------------------------
# no retracing, memory, registry


def test_decode_loop_does_not_retrace(tiny):
    m = methods.get("chunkkv", budget=64, window=4, chunk_size=5, reuse=2)  # compiled by the test above
    engine.generate(tiny, PS, m, max_new_tokens=NEW, driver="scan", stop_at_eos=False)
    before = dict(engine.TRACE_COUNTS)
    other = prompts([50, 63, 33], seed=5)  # same bucket (64), other lengths
    engine.generate(tiny, other, m, max_new_tokens=NEW, driver="scan", stop_at_eos=False)
    assert dict(engine.TRACE_COUNTS) == before


def test_state_shapes_identical_across_layers_and_memory():
    m = ChunkKV(budget=0.5, window=4, chunk_size=5, reuse=2)
    states = [_init(m, 4, 2, layer) for layer in range(4)]
    shapes = {tuple(x.shape for x in jax.tree.leaves(s)) for s in states}
    assert len(shapes) == 1 and {s.prompt_slots for s in states} == {24}
    want = sum(np.asarray(x).nbytes for x in jax.tree.leaves(states[0]))
    assert (
        m.memory_bytes(states[0])
        == want
        == 2 * B * 2 * (24 + MAX_NEW) * 16 * 4 + B * 2 * (24 + MAX_NEW) * 4 + 2 * B * 4
    )


def test_registry():
    m = methods.get("chunkkv", budget=64, chunk_size=10, reuse=2)
    assert isinstance(m, ChunkKV) and m.reuse == 2 and "chunkkv" in methods.names()
    assert m.window == 8 and ChunkKV().chunk_size == 10 and ChunkKV().mode == "prefix_exclusive"


# ----------------------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 4)], ids=["gqa2", "mha"])
def test_chunkkv_wraps_the_h2o_scorer(hq, hkv):
    """``scorer="h2o"``: whole chunks ranked by H2O's accumulated attention (kvpress's ``ChunkKVPress(press)``):
    the reference's chunk selection fed the numpy accumulated attention of ``ref_baselines``."""
    m = methods.get("chunkkv", budget=0.5, window=4, chunk_size=5, scorer="h2o")
    first, _, data = run(m, hq, hkv, steps=0)
    q, k, v, lengths = data[:4]
    pos = np.asarray(first.pos)
    for b in range(B):
        n = int(lengths[b])
        votes = rb.accumulated_attention(q[b], k[b], n)
        want, scores, nsel = ref.chunkkv_keep(q[b], k[b], n, 4, 5, seq_budget(0.5, n, slots_of(0.5)), votes=votes)
        for h in range(hkv):
            stored = [int(p) for p in pos[b, h] if p >= 0]
            got = sorted({p // 5 for p in stored[:-4]})
            check_near_tie(got, sorted({p // 5 for p in want[h][:-4]}), scores[h], nsel, f"b={b} h={h}")
            if got == sorted({p // 5 for p in want[h][:-4]}):
                assert stored == want[h], f"b={b} h={h}"


def _raises(fn, *words):
    with pytest.raises(ValueError) as info:
        fn()
    for w in words:
        assert w in str(info.value), f"{info.value!r} does not name {w!r}"


@pytest.mark.parametrize(
    "options,words",
    [
        ({"chunk_size": 0}, ("chunk_size", "0")),
        ({"chunk_size": -3}, ("chunk_size", "-3")),
        ({"chunk_size": 2.5}, ("chunk_size",)),
        ({"reuse": 0}, ("reuse", "0")),
        ({"reuse": -1}, ("reuse",)),
        ({"window": 0}, ("window",)),
        ({"mode": "kvpress"}, ("mode", "kvpress")),
        ({"budget": 1.5}, ("budget",)),
        ({"budget": 0}, ("budget",)),
        ({"scorer": "kvpress"}, ("scorer",)),
        ({"head_mode": "query_head"}, ("head_mode", "query_head", "shared")),
    ],
)
def test_bad_options(options, words):
    _raises(lambda: methods.get("chunkkv", **options), *words)


@pytest.mark.parametrize(
    "options",
    [
        {"budget": 0.125, "window": 8},  # 6 tokens at n=48: below the window
        {"budget": 16, "window": 8, "chunk_size": 10},  # 8 tokens beside the window: no chunk fits
        {"budget": 8, "window": 8},
        {"budget": 6, "window": 8},
    ],
)
def test_budget_below_window_plus_chunk_keeps_the_most_recent_tokens(options):
    """When no whole chunk fits beside the window, the window takes the whole budget: the most recent
    ``P`` tokens, never more than the budget and never an error (the budget contract)."""
    m = ChunkKV(**options)
    q, k, v, lengths = (jnp.asarray(x) for x in inputs(4, 2)[:4])
    st = jax.jit(lambda st: m.prefill(st, 0, q, k, v, lengths))(_init(m, 4, 2, 0))
    pos = np.asarray(st.pos)
    for b, n in enumerate(np.asarray(lengths)):
        p = min(m.budget, int(n)) if isinstance(m.budget, int) else -(-int(n) // 8)
        for h in range(2):
            assert sorted(x for x in pos[b, h] if x >= 0) == list(range(n - p, n)), (options, b, h)


def test_sizes_that_only_fit_whole_prompts_are_fine():
    st = ChunkKV(budget=16, window=8, chunk_size=10).init(model_cfg(4, 2), B, Capacity(16, 4), 0, jnp.float32)
    assert st.prompt_slots == 16  # budget >= bucket: never compresses


# ----------------------------------------------------------------------------------------------------------
# analysis helpers


def test_jaccard_hand_computed():
    a = np.zeros((3, 1, 2, 6), bool)
    a[0, 0, 0, [0, 1, 2, 5]] = True
    a[1, 0, 0, [1, 2, 3, 5]] = True  # 3 common of 5 -> 0.6
    a[2, 0, 0, [1, 2, 3, 5]] = True  # identical -> 1.0
    a[0, 0, 1, [4]] = True
    a[1, 0, 1, [0]] = True  # disjoint -> 0.0; head 1 layers 1/2: both {0} -> 1.0
    a[2, 0, 1, [0]] = True
    np.testing.assert_allclose(analysis.adjacent_layer_jaccard(a), [(0.6 + 0.0) / 2, 1.0])
    # without the last position of a length-6 sequence: {0,1,2} vs {1,2,3} -> 0.5
    np.testing.assert_allclose(analysis.adjacent_layer_jaccard(a, exclude_last=1, lengths=[6]), [0.25, 1.0])
    m = analysis.layer_jaccard_matrix(a)
    np.testing.assert_allclose(m, [[1, 0.3, 0.3], [0.3, 1, 1], [0.3, 1, 1]])
    assert ref.jaccard([0, 1, 2, 5], [1, 2, 3, 5]) == 0.6


def test_kept_prompt_positions_reads_states(tiny):
    full = analysis.kept_prompt_positions(tiny, "full", PS, max_new_tokens=NEW)  # compiled above
    assert full.mask.shape == (4, 3, 2, 64)
    assert full.counts().tolist() == [[[60, 60], [41, 41], [29, 29]]] * 4
    np.testing.assert_allclose(analysis.adjacent_layer_jaccard(full), 1.0)
    snap = analysis.kept_prompt_positions(
        tiny, methods.get("snapkv", budget=0.4, window=4, kernel=1), PS, max_new_tokens=NEW
    )
    assert snap.counts()[:, 0].max() == 24 and snap.counts()[:, 2].max() == 12  # ceil(0.4 * length)
    assert list(snap.indices(0, 1, 0)[-4:]) == [37, 38, 39, 40]
    j = analysis.adjacent_layer_jaccard(snap, exclude_last=4)
    assert j.shape == (3,) and np.all((0 <= j) & (j < 1))
    by_hand = np.mean(
        [ref.jaccard(snap.indices(1, b, h)[:-4], snap.indices(2, b, h)[:-4]) for b in range(3) for h in range(2)]
    )
    np.testing.assert_allclose(j[1], by_hand)
    _raises(lambda: analysis.adjacent_layer_jaccard(snap.mask, exclude_last=4), "lengths")
