"""ClusterKV against the float64 numpy reference (``ref_clusterkv``) and its invariants.

- K-means (cosine, mean of raw keys, empty keeps, convergence stop) equals the reference from the same init rows.
- One layer through prefill and decode (MHA, GQA 4/2 and 8/2, a batch of 2 with different lengths, both GQA
  rules, windows clustered during decode): the attended positions and the outputs of every step equal the
  reference's.
- The cluster-sorted layout: every token in exactly one cluster, prompt and windows, positions ascending inside.
- One token per cluster selects exactly the top-``bsel`` tokens by ``q·k``; a budget >= the prompt equals full.
- No retrace through decode-time clustering; layers < n_full are full; end to end through ``generate``.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import engine, methods
from kvjax.methods.base import Capacity, LayerContext
from kvjax.methods.clusterkv import index as cluster_index
from kvjax.methods.clusterkv.index import cosine_kmeans
from kvjax.methods.clusterkv import ClusterKV
from tiny_models import tiny_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_clusterkv as ref  # noqa: E402

LAYER = 3  # a compressed layer (n_full=0 in most tests)


def _cfg(hq, hkv, d=16, layers=2):
    return tiny_config(num_layers=layers, num_heads=hq, num_kv_heads=hkv, head_dim=d)


def _clustered_keys(rng, shape, centers=6, noise=0.15, outliers=True):
    """Keys around a few directions (well separated, so float32 and float64 K-means agree), with outlier
    channels of large magnitude as real keys have (method note ``docs/notes/clusterkv.md`` §2.2)."""
    *lead, t, d = shape
    c = rng.normal(size=(*lead, centers, d))
    lab = rng.integers(0, centers, size=(*lead, t))
    x = np.take_along_axis(c, lab[..., None], axis=-2) * rng.uniform(0.5, 2.0, size=(*lead, t, 1))
    x = x + noise * rng.normal(size=(*lead, t, d))
    if outliers:
        x[..., 0] *= 8.0
    return x.astype(np.float32)


@pytest.fixture(params=["cpu", "accelerator"])
def kmeans_path(request, monkeypatch):
    """The CPU's K-means (row tiles, segment sums) or the GPU/TPU one (one block of rows, one-hot matmul sums),
    forced here; the decode path stays the CPU's."""
    from kernels_pallas.cosine_kmeans import _common

    if request.param == "accelerator":
        monkeypatch.setattr(_common, "accelerated", lambda: True)
    yield request.param
    jax.clear_caches()  # no program traced with the forced path is reused by later tests


def test_kmeans_equals_the_reference(kmeans_path):
    rng = np.random.default_rng(0)
    x = _clustered_keys(rng, (3, 120, 16))
    m = ClusterKV(budget=64, sink=0, seed=5)
    valid = np.ones((3, 120), bool)
    valid[1, 90:] = False  # a ragged row
    pos = np.broadcast_to(np.arange(120), (3, 120))
    init = np.asarray(cluster_index.init_rows(m.seed, 0, 1, jnp.asarray(pos), jnp.asarray(valid), 7))[:, 0]  # [3, 7]
    c0 = np.take_along_axis(x, init[..., None], axis=1)
    mu, labels, _ = cosine_kmeans(jnp.asarray(x), jnp.asarray(valid), jnp.asarray(c0), jnp.ones((3, 7), bool), 20)
    for n in range(3):
        nv = int(valid[n].sum())
        assert len(set(init[n].tolist())) == 7 and init[n].max() < nv  # distinct valid rows
        rmu, rlab = ref.cosine_kmeans(x[n, :nv], init[n], 20)
        np.testing.assert_array_equal(np.asarray(labels)[n, :nv], rlab)
        assert np.all(np.asarray(labels)[n, nv:] == 7)  # invalid rows get the sentinel
        np.testing.assert_allclose(np.asarray(mu)[n], rmu, rtol=1e-4, atol=1e-4)


