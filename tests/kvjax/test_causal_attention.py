"""Prefill attention (dense and query-chunked) against a numpy softmax reference."""

import jax
import numpy as np
import pytest

from kvjax import model as M
from kvjax.methods.core import select


def np_causal(q, k, v, lengths, window):
    b, hq, t, d = q.shape
    g = hq // k.shape[1]
    out = np.zeros(q.shape, np.float64)
    for i in range(b):
        for h in range(hq):
            kk, vv = k[i, h // g].astype(np.float64), v[i, h // g].astype(np.float64)
            for r in range(lengths[i]):
                cols = [s for s in range(t) if s <= r and s < lengths[i] and (window is None or r - s < window)]
                sc = kk[cols] @ q[i, h, r] / np.sqrt(d)
                w = np.exp(sc - sc.max())
                out[i, h, r] = (w / w.sum()) @ vv[cols]
    return out


def np_accumulated(q, k, lengths):
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    acc = np.zeros((b, hkv, t))
    for i in range(b):
        for h in range(hq):
            for r in range(lengths[i]):
                sc = k[i, h // g, : r + 1].astype(np.float64) @ q[i, h, r] / np.sqrt(d)
                w = np.exp(sc - sc.max())
                acc[i, h // g, : r + 1] += w / w.sum() / g
    return acc


@pytest.mark.parametrize("hq,hkv,t,window,chunk", [(4, 2, 70, None, 16), (3, 3, 64, 9, 16), (2, 1, 37, None, 64)])
def test_causal_attention_matches_numpy(hq, hkv, t, window, chunk):
    rng = np.random.default_rng(t)
    b, d = 2, 8
    q = rng.standard_normal((b, hq, t, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, t, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, t, d)).astype(np.float32)
    lengths = np.array([t, t - 11])
    got = np.asarray(jax.jit(M.causal_attention, static_argnums=(4, 5))(q, k, v, lengths, window, chunk))
    want = np_causal(q, k, v, lengths, window)
    for i in range(b):  # rows of padded queries are meaningless
        np.testing.assert_allclose(got[i, :, : lengths[i]], want[i, :, : lengths[i]], atol=1e-5)


@pytest.mark.parametrize(
    "hq,hkv,t,lengths,chunk",
    [(4, 2, 45, (45, 30), 16), (4, 2, 45, (45, 30), 7), (3, 1, 40, (40, 1, 17), 8), (2, 2, 33, (33, 0), 64)],
)
def test_accumulated_scores_chunked_matches_numpy(hq, hkv, t, lengths, chunk):
    """The (query, key)-tiled two-pass H2O scores against numpy's dense per-row softmax: several tiles on
    both axes, a ragged last tile, a 1-token and an empty sequence, and one tile covering everything."""
    rng = np.random.default_rng(t + chunk)
    q = rng.standard_normal((len(lengths), hq, t, 8)).astype(np.float32)
    k = rng.standard_normal((len(lengths), hkv, t, 8)).astype(np.float32)
    lengths = np.array(lengths)
    got = np.asarray(jax.jit(select.accumulated_scores, static_argnums=3)(q, k, lengths, chunk))
    np.testing.assert_allclose(got, np_accumulated(q, k, lengths), atol=1e-5)
