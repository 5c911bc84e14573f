"""Baseline methods (full, streaming_llm, h2o, snapkv, pyramidkv) against the NumPy references in
``ref_baselines.py``: kept positions per (batch, KV head) after prefill and after decode steps, H2O's
accumulated scores, decode attention outputs over exactly the kept tokens (MHA and GQA), no-op budgets,
memory accounting and bad input."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import methods
from kvjax.methods.base import Capacity, SlotMethod

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_baselines as ref  # noqa: E402

B, T, D = 3, 48, 16
LENGTHS = (48, 37, 29)  # right padded to the bucket T
MAX_NEW = 8
STEPS = 6
HEADS = [(4, 4), (4, 2), (6, 2)]  # (Hq, Hkv): MHA, GQA G=2, GQA G=3
HEAD_IDS = ["mha", "gqa2", "gqa3"]
ATOL = 1e-5


def model_cfg(hq, hkv, num_layers=4):
    return kvjax.ModelConfig(
        model_type="llama",
        vocab_size=32,
        hidden_size=64,
        intermediate_size=64,
        num_layers=num_layers,
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=D,
    )


@functools.lru_cache(maxsize=None)
def inputs(hq, hkv, seed=0, steps=STEPS, lengths=LENGTHS, peak=0):
    """Random float32 prompt q/k/v (pads filled with large garbage) and per-step decode q/k/v (numpy).

    ``peak > 0``: the last ``peak`` real tokens attend mostly to themselves (the group's queries and the key
    at each such position share one direction), like the recency bias of real models; then the observation
    window's own votes dwarf every prefix vote.
    """
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, hq, T, D)).astype(np.float32)
    k = rng.standard_normal((B, hkv, T, D)).astype(np.float32)
    v = rng.standard_normal((B, hkv, T, D)).astype(np.float32)
    g = hq // hkv
    for b, n in enumerate(lengths):
        for i in range(n - peak, n):
            for h in range(hkv):
                base = rng.standard_normal(D)
                k[b, h, i] = 1.5 * base
                for gi in range(g):
                    q[b, h * g + gi, i] = base + 0.3 * rng.standard_normal(D)
    for b, n in enumerate(lengths):  # padding must never be read: make it loud
        q[b, :, n:] = 40.0 * rng.standard_normal(q[b, :, n:].shape)
        k[b, :, n:] = 40.0 * rng.standard_normal(k[b, :, n:].shape)
        v[b, :, n:] = 1e3
    dq = rng.standard_normal((steps, B, hq, D)).astype(np.float32)
    dk = rng.standard_normal((steps, B, hkv, D)).astype(np.float32)
    dv = rng.standard_normal((steps, B, hkv, D)).astype(np.float32)
    return q, k, v, np.asarray(lengths, np.int32), dq, dk, dv


@functools.lru_cache(maxsize=None)
def _jitted(method, layer):
    prefill = jax.jit(lambda st, q, k, v, n: method.prefill(st, layer, q, k, v, n))
    decode = jax.jit(lambda st, q, k, v, p: method.decode(st, layer, q, k, v, p))
    return prefill, decode


def run(method, hq, hkv, layer=0, num_layers=4, steps=STEPS, seed=0, peak=0):
    """Prefill then ``steps`` decode calls. Returns (prefill state, [(out, state) per step], inputs)."""
    q, k, v, lengths, dq, dk, dv = data = inputs(hq, hkv, seed, peak=peak)
    st = method.init(model_cfg(hq, hkv, num_layers), B, Capacity(T, MAX_NEW), layer, jnp.float32)
    prefill, decode = _jitted(method, layer)
    st = prefill(st, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths))
    first, trace = st, []
    for s in range(steps):
        out, st = decode(st, jnp.asarray(dq[s]), jnp.asarray(dk[s]), jnp.asarray(dv[s]), jnp.asarray(lengths + s))
        trace.append((np.asarray(out), st))
    return first, trace, data


def kept(state) -> dict:
    """Kept positions per (b, h) as sorted lists, from ``state.pos >= 0``."""
    pos = np.asarray(state.pos)
    return {
        (b, h): sorted(int(p) for p in pos[b, h] if p >= 0) for b in range(pos.shape[0]) for h in range(pos.shape[1])
    }


def all_kv(data, b, h, upto_step):
    """Every k/v vector of sequence ``b``, KV head ``h`` by position: prompt then ``upto_step`` decode tokens."""
    q, k, v, lengths, dq, dk, dv = data
    n = int(lengths[b])
    keys = np.concatenate([k[b, h, :n], dk[:upto_step, b, h]]).astype(np.float64)
    vals = np.concatenate([v[b, h, :n], dv[:upto_step, b, h]]).astype(np.float64)
    return keys, vals


def check_slot_contents(state, data, upto_step):
    """Every valid slot holds the k/v of the position it claims (gather and RoPE-position bookkeeping)."""
    pos, sk, sv = np.asarray(state.pos), np.asarray(state.k), np.asarray(state.v)
    for b in range(pos.shape[0]):
        for h in range(pos.shape[1]):
            keys, vals = all_kv(data, b, h, upto_step)
            for s in np.nonzero(pos[b, h] >= 0)[0]:
                np.testing.assert_array_equal(sk[b, h, s], keys[pos[b, h, s]].astype(np.float32))
                np.testing.assert_array_equal(sv[b, h, s], vals[pos[b, h, s]].astype(np.float32))


def check_decode_out(out, data, step, keep_of):
    """``out [B, Hq, D]`` equals NumPy attention of each new query over exactly ``keep_of(b, h)``."""
    q, k, v, lengths, dq, dk, dv = data
    hq, hkv = dq.shape[2], dk.shape[2]
    g = hq // hkv
    for b in range(B):
        for qh in range(hq):
            h = qh // g
            keys, vals = all_kv(data, b, h, step + 1)
            sel = keep_of(b, h)
            want = ref.attend(dq[step, b, qh], keys[sel], vals[sel])
            np.testing.assert_allclose(out[b, qh], want, atol=ATOL, rtol=ATOL, err_msg=f"b={b} qh={qh}")


def assert_same_selection(got, want, scores, n_top, what, tol=1e-6):
    """Equal kept sets, except that positions differing only across a near-tie at the top-k boundary
    (reference scores within ``tol`` of the boundary score) are tolerated."""
    if got == want:
        return
    extra = sorted(set(got) ^ set(want))
    assert scores is not None and len(got) == len(want), f"{what}: kept {got}, expected {want}"
    order = np.sort(scores)[::-1]
    boundary = order[max(n_top, 1) - 1]
    near = [p for p in extra if p < len(scores) and abs(scores[p] - boundary) <= tol]
    assert near == extra, f"{what}: kept {got}, expected {want} (differences {extra} not near-ties)"


# ----------------------------------------------------------------------------------------------------------
# full


@pytest.mark.parametrize("hq,hkv", HEADS, ids=HEAD_IDS)
def test_full_keeps_everything_and_attends_over_all(hq, hkv):
    first, trace, data = run(methods.get("full"), hq, hkv)
    lengths = data[3]
    assert kept(first) == {(b, h): ref.full_keep(int(lengths[b])) for b in range(B) for h in range(hkv)}
    check_slot_contents(first, data, 0)
    for s, (out, st) in enumerate(trace):
        assert kept(st) == {(b, h): ref.full_keep(int(lengths[b]) + s + 1) for b in range(B) for h in range(hkv)}
        check_decode_out(out, data, s, lambda b, h: ref.full_keep(int(lengths[b]) + s + 1))
    check_slot_contents(trace[-1][1], data, STEPS)


# ----------------------------------------------------------------------------------------------------------
# streaming_llm


@pytest.mark.parametrize("budget,sinks", [(0.5, 4), (20, 4), (0.75, 2)])
@pytest.mark.parametrize("hq,hkv", HEADS, ids=HEAD_IDS)
def test_streaming_llm(hq, hkv, budget, sinks):
    m = methods.get("streaming_llm", budget=budget, sinks=sinks)
    static = ref.sequence_budget(budget, T) if isinstance(budget, float) else min(budget, T + MAX_NEW)
    first, trace, data = run(m, hq, hkv)
    lengths = data[3]
    assert np.asarray(first.pos).shape[-1] == static  # the bucket sizes the buffer ...
    slots = [ref.sequence_budget(budget, int(n)) for n in lengths]  # ... each sequence's own n its budget
    want = {(b, h): ref.streaming_keep(int(lengths[b]), slots[b], sinks) for b in range(B) for h in range(hkv)}
    assert kept(first) == want
    check_slot_contents(first, data, 0)
    for s, (out, st) in enumerate(trace):
        keep = lambda b, h: ref.streaming_keep(int(lengths[b]) + s + 1, slots[b], sinks)  # noqa: E731
        assert kept(st) == {(b, h): keep(b, h) for b in range(B) for h in range(hkv)}, f"step {s}"
        check_decode_out(out, data, s, keep)
    check_slot_contents(trace[-1][1], data, STEPS)


# ----------------------------------------------------------------------------------------------------------
# snapkv / pyramidkv


def check_snapkv_like(m, hq, hkv, budgets_of, layer=0, num_layers=4):
    """Kept sets after prefill vs the reference (``budgets_of(b)``: tokens incl. window), then decode appends."""
    first, trace, data = run(m, hq, hkv, layer=layer, num_layers=num_layers, steps=3, peak=m.window)
    q, k, v, lengths = data[:4]
    got = kept(first)
    prompt_keep = {}
    for b in range(B):
        n = int(lengths[b])
        keep, scores = ref.snapkv_keep(q[b], k[b], n, m.window, budgets_of(b), m.kernel, m.pool)
        for h in range(hkv):
            prompt_keep[b, h] = keep[h]
            g = got[b, h]
            if scores is None:
                assert g == keep[h], f"b={b} h={h}: prompt within budget must be kept whole"
                continue
            win = list(range(n - m.window, n))
            assert g[-m.window :] == win, f"b={b} h={h}: window {win} missing from {g}"
            n_top = budgets_of(b) - m.window
            assert_same_selection(g[: -m.window], keep[h][: -m.window], scores[h], n_top, f"b={b} h={h}")
            prompt_keep[b, h] = g  # near-ties resolved: follow the method's choice for decode checks
    # Prompt slots hold positions in increasing order (kept prefix tokens, then the window).
    pos = np.asarray(first.pos)[..., : first.prompt_slots]
    for b in range(B):
        for h in range(hkv):
            real = pos[b, h][pos[b, h] >= 0]
            assert np.all(np.diff(real) > 0)
    check_slot_contents(first, data, 0)
    for s, (out, st) in enumerate(trace):
        keep = lambda b, h: prompt_keep[b, h] + [int(lengths[b]) + i for i in range(s + 1)]  # noqa: E731
        assert kept(st) == {(b, h): keep(b, h) for b in range(B) for h in range(hkv)}, f"step {s}"
        check_decode_out(out, data, s, keep)
    return first


def snapkv_budgets(budget, window):
    return lambda b: min(ref.sequence_budget(budget, LENGTHS[b]), LENGTHS[b])


POOLS = [
    pytest.param("avg", 5, id="avg5"),
    pytest.param("max", 7, id="max7"),
    pytest.param("avg", 1, id="nopool"),
]


@pytest.mark.parametrize("pool,kernel", POOLS)
@pytest.mark.parametrize("budget,window", [(0.5, 4), (20, 8)])
@pytest.mark.parametrize("hq,hkv", HEADS, ids=HEAD_IDS)
def test_snapkv(hq, hkv, budget, window, pool, kernel):
    m = methods.get("snapkv", budget=budget, window=window, kernel=kernel, pool=pool)
    check_snapkv_like(m, hq, hkv, snapkv_budgets(budget, window))


def test_snapkv_pooling_ignores_the_window_reference():
    """The reference pools prefix votes only: huge window votes leave the prefix scores unchanged."""
    q, k = inputs(4, 2, peak=4)[:2]
    n, w = LENGTHS[1], 4
    votes = ref.window_votes(q[1], k[1], n, w)
    assert votes[:, n - w :].mean() > 5 * votes[:, : n - w].mean()  # the peaked window votes for itself
    pooled = ref.snapkv_prefix_scores(q[1], k[1], n, w, 5, "avg")
    manual = [(votes[0, n - w - 3] + votes[0, n - w - 2] + votes[0, n - w - 1]) / 5]
    np.testing.assert_allclose(pooled[0, -1:], manual, rtol=1e-12)


def pyramid_budgets(budget, window, layer, num_layers, beta=20):
    """Per-sequence layer budgets: the harness's three branches on each sequence's own length and total; the
    static slots are the largest of them over every length the bucket can hold."""

    def layer_budget(n):
        total = ref.sequence_budget(budget, n)
        return ref.pyramid_layer_budget(total, n, layer, num_layers, min(window, total), beta)

    slots = max(layer_budget(n) for n in range(1, T + 1))
    return (lambda b: layer_budget(LENGTHS[b])), slots


def test_pyramid_schedule_reference():
    """The reference schedule itself: non-increasing in the layer, averaging to the total budget."""
    for total, n, layers in [(24, 48, 4), (100, 1000, 32), (13, 29, 4), (40, 48, 4)]:
        per = [ref.pyramid_schedule(total, n, l, layers, 4, 20) for l in range(layers)]
        assert all(a >= b for a, b in zip(per, per[1:]))
        assert abs(np.mean(per) - total) <= layers  # integer steps lose at most (N-1) tokens on average
        assert per[0] - 4 <= max(n - 4, 2 * (total - 4) - (total - 4) // 20)
    # Hand-computed: L=24, w=4, T=48, N=4: min=20//20=1, max=39, step=38//3=12 -> 39, 27, 15, 3 (+4).
    assert [ref.pyramid_schedule(24, 48, l, 4, 4, 20) for l in range(4)] == [43, 31, 19, 7]
    # max >= T - w: L=40, T=48: min=1, max=71 -> 44, min=72-44=28, step=16//3=5 -> 44, 39, 34, 29 (+4).
    assert [ref.pyramid_schedule(40, 48, l, 4, 4, 20) for l in range(4)] == [48, 43, 38, 33]


@pytest.mark.parametrize("pool,kernel", [POOLS[2], POOLS[1]])
@pytest.mark.parametrize("layer", [0, 1, 3])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 4)], ids=["gqa2", "mha"])
def test_pyramidkv(hq, hkv, layer, pool, kernel):
    budget, window, num_layers = 0.5, 4, 4
    m = methods.get("pyramidkv", budget=budget, window=window, kernel=kernel, pool=pool)
    of, slots = pyramid_budgets(budget, window, layer, num_layers)
    first = check_snapkv_like(m, hq, hkv, of, layer=layer, num_layers=num_layers)
    # the static slots: the largest layer budget, rounded up to a multiple of 16 (max(16, budget / 8)) so runs
    # of layers share a shape; slot_multiple=1 gives the exact count, and the same kept tokens
    assert first.prompt_slots == min(-(-slots // 16) * 16, T)
    exact = dataclasses.replace(m, slot_multiple=1)
    assert check_snapkv_like(exact, hq, hkv, of, layer=layer, num_layers=num_layers).prompt_slots == slots


# ----------------------------------------------------------------------------------------------------------
# h2o


@pytest.mark.parametrize("budget,recent", [(0.5, 0.5), (32, 0.5), (0.5, 3)])
@pytest.mark.parametrize("hq,hkv", HEADS, ids=HEAD_IDS)
def test_h2o(hq, hkv, budget, recent):
    m = methods.get("h2o", budget=budget, recent=recent)
    first, trace, data = run(m, hq, hkv)
    q, k, v, lengths, dq, dk, dv = data
    g = hq // hkv
    heads = {}
    for b in range(B):
        n = int(lengths[b])
        acc = ref.accumulated_attention(q[b], k[b], n)
        bud = ref.sequence_budget(budget, n) if isinstance(budget, float) else min(budget, T + MAX_NEW)
        rec = int(Fraction(repr(recent)) * bud) if isinstance(recent, float) else min(recent, bud - 1)
        for h in range(hkv):
            heads[b, h] = ref.H2OHead(bud, rec)
            heads[b, h].prefill(acc[h], k[b, h], v[b, h], n)

    def compare(st, what):
        got, score, pos = kept(st), np.asarray(st.score), np.asarray(st.pos)
        for (b, h), head in heads.items():
            assert got[b, h] == sorted(head.held), f"{what} b={b} h={h}"
            for s in np.nonzero(pos[b, h] >= 0)[0]:
                np.testing.assert_allclose(
                    score[b, h, s],
                    head.held[int(pos[b, h, s])],
                    atol=ATOL,
                    rtol=ATOL,
                    err_msg=f"{what} b={b} h={h} pos={pos[b, h, s]}",
                )

    compare(first, "prefill")
    check_slot_contents(first, data, 0)
    for s, (out, st) in enumerate(trace):
        attended = {}
        for (b, h), head in heads.items():
            outs, attended[b, h] = head.decode(
                dq[s, b, h * g : (h + 1) * g], dk[s, b, h], dv[s, b, h], int(lengths[b]) + s
            )
            np.testing.assert_allclose(
                out[b, h * g : (h + 1) * g], outs, atol=ATOL, rtol=ATOL, err_msg=f"step {s} b={b} h={h}"
            )
        # The output attends over every held token including the new one, before the eviction.
        check_decode_out(out, data, s, lambda b, h: attended[b, h])
        compare(st, f"step {s}")
    check_slot_contents(trace[-1][1], data, STEPS)


# ----------------------------------------------------------------------------------------------------------
# budgets that cover the prompt are no-ops


BIG = T + MAX_NEW  # a token budget covering the prompt bucket and every generated token


@pytest.mark.parametrize(
    "name,options",
    [
        ("streaming_llm", {"budget": BIG}),
        ("h2o", {"budget": BIG}),
        ("snapkv", {"budget": BIG}),
        ("pyramidkv", {"budget": BIG}),
        ("snapkv", {"budget": 1.0}),
        ("pyramidkv", {"budget": 1.0, "kernel": 7}),
    ],
)
@pytest.mark.parametrize("hq,hkv", [(6, 2)], ids=["gqa3"])
def test_budget_covering_everything_equals_full(hq, hkv, name, options):
    _, full_trace, data = run(methods.get("full"), hq, hkv, layer=3)
    first, trace, _ = run(methods.get(name, **options), hq, hkv, layer=3)
    lengths = data[3]
    assert kept(first) == {(b, h): ref.full_keep(int(lengths[b])) for b in range(B) for h in range(hkv)}
    for s, ((out, st), (fout, _)) in enumerate(zip(trace, full_trace)):
        assert kept(st) == {(b, h): ref.full_keep(int(lengths[b]) + s + 1) for b in range(B) for h in range(hkv)}
        np.testing.assert_allclose(out, fout, atol=1e-6, rtol=1e-6, err_msg=f"step {s}")


def test_fractional_budget_one_keeps_whole_prompt():
    """budget=1.0 keeps the whole prompt for every slot-cache method with a budget (the evicting ones then evict
    during decode)."""
    slots = [n for n, c in methods.REGISTRY.items() if issubclass(c, SlotMethod) and c.budget is not None]
    assert len(slots) >= 4, slots  # streaming_llm, h2o, snapkv, pyramidkv, chunkkv
    for name in slots:
        first, _, data = run(methods.get(name, budget=1.0), 4, 2, steps=0)
        assert kept(first) == {(b, h): ref.full_keep(int(data[3][b])) for b in range(B) for h in range(2)}, name


# ----------------------------------------------------------------------------------------------------------
# memory accounting


@pytest.mark.parametrize(
    "name,options",
    [
        ("full", {}),
        ("streaming_llm", {"budget": 0.5}),
        ("h2o", {"budget": 0.5}),
        ("snapkv", {"budget": 0.5, "window": 4}),
        ("pyramidkv", {"budget": 0.5, "window": 4}),
    ],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_memory_bytes(name, options, dtype):
    hq, hkv = 4, 2
    m = methods.get(name, **options)
    st = m.init(model_cfg(hq, hkv), B, Capacity(T, MAX_NEW), 1, dtype)
    want = sum(np.asarray(x).nbytes for x in jax.tree.leaves(st))
    assert m.memory_bytes(st) == want
    q, k, v, lengths = inputs(hq, hkv)[:4]
    st2 = _jitted(m, 1)[0](
        st, jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(lengths)
    )
    assert m.memory_bytes(st2) == want  # fixed shapes: prefill does not change the footprint
    if name == "full":
        s = T + MAX_NEW
        item = np.dtype(dtype).itemsize
        pos_bytes, score_bytes, count_bytes = B * hkv * s * 4, 0, 2 * B * 4  # fill count + limit [B] int32
        assert want == 2 * B * hkv * s * D * item + pos_bytes + score_bytes + count_bytes


# ----------------------------------------------------------------------------------------------------------
# bad input


def _raises(fn, *words):
    with pytest.raises(ValueError) as info:
        fn()
    msg = str(info.value)
    for w in words:
        assert w in msg, f"message {msg!r} does not name {w!r}"


def test_unknown_method():
    _raises(lambda: methods.get("nope"), "nope", "method")


@pytest.mark.parametrize("name", ["streaming_llm", "h2o", "snapkv", "pyramidkv"])
@pytest.mark.parametrize("budget", [0.0, 1.5, 0, -3, "0.2", True, None], ids=repr)
def test_bad_budget(name, budget):
    _raises(lambda: methods.get(name, budget=budget), "budget")


@pytest.mark.parametrize("name", ["full", "streaming_llm", "h2o", "snapkv", "pyramidkv"])
def test_unknown_option(name):
    _raises(lambda: methods.get(name, bogus_option=3), "bogus_option")


@pytest.mark.parametrize(
    "name,budget,window",
    [("snapkv", 8, 8), ("snapkv", 6, 8), ("snapkv", 0.125, 8), ("pyramidkv", 8, 8), ("chunkkv", 0.125, 8)],
)
def test_window_above_budget_shrinks_to_the_budget(name, budget, window):
    """A budget at or below the window keeps the most recent ``budget`` tokens (never more, never an error)."""
    m = methods.get(name, budget=budget, window=window)
    first, _, data = run(m, 4, 2, steps=0)
    for b in range(B):
        n = int(data[3][b])
        p = ref.sequence_budget(budget, n) if isinstance(budget, float) else min(budget, n)
        for h in range(2):
            assert kept(first)[b, h] == list(range(n - p, n)), (b, h)


@pytest.mark.parametrize(
    "name,options,word",
    [
        ("snapkv", {"window": 0}, "window"),
        ("snapkv", {"kernel": 4}, "kernel"),
        ("snapkv", {"kernel": 0}, "kernel"),
        ("snapkv", {"pool": "median"}, "pool"),
        ("pyramidkv", {"beta": 0}, "beta"),
        ("h2o", {"recent": 1.0}, "recent"),
        ("h2o", {"recent": -1}, "recent"),
        ("streaming_llm", {"sinks": -1}, "sinks"),
    ],
)
def test_bad_options(name, options, word):
    _raises(lambda: methods.get(name, **options), word)


def test_streaming_sinks_shrink_below_a_small_budget():
    """budget=4 with sinks=4: 3 sinks and 1 recent token (the most recent first), never 5 tokens."""
    first, trace, data = run(methods.get("streaming_llm", budget=4, sinks=4), 4, 2, steps=2)
    for b in range(B):
        n = int(data[3][b])
        assert kept(first)[b, 0] == [0, 1, 2, n - 1]
        assert kept(trace[-1][1])[b, 0] == [0, 1, 2, n + 1]