def _run_layer(method, hq, hkv, lengths, steps, seed=0, d=16, bucket=48):
    """Prefill + ``steps`` decode steps of one compressed layer for every row; returns the per-step outputs,
    the positions ``selected_positions`` reported before each step, the final state and the inputs."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    cfg = _cfg(hq, hkv, d)
    k = _clustered_keys(rng, (b, hkv, bucket + steps, d))
    v = rng.normal(size=(b, hkv, bucket + steps, d)).astype(np.float32)
    q = (rng.normal(size=(b, hq, bucket + steps, d)) * 0.5).astype(np.float32)
    st = method.init(cfg, b, Capacity(bucket, steps + 1), LAYER, jnp.float32)
    st = jax.jit(lambda s, *a: method.prefill(s, LAYER, *a))(
        st,
        jnp.asarray(q[:, :, :bucket]),
        jnp.asarray(k[:, :, :bucket]),
        jnp.asarray(v[:, :, :bucket]),
        jnp.asarray(lengths, jnp.int32),
    )
    dec = jax.jit(lambda s, qq, kk, vv, p: method.decode(s, LAYER, qq, kk, vv, p))
    sel = jax.jit(lambda s, qq: method.selected_positions(s, LAYER, qq))
    # decode token i of row r sits at position n_r + i; its q/k/v are column bucket + i of the inputs
    kd, vd, qd = k[:, :, bucket:], v[:, :, bucket:], q[:, :, bucket:]
    outs, sels, states = [], [], [st]
    for i in range(steps):
        pos = jnp.asarray([n + i for n in lengths], jnp.int32)
        sels.append(np.asarray(sel(st, jnp.asarray(qd[:, :, i]))))
        o, st = dec(st, jnp.asarray(qd[:, :, i]), jnp.asarray(kd[:, :, i]), jnp.asarray(vd[:, :, i]), pos)
        outs.append(np.asarray(o))
        states.append(st)
    assert dec._cache_size() == 1  # no retrace, window clustering included
    return outs, sels, states, (q, k, v, kd, vd, qd), bucket


@pytest.mark.parametrize("hq,hkv,gqa", [(2, 2, "query"), (4, 2, "query"), (8, 2, "query"), (4, 2, "group_mean")])
def test_decode_equals_the_reference(hq, hkv, gqa):
    check_decode_equals_the_reference(hq, hkv, gqa)


def test_decode_equals_the_reference_with_the_accelerator_kmeans(monkeypatch):
    """The GPU/TPU K-means (forced) inside the method: prefill and decode-time window clustering, every output and
    every attended position against the numpy reference."""
    from kernels_pallas.cosine_kmeans import _common

    monkeypatch.setattr(_common, "accelerated", lambda: True)
    try:
        check_decode_equals_the_reference(4, 2, "query")
    finally:
        jax.clear_caches()


def check_decode_equals_the_reference(hq, hkv, gqa):
    lengths, steps = [45, 29], 11
    m = ClusterKV(
        budget=0.5, sink=3, tokens_per_cluster=6, window=4, window_clusters=2, n_full=0, gqa=gqa, iters=20, seed=1
    )
    outs, sels, states, (q, k, v, kd, vd, qd), bucket = _run_layer(m, hq, hkv, lengths, steps)
    g = hq // hkv
    st0 = states[1]  # after the first decode step the prompt part of the state is final
    for r, n in enumerate(lengths):
        sink, bsel = m.split(n)
        ncl = m.clusters_for(n)
        assert int(st0.sinks[r]) == sink and int(st0.bsel[r]) == bsel
        prompt_init = np.asarray(
            cluster_index.init_rows(
                m.seed,
                LAYER,
                hkv,
                jnp.arange(bucket)[None],
                (jnp.arange(bucket)[None] >= sink) & (jnp.arange(bucket)[None] < n),
                st0.c0,
            )
        )[0]
        for h in range(hkv):
            kk = np.concatenate([k[r, h, :n], kd[r, h]])
            vv = np.concatenate([v[r, h, :n], vd[r, h]])
            rk = ref.ClusterKVRef(kk, vv, n, sink, bsel, m.window, m.iters, gqa)
            rk.add_clusters(sink, n, prompt_init[h, :ncl] - sink)
            windows = 0

            def init_fn(lo, hi, w=None):
                nonlocal windows
                rows = np.asarray(
                    cluster_index.init_rows(
                        m.seed,
                        cluster_index.window_stream(LAYER, windows),
                        hkv,
                        jnp.arange(lo, hi)[None],
                        jnp.ones((1, hi - lo), bool),
                        m.window_clusters,
                    )
                )[0, h]
                windows += 1
                return rows

            for i in range(steps):
                t = n + i
                qs = qd[r, h * g : (h + 1) * g, i]
                want, att = rk.step(qs, t)
                got_sel = sels[i][r, h * g : (h + 1) * g]
                for gi in range(g):
                    assert sorted(np.flatnonzero(got_sel[gi]).tolist() + [t]) == att[gi], (r, h, i, gi)
                np.testing.assert_allclose(outs[i][r, h * g : (h + 1) * g], want, rtol=2e-5, atol=2e-5)
                rk.after_step(t, init_fn)
            assert windows == steps // m.window


def test_cluster_layout_invariants():
    lengths, steps = [45, 29], 13
    m = ClusterKV(budget=0.5, sink=3, tokens_per_cluster=6, window=4, window_clusters=2, n_full=0)
    _, _, states, _, _ = _run_layer(m, 4, 2, lengths, steps)
    st = states[-1]
    pos, size, start = np.asarray(st.pos), np.asarray(st.csize), np.asarray(st.cstart)
    for r, n in enumerate(lengths):
        sink = m.split(n)[0]
        windows = steps // m.window
        assert int(st.windows) == windows and int(st.clustered[r]) == n + windows * m.window
        for h in range(2):
            np.testing.assert_array_equal(pos[r, h, :sink], np.arange(sink))
            seen = []
            for c in np.flatnonzero(size[r, h]):
                seg = pos[r, h, start[r, h, c] : start[r, h, c] + size[r, h, c]]
                assert np.all(np.diff(seg) > 0)  # positions ascending inside a cluster
                seen.extend(seg.tolist())
            # every clustered token in exactly one cluster: the prompt after the sinks and each full window
            assert sorted(seen) == list(range(sink, n + windows * m.window))
            assert np.sum(size[r, h, : st.c0]) == n - sink and np.sum(size[r, h]) == n - sink + windows * m.window
            assert np.sum(size[r, h, st.c0 :] > 0) <= windows * m.window_clusters
            # the unclustered window holds its own positions
            np.testing.assert_array_equal(
                pos[r, h, n + windows * m.window : n + steps], np.arange(n + windows * m.window, n + steps)
            )


@pytest.mark.parametrize("gqa", ["query", "group_mean"])
def test_one_token_per_cluster_selects_the_exact_top_b(gqa):
    """Singleton clusters (mu = k): each query head (``query``), or the group's mean query (``group_mean``),
    selects exactly its top-``bsel`` tokens by ``q·k``."""
    n, bucket, hq, hkv = 40, 40, 4, 2
    m = ClusterKV(budget=12, sink=2, tokens_per_cluster=1, n_full=0, window=8, window_clusters=1, gqa=gqa)
    rng = np.random.default_rng(3)
    k = rng.normal(size=(1, hkv, bucket, 16)).astype(np.float32)
    q = rng.normal(size=(1, hq, bucket, 16)).astype(np.float32)
    st = m.init(_cfg(hq, hkv), 1, Capacity(bucket, 2), LAYER, jnp.float32)
    st = jax.jit(lambda s, *a: m.prefill(s, LAYER, *a))(
        st, jnp.asarray(q), jnp.asarray(k), jnp.asarray(k), jnp.asarray([n], jnp.int32)
    )
    assert np.all(np.asarray(st.csize)[..., : n - 2] == 1)  # singleton clusters: mu = k
    qn = rng.normal(size=(1, hq, 16)).astype(np.float32)
    sel = np.asarray(m.selected_positions(st, LAYER, jnp.asarray(qn)))[0]
    for hh in range(hq):
        qs = qn[0, hh] if gqa == "query" else qn[0, (hh // 2) * 2 : (hh // 2) * 2 + 2].astype(np.float64).mean(0)
        s = k[0, hh // 2, 2:n] @ qs
        top = set((2 + np.argsort(-s, kind="stable")[:10]).tolist())
        assert set(np.flatnonzero(sel[hh]).tolist()) == top | {0, 1}


@pytest.mark.parametrize("gqa", ["query", pytest.param("group_mean", marks=pytest.mark.slow)])
def test_budget_covering_the_prompt_equals_full(gqa):
    lengths, steps = [45, 29], 9
    # a token count covers the generated tokens once clustered (a fraction 1.0 covers the prompt only)
    m = ClusterKV(budget=100, sink=3, tokens_per_cluster=6, window=4, window_clusters=2, n_full=0, gqa=gqa)
    outs, _, _, (q, k, v, kd, vd, qd), bucket = _run_layer(m, 4, 2, lengths, steps)
    full = methods.get("full")
    cfg = _cfg(4, 2)
    st = full.init(cfg, 2, Capacity(bucket, steps + 1), LAYER, jnp.float32)
    st = full.prefill(
        st,
        LAYER,
        jnp.asarray(q[:, :, :bucket]),
        jnp.asarray(k[:, :, :bucket]),
        jnp.asarray(v[:, :, :bucket]),
        jnp.asarray(lengths, jnp.int32),
    )
    for i in range(steps):
        o, st = full.decode(
            st,
            LAYER,
            jnp.asarray(qd[:, :, i]),
            jnp.asarray(kd[:, :, i]),
            jnp.asarray(vd[:, :, i]),
            jnp.asarray([n + i for n in lengths], jnp.int32),
        )
        np.testing.assert_allclose(outs[i], np.asarray(o), rtol=1e-5, atol=1e-5)


def test_host_sizes():
    m = ClusterKV(budget=0.25, sink=16)
    assert (
        m.split(1000) == (16, 234)
        and m.split(10) == (3, 0)
        and m.split(10, 50) == (3, 0)
        and m.clusters_for(1000) == (1000 - 16) // 80
    )
    assert m.clusters_for(20) == 1 and m.held(100, 7) == 107
    m2 = ClusterKV(budget=100, sink=4, window=8)
    assert m2.split(50) == (4, 46) and m2.split(50, 60) == (4, 96)
    # sinks + min(bsel, clustered) + unclustered window + the new token
    assert m2.attended(50, 0) == 4 + 46 + 0 + 1 and m2.attended(500, 11) == 4 + 96 + 3 + 1
    assert m2.attended(50, 19, LayerContext(capacity=Capacity(50, 40))) == 4 + 46 + 16 + 3 + 1


# the sizes and seed of the tiny fixture's model (tests/conftest.py)
pytestmark = pytest.mark.tiny(num_layers=3)


def test_generate_end_to_end(tiny):
    ids = [[int(x) for x in np.random.default_rng(s).integers(1, 64, n)] for s, n in ((0, 70), (1, 33))]
    small = dict(sink=2, tokens_per_cluster=8, window=4, window_clusters=2, n_full=1)
    full = kvjax.generate(tiny, ids, methods.get("full"), max_new_tokens=12, driver="scan", stop_at_eos=False)
    same = kvjax.generate(
        tiny, ids, methods.get("clusterkv", budget=200, **small), max_new_tokens=12, driver="scan", stop_at_eos=False
    )
    assert same.tokens == full.tokens
    assert same.stats[0]["tokens_held"] == 70 + 11 and same.stats[1]["tokens_held"] == 33 + 11
    # other prompt lengths in the same bucket: no new trace of prefill or the decode loop
    engine.TRACE_COUNTS.clear()
    ids2 = [ids[0][:65], ids[1][:40]]
    kvjax.generate(
        tiny, ids2, methods.get("clusterkv", budget=200, **small), max_new_tokens=12, driver="scan", stop_at_eos=False
    )
    assert sum(engine.TRACE_COUNTS.values()) == 0, dict(engine.TRACE_COUNTS)


def test_bytes_read_follow_the_live_tokens_not_the_bucket():
    """What a step reads depends on the sequence (its clusters, budget and window), not on the bucket or the
    decode capacity, and is far below full's for a long prompt; offload is refused on CPU."""
    m = ClusterKV(budget=32, sink=4, tokens_per_cluster=8, window=8, window_clusters=2, n_full=0)
    rng = np.random.default_rng(0)
    n = 200
    reads = []
    for bucket, new in ((256, 8), (512, 64)):
        k = jnp.asarray(_clustered_keys(rng, (1, 2, bucket, 16)))
        q = jnp.zeros((1, 4, bucket, 16))
        st = m.init(_cfg(4, 2), 1, Capacity(bucket, new), LAYER, jnp.float32)
        st = jax.jit(lambda s, *a: m.prefill(s, LAYER, *a))(st, q, k, k, jnp.asarray([n], jnp.int32))
        reads.append(m.bytes_read_per_step(st, 4))
        full = methods.get("full")
        fs = full.prefill(
            full.init(_cfg(4, 2), 1, Capacity(bucket, new), LAYER, jnp.float32),
            LAYER,
            q,
            k,
            k,
            jnp.asarray([n], jnp.int32),
        )
        assert reads[-1] < 0.5 * full.bytes_read_per_step(fs, 4)
    assert reads[0] == reads[1]
    with pytest.raises(ValueError, match="offload=True is not supported on the CPU backend"):
        ClusterKV(offload=True, n_full=0).init(_cfg(4, 2), 1, Capacity(32, 4), 0, jnp.float32)


