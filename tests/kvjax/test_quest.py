"""Quest against the NumPy reference in ``ref_quest.py``: prefill + decode (page min/max, pages chosen, outputs;
MHA, GQA 4/2 and 8/2, two sequences of different lengths, page boundaries crossed, fraction, count and dense
budgets), the upper bound never below the true page maximum, ``selected_positions`` = the pages attended, a
covering budget equal to full attention, layers below ``n_full`` equal to full, no retrace, end to end through
``kvjax.generate``, bytes read (hand count) and held, and bad options."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.model import attention
from kvjax import engine, methods
from kvjax.methods.base import Capacity
from kvjax.methods import quest as quest_mod
from kvjax.methods.quest import Quest, QuestState

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_quest as ref  # noqa: E402

D = 16


def model_cfg(hq, hkv, layers=2):
    return kvjax.ModelConfig(
        model_type="llama",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_layers=layers,
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=D,
    )


def run_prefill(method, hq, hkv, lengths, t, max_new, seed=0, layer=0):
    rng = np.random.default_rng(seed)
    b = len(lengths)
    q = rng.standard_normal((b, hq, t, D)).astype(np.float32)
    k = rng.standard_normal((b, hkv, t, D)).astype(np.float32)
    v = rng.standard_normal((b, hkv, t, D)).astype(np.float32)
    for bi, n in enumerate(lengths):  # padding must never be read or enter a page's min/max: make it loud
        k[bi, :, n:] = 50.0
        v[bi, :, n:] = 50.0
    state = method.init(model_cfg(hq, hkv), b, Capacity(t, max_new), layer, jnp.float32)
    state = method.prefill(state, layer, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths))
    return state, (q, k, v)


def new_token(rng, b, hq, hkv):
    return (
        rng.standard_normal((b, hq, D)).astype(np.float32),
        rng.standard_normal((b, hkv, D)).astype(np.float32),
        rng.standard_normal((b, hkv, D)).astype(np.float32),
    )


# ------------------------------------------------------------------------------------ against the reference


ROWS = [  # (id, hq, hkv, budget, lengths)
    ("mha-0.5", 4, 4, 0.5, (37, 22)),
    ("gqa2-0.5", 4, 2, 0.5, (37, 22)),
    ("gqa4-0.3", 8, 2, 0.3, (40, 29)),
    ("gqa2-count-dense-row", 4, 2, 12, (37, 5)),
    ("gqa2-0.1-below-a-page", 4, 2, 0.1, (37, 22)),
    ("mha-0.08-below-a-page", 4, 4, 0.08, (37, 9)),
]
MODES = [("one-pass", None, None), ("2-page-chunks", 2, False), ("cpu-one-product", 2, True)]


@pytest.mark.parametrize(
    "hq,hkv,budget,lengths,chunk,whole",
    [
        pytest.param(
            *row,
            chunk,
            whole,
            id=f"{name}-{mode}",
            # the one product by default on a GQA row above and below a page (the others with --runslow)
            marks=pytest.mark.slow if whole and name not in ("gqa2-0.5", "gqa2-0.1-below-a-page") else (),
        )
        for name, *row in ROWS
        for mode, chunk, whole in MODES
    ],
)
def test_prefill_decode_match_reference(hq, hkv, budget, lengths, chunk, whole, monkeypatch):
    """Page size 4, 9 decode steps (two or three page boundaries crossed). Per step: the page min/max of every
    live page (the current partial page included), the positions ``selected_positions`` announces before the
    step, the pages the step attends and its outputs all equal the reference; ``attended`` counts them (at most
    ``B_b``). The ``(37, 5)`` row at 12 tokens attends everything while its live tokens fit, then pages. Below a
    page (``B_b`` = 4 and 3 at 0.1; 3 and 1 at 0.08) the current page is cut to its most recent ``B_b`` tokens.
    Pages are scored in one pass (what these sizes and GPU/TPU get: no loop), in a loop over 2-page chunks (the
    CPU at long contexts where fewer than half the pages are candidates), or, chunked, by the CPU's one product
    over every page (``lax.cond``: at least half are)."""
    if chunk:
        monkeypatch.setattr(quest_mod, "_score_chunk", lambda h, d, itemsize, n_pages: min(chunk, n_pages))
        monkeypatch.setattr(attention, "half_live", lambda live, s: live * 0 == (0 if whole else 1))
    ps, t, steps = 4, 40, 9
    method = Quest(budget=budget, page_size=ps, n_full=0)
    state, (q, k, v) = run_prefill(method, hq, hkv, lengths, t, steps)
    assert isinstance(state, QuestState) and state.kmin.shape == (2, hkv, (t + steps + ps - 1) // ps, D)
    seqs = [ref.Sequence(k[bi], v[bi], n, page_size=ps, budget=budget) for bi, n in enumerate(lengths)]
    decode = jax.jit(lambda st, qq, kk, vv, pp: method.decode(st, 0, qq, kk, vv, pp))
    select = jax.jit(method.select_pages)
    positions = jax.jit(lambda st, qq: method.selected_positions(st, 0, qq))
    rng = np.random.default_rng(1)
    pos = np.asarray(lengths)
    g = hq // hkv
    modes = set()
    for step in range(steps):
        qn, kn, vn = new_token(rng, 2, hq, hkv)
        announced = np.asarray(positions(state, jnp.asarray(qn)))  # [B, Hq, S] before the step
        out, state = decode(state, jnp.asarray(qn), jnp.asarray(kn), jnp.asarray(vn), jnp.asarray(pos))
        pages = np.asarray(select(state, jnp.asarray(qn), jnp.asarray(pos)))
        kmin, kmax = np.asarray(state.kmin), np.asarray(state.kmax)
        for bi, seq in enumerate(seqs):
            want_pos = seq.positions(qn[bi])
            want = seq.step(qn[bi], kn[bi], vn[bi])
            np.testing.assert_allclose(np.asarray(out)[bi], want, atol=1e-5)
            for h in range(hkv):
                lo, hi = ref.page_bounds(seq.k[h], ps)
                np.testing.assert_array_equal(kmin[bi, h, : len(lo)], lo.astype(np.float32))
                np.testing.assert_array_equal(kmax[bi, h, : len(hi)], hi.astype(np.float32))
                got = sorted(int(p) for p in pages[bi, h] if p >= 0)
                assert got == seq.pages[-1][h], (step, bi, h)
                n_att = seq.attended[-1][h]
                assert n_att == method.attended(lengths[bi], step) <= method.token_budget(lengths[bi])
                if method.token_budget(lengths[bi]) >= ps:  # whole listed pages (the current one up to t)
                    assert n_att == sum(min(ps, int(pos[bi]) + 1 - p * ps) for p in got)
                modes.add(len(got) == int(pos[bi]) // ps + 1)
            for qh in range(hq):
                assert np.flatnonzero(announced[bi, qh]).tolist() == want_pos[qh], (step, bi, qh)
                np.testing.assert_array_equal(announced[bi, qh], announced[bi, (qh // g) * g])
        pos = pos + 1
    assert False in modes  # some step really selected
    assert decode._cache_size() == 1 and select._cache_size() == 1  # no retrace across steps


def test_upper_bound_never_below_the_true_page_maximum():
    """Over random keys, queries (some with zero and negative channels) and page sizes: per query head, Quest's
    bound of every page is >= max over its keys of q·k; the group mean bounds the mean query; the kernel's
    ``q⁺·kmax + q⁻·kmin`` form equals the reference's ``Σ max(q kmin, q kmax)``."""
    rng = np.random.default_rng(7)
    for trial, ps in enumerate((1, 3, 4, 16)):
        method = Quest(budget=0.5, page_size=ps, n_full=0)
        lengths = (48, 31)
        state, (_, k, _) = run_prefill(method, 4, 2, lengths, 48, 1, seed=trial)
        for _ in range(3):
            qn = (rng.standard_normal((2, 4, D)) * rng.choice([0.0, 1.0, 3.0], size=(2, 4, D))).astype(np.float32)
            u = np.asarray(method.page_scores(state, jnp.asarray(qn)))  # [B, Hkv, G, P]
            for bi, n in enumerate(lengths):
                for qh in range(4):
                    h, gi = qh // 2, qh % 2
                    lo, hi = ref.page_bounds(k[bi, h, :n], ps)
                    np.testing.assert_allclose(
                        u[bi, h, gi, : len(lo)], ref.upper_bound(qn[bi, qh], lo, hi), rtol=1e-5, atol=1e-4
                    )
                    for j in range(len(lo)):
                        true = (k[bi, h, j * ps : min((j + 1) * ps, n)].astype(np.float64) @ qn[bi, qh]).max()
                        assert u[bi, h, gi, j] >= true - 1e-4
                for h in range(2):
                    qm = qn[bi, 2 * h : 2 * h + 2].astype(np.float64).mean(0)
                    for j in range(-(-n // ps)):
                        true = (k[bi, h, j * ps : min((j + 1) * ps, n)].astype(np.float64) @ qm).max()
                        assert u[bi, h, :, j].mean() >= true - 1e-4


# ------------------------------------------------------------------------------------ full equivalences


def test_covering_budget_equals_full_attention():
    """A count covering every live token (n + steps + 1) and ``n_full = 0``: every step equals Full's."""
    hq, hkv, lengths, t, steps = 4, 2, (30, 17), 32, 6
    quest = Quest(budget=t + steps, page_size=4, n_full=0)
    full = methods.get("full")
    sq, (q, k, v) = run_prefill(quest, hq, hkv, lengths, t, steps)
    sf = full.init(model_cfg(hq, hkv), 2, Capacity(t, steps), 0, jnp.float32)
    sf = full.prefill(sf, 0, *(jnp.asarray(x) for x in (q, k, v)), jnp.asarray(lengths))
    rng = np.random.default_rng(3)
    pos = jnp.asarray(lengths)
    for step in range(steps):
        qn, kn, vn = (jnp.asarray(x) for x in new_token(rng, 2, hq, hkv))
        oq, sq = quest.decode(sq, 0, qn, kn, vn, pos)
        of, sf = full.decode(sf, 0, qn, kn, vn, pos)
        np.testing.assert_allclose(np.asarray(oq), np.asarray(of), atol=1e-5)
        assert all(quest.attended(n, step) == n + step + 1 for n in lengths)
        pos = pos + 1


def test_layers_below_n_full_are_full():
    """``n_full = 1`` is a per-layer plan: ``at(0)`` is ``full`` (the engine builds and runs layer 0 as a full
    layer: tests/kvjax/test_layers.py), ``at(1)`` Quest itself; building layer 0 from Quest directly is refused
    with the fix, since it would compress a layer the plan keeps full."""
    quest = Quest(budget=0.25, page_size=4, n_full=1)
    assert quest.at(0) == methods.get("full") and quest.at(1) is quest and quest.at(5) is quest
    with pytest.raises(ValueError, match=r"n_full=1 full layers: build and run it with method.at\(0\)"):
        quest.init(model_cfg(4, 2), 2, Capacity(32, 4), 0, jnp.float32)
    s1, _ = run_prefill(quest, 4, 2, (30, 17), 32, 4, layer=1)
    assert isinstance(s1, QuestState)


# ------------------------------------------------------------------------------------ end to end


# the sizes and seed of the tiny fixture's model (tests/conftest.py)
pytestmark = pytest.mark.tiny(intermediate_size=64, max_position_embeddings=4096, seed=0, scale=1.0)


def prompts(lengths, seed=0):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(2, 60, size=n)) for n in lengths]


