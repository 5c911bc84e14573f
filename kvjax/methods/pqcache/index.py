"""PQCache's index of one layer's keys (paper §3.1, §3.3; method note ``docs/notes/pqcache.md`` §2.3, §8.4): the
codebooks fit by K-means on the prompt, each slot's codes, and the candidates counted per code tuple (the score
table's histogram, :mod:`kvjax.methods.pqcache.retrieval`).

Shapes: keys ``k [B, Hkv, T, D]``; codes ``[B, Hkv, m, S_c]`` uint8, sub-space-major (the layout the PQ-lookup
kernels read); centroids ``[B, Hkv, m, K, D/m]`` float32 with ``K = 2^bits`` (``kc`` below); hist ``[B, Hkv, K^m]``
int32. A code tuple is ``sum_i c_i K^(m-1-i)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.methods.core import kmeans as km
from kvjax.methods.base import rows_at


def fit(k, lengths, *, sink: int, m: int, kc: int, seed: int, iters: int):
    """``(centroids [B, Hkv, m, K, D/m], codes [B, Hkv, m, T])`` of the prompt's keys ``k [B, Hkv, T, D]``: K-means
    per sub-space on the tokens ``[sink, lengths[b])`` (note §2.3, A3 resolved: the sinks are not fit), from ``kc``
    rows sampled with ``seed``, ``iters`` Lloyd rounds; every slot's code, the nearest centroid."""
    b, h, t, d = k.shape
    dm = d // m
    pos = jnp.arange(t)
    valid = (pos[None, :] >= sink) & (pos[None, :] < lengths[:, None])  # [B, T]
    x = k.astype(jnp.float32).reshape(b, h, t, m, dm).transpose(0, 1, 3, 2, 4)  # [B, Hkv, m, T, dm]
    init = km.init_rows(jax.random.PRNGKey(seed), valid, kc)  # [B, K]
    c0 = jnp.take_along_axis(x, init[:, None, None, :, None], axis=3)  # [B, Hkv, m, K, dm]
    return km.kmeans(x, valid[:, None, None, :], c0, iters)  # labels [B, Hkv, m, T]


def encode(centroids, k) -> jnp.ndarray:
    """Codes ``[B, Hkv, m]`` uint8 of keys ``k [B, Hkv, D]``: nearest frozen centroid per sub-space."""
    b, h, d = k.shape
    m = centroids.shape[2]
    x = k.astype(jnp.float32).reshape(b, h, m, 1, d // m)
    return km.assign(x, centroids)[..., 0].astype(jnp.uint8)


def write_codes(codes, t, code):
    """``codes [B, Hkv, m, S_c]`` with slot ``t [B]`` set to ``code [B, Hkv, m]`` (in place; out of range:
    dropped)."""
    one = lambda row, tb, cb: row.at[:, :, tb].set(cb, mode="drop")  # noqa: E731
    return jax.vmap(one)(codes, t, code.astype(codes.dtype))


def tuples(codes, kc: int) -> jnp.ndarray:
    """Code tuple index ``sum_i c_i K^(m-1-i)`` int32 ``[..., N]`` of codes ``[..., m, N]``."""
    u = codes[..., 0, :].astype(jnp.int32)
    for i in range(1, codes.shape[-2]):
        u = u * kc + codes[..., i, :].astype(jnp.int32)
    return u


def histogram(codes, hist, s: int, sink: int, end, kc: int) -> jnp.ndarray:
    """``[B, Hkv, K^m]`` int32 (the shape of ``hist``): candidates ``[sink, end[b])`` of the first ``s`` slots per
    code tuple (one scatter-add, at prefill)."""
    u = tuples(codes[..., :s], kc)  # [B, Hkv, S]
    j = jnp.arange(s)
    cand = ((j[None, :] >= sink) & (j[None, :] < end[:, None])).astype(jnp.int32)  # [B, S]
    return rows_at(jnp.zeros_like(hist), u, cand[:, None, :], "add")


def tuple_at(codes, p, kc: int) -> jnp.ndarray:
    """``[B, Hkv]`` tuple of the codes at slot ``p [B]`` (clipped into the buffer)."""
    c = jax.vmap(lambda row, pb: jax.lax.dynamic_slice_in_dim(row, pb, 1, axis=2))(codes, p)  # [B, Hkv, m, 1]
    return tuples(c, kc)[..., 0]


def advance(codes, hist, hist_end, end, kc: int) -> jnp.ndarray:
    """``hist`` counted over ``[sink, hist_end)`` -> over ``[sink, end)``: one count added (or removed) per slot
    between the two ends, a loop of ``max |end - hist_end|`` steps (one per decode step)."""
    lo, hi = jnp.minimum(hist_end, end), jnp.maximum(hist_end, end)
    sign = jnp.where(end >= hist_end, 1, -1).astype(jnp.int32)

    def body(i, hst):
        p = lo + i
        add = jnp.where(p < hi, sign, 0)[:, None]  # [B, 1]
        return rows_at(hst, tuple_at(codes, p, kc), add, "add")

    return jax.lax.fori_loop(0, jnp.max(hi - lo), body, hist)