def test_layers_below_n_full_are_full():
    """``n_full`` is a per-layer plan (base.Method.at): layers below it are ``full``'s, built and measured as such
    by every caller; ClusterKV itself refuses to build one (tests/kvjax/test_layers.py runs the plan end to end)."""
    m = ClusterKV(budget=8, sink=2, n_full=2)
    assert m.at(0) == m.at(1) == methods.get("full") and m.at(2) is m
    st = m.at(1).init(_cfg(4, 2), 1, Capacity(32, 4), 1, jnp.float32)
    assert type(st).__name__ == "SlotCache"
    with pytest.raises(ValueError, match=r"method.at\(1\)"):
        m.init(_cfg(4, 2), 1, Capacity(32, 4), 1, jnp.float32)


@pytest.mark.parametrize(
    "opts,match",
    [
        (dict(budget=8, sink=16), "budget=8 tokens is below sink=16"),
        (dict(tokens_per_cluster=0), "tokens_per_cluster=0"),
        (dict(num_clusters=0), "num_clusters=0"),
        (dict(iters=0), "iters=0"),
        (dict(window=0), "window=0"),
        (dict(window=4, window_clusters=5), "window_clusters=5"),
        (dict(gqa="max"), "gqa='max'"),
        (dict(budget=1.5), "budget=1.5"),
        (dict(impl="cuda"), "impl='cuda'"),
    ],
)
def test_bad_options(opts, match):
    with pytest.raises(ValueError, match=match):
        methods.get("clusterkv", **opts)