def test_generate_end_to_end(tiny):
    """On the 2-layer model: the default ``n_full = 2`` and budget 1.0 are full attention (greedy tokens equal
    full's); with ``n_full = 0`` a count covering prompt + generation equals full; a compressing budget runs,
    holds every token, reads fewer bytes than full, and other prompt lengths in the same bucket do not retrace."""
    ps = prompts([40, 23])
    kw = dict(max_new_tokens=8, driver="scan", stop_at_eos=False)
    full = engine.generate(tiny, ps, "full", **kw)
    assert engine.generate(tiny, ps, methods.get("quest", budget=1.0), **kw).tokens == full.tokens
    cover = methods.get("quest", budget=64, page_size=4, n_full=0)
    assert engine.generate(tiny, ps, cover, **kw).tokens == full.tokens
    method = methods.get("quest", budget=0.25, page_size=4, n_full=0)
    res = engine.generate(tiny, ps, method, **kw)
    assert [len(t) for t in res.tokens] == [8, 8]
    for n, st, fst in zip((40, 23), res.stats, full.stats):
        assert st["tokens_held"] == n + 7 and st["tokens_held_prefill"] == n
        assert st["cache_bytes"] > fst["cache_bytes"]  # the KV plus page metadata
        assert st["bytes_read_per_step"] < fst["bytes_read_per_step"]
    before = dict(engine.TRACE_COUNTS)
    engine.generate(tiny, prompts([57, 33], seed=1), method, **kw)  # same bucket (64), other lengths
    assert dict(engine.TRACE_COUNTS) == before