def test_more_clusters_than_tokens():
    with pytest.raises(ValueError, match="num_clusters=40 is more clusters than the 16 clustered tokens"):
        ClusterKV(num_clusters=40, n_full=0).init(_cfg(4, 2), 1, Capacity(32, 4), 0, jnp.float32)


@pytest.mark.parametrize("gqa", ["query", "group_mean"])
def test_decode_step_copies_no_cache_buffer(gqa):
    """The compiled, donated decode step, window clustering compiled in (a ``while_loop`` of 0 or 1 rounds), holds
    no ``copy`` of a buffer with the slot axis (K, V, positions): the new token, the runs' attention and the
    window's in-place permutation all work on the donated buffers (a branch that copies them is a defect)."""
    import re

    m = ClusterKV(budget=32, sink=4, tokens_per_cluster=8, window=8, window_clusters=2, n_full=0, gqa=gqa)
    n, new = 200, 40
    st = m.init(_cfg(8, 2), 1, Capacity(n, new), LAYER, jnp.float32)
    step = jax.jit(lambda s, q, k, v, p: m.decode(s, LAYER, q, k, v, p), donate_argnums=0)
    text = (
        step.lower(st, jnp.zeros((1, 8, 16)), jnp.zeros((1, 2, 16)), jnp.zeros((1, 2, 16)), jnp.array([n]))
        .compile()
        .as_text()
    )
    assert text.count(" while(") >= 2  # the window clustering (and its K-means) is compiled in
    copies = [
        line.strip()[:120]
        for line in text.splitlines()
        if re.search(r"= \w+\[[\d,]*\b%d\b[\d,]*\]\S* copy\(" % (n + new), line)
    ]
    assert not copies, copies