# ------------------------------------------------------------------------------------ accounting


def test_bytes_read_and_memory():
    """memory_bytes is every leaf (KV + page min/max + counts). bytes_read_per_step is a hand count: the min/max
    of the pages the scoring loop reads (here its one chunk: every page) and of the current page (its update),
    the float32 page scores top-k reads, and ``P`` K/V rows per page the
    kernel visits (``pages_b`` pages, or every live page for a dense row), query and outputs; a row below one
    page lists no page and its window call reads one block of ``P`` rows of the gathered window buffer (the
    window call's query and outputs counted too)."""
    hq, hkv, ps, t, new = 4, 2, 4, 64, 16
    method = Quest(budget=0.25, page_size=ps, n_full=0)
    lengths = (60, 10)  # B = 15 -> 3 pages; B = 3 -> below one page: the current page's 3 most recent tokens
    st, _ = run_prefill(method, hq, hkv, lengths, t, new)
    s, n_pages, item = t + new, (t + new) // ps, 4
    assert method.memory_bytes(st) == 2 * 2 * hkv * s * D * item + 2 * 2 * hkv * n_pages * D * item + 2 * 4 + 2 * 4
    dec = jax.jit(lambda st, q, k, v, p: method.decode(st, 0, q, k, v, p))
    rng = np.random.default_rng(0)
    for step in range(3):
        filled = np.asarray(st.filled)
        rows, win, meta = 0, 0, 0
        for n, f in zip(lengths, filled):
            pages_b = max(-(-n // 4) // ps, 1)  # ceil(0.25 n) // P
            cur = f // ps
            dense = f + 1 <= -(-n // 4) or cur + 1 <= pages_b
            if -(-n // 4) < ps:  # below one page: the window buffer's one block
                win += hkv * ps
            else:
                rows += hkv * ps * ((cur + 1) if dense else pages_b)
            meta += hkv * 2 * (n_pages + 1) * D * item  # one scoring chunk of all 20 pages, the current page
        q_out = 2 * hq * D * item + 2 * hq * (D + 2) * 4
        want = meta + 2 * hkv * n_pages * 4 + rows * 2 * D * item + win * 2 * D * item + 2 * q_out
        br = method.bytes_read_breakdown(st, hq)
        assert (br["metadata"], br["scores"], br["attention"], br["window"]) == (
            meta,
            2 * hkv * n_pages * 4,
            rows * 2 * D * item + q_out,
            win * 2 * D * item + q_out,
        )
        got = method.bytes_read_per_step(st, hq)
        assert got == want and isinstance(got, int)
        assert want < br["full_kv"]
        _, st = dec(st, *(jnp.asarray(x) for x in new_token(rng, 2, hq, hkv)), jnp.asarray(filled))
        np.testing.assert_array_equal(np.asarray(method.tokens_held(st)), filled + 1.0)
    assert method.held(1000, 7) == 1007


def test_attended_and_budgets():
    m = Quest(budget=1024)  # the default: 64 pages of 16
    assert (m.budget, m.page_size, m.n_full) == (1024, 16, 2) and m.recalls
    assert m.attended(1000, 0) == 1001 and m.attended(1023, 0) == 1024  # live tokens fit: everything
    assert m.attended(2000, 5) == 63 * 16 + 2005 % 16 + 1
    assert m.attended(3000, 0) <= 1024
    f = Quest(budget=0.2, page_size=16)
    assert f.token_budget(1000) == 200 and f.page_budget(1000) == 12
    assert f.attended(1000, 3) == 11 * 16 + 1003 % 16 + 1
    assert Quest(budget=0.01, page_size=16).page_budget(100) == 1  # at least the current page
    # below one page (B_b = 1, 10): the current page's most recent min(B_b, t mod 16 + 1) tokens, never > B_b
    assert Quest(budget=0.01, page_size=16).attended(100, 0) == 1
    g = Quest(budget=0.1, page_size=16)
    assert [g.attended(100, s) for s in (0, 5, 6, 11, 12, 28)] == [5, 10, 10, 10, 1, 1]  # t = 100 ... 128
    assert [g.attended(20, s) for s in (0, 1, 2, 12, 13)] == [2, 2, 2, 1, 2]  # B_b = 2: t = 20 ... 33
    assert Quest(budget=0.1, page_size=4).attended(5, 0) == 1 and Quest(budget=0.1, page_size=4).attended(2, 0) == 1
    np.testing.assert_array_equal(np.asarray(f.page_budget(jnp.asarray([1000, 79, 80]))), [12, 1, 1])


def test_one_page_budget():
    """``budget = page_size``: no candidate page is ever kept (static top-k size 0), each step attends its current
    page only, as the reference; the metadata read is the current page's min/max."""
    method = Quest(budget=4, page_size=4, n_full=0)
    lengths = (13, 8)
    st, (_, k, v) = run_prefill(method, 4, 2, lengths, 16, 4)
    assert st.topk == 0
    seqs = [ref.Sequence(k[bi], v[bi], n, page_size=4, budget=4) for bi, n in enumerate(lengths)]
    rng = np.random.default_rng(5)
    for _ in range(4):
        br = method.bytes_read_breakdown(st, 4)
        assert br["metadata"] == 2 * 2 * 2 * D * 4 and br["scores"] == 0
        qn, kn, vn = new_token(rng, 2, 4, 2)
        out, st = method.decode(st, 0, *(jnp.asarray(x) for x in (qn, kn, vn)), st.filled)
        for bi, seq in enumerate(seqs):
            np.testing.assert_allclose(np.asarray(out)[bi], seq.step(qn[bi], kn[bi], vn[bi]), atol=1e-5)
            assert seq.pages[-1] == [[(len(seq.k[0]) - 1) // 4]] * 2


def test_bad_options():
    for bad in (0, -1, 2.5, True, None):
        with pytest.raises(ValueError, match="page_size"):
            Quest(page_size=bad)
    with pytest.raises(ValueError, match="budget=8 tokens is less than one page of page_size=16"):
        Quest(budget=8)
    Quest(budget=8, page_size=8)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="n_full"):
            Quest(n_full=bad)
    for bad in (0, 1.5, float("nan"), "0.2"):
        with pytest.raises(ValueError, match="budget"):
            methods.get("quest", budget=bad)
    with pytest.raises(ValueError, match="no option"):
        methods.get("quest", chunk_size=16)
