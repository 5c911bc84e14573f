"""Prefill scoring and selection shared by the score-based methods (SnapKV, PyramidKV, H2O, ChunkKV).

Formulas follow the papers' harness (``docs/notes/chunkkv.md`` section 4): softmax attention in float32,
GQA aggregated as the mean over the query heads of each KV group, per-KV-head top-k over the prefix
``[0, len - w)`` plus the last ``w`` tokens always kept, kept tokens in position order, and no compression
for a sequence whose length is within its budget. Ties in top-k go to the lower position (``lax.top_k``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.attention import NEG_INF
from kvjax.methods.base import top_k


def window_scores(q, k, lengths, window: int) -> jnp.ndarray:
    """SnapKV observation-window votes ``[B, Hkv, T]`` float32.

    Softmax of the last ``window`` real queries of each sequence over all its keys (causal inside the
    window), summed over those queries, averaged over each KV group's query heads (SnapKV §4.2, Alg. 1).
    q: ``[B, Hq, T, D]``; k: ``[B, Hkv, T, D]``; lengths: ``[B]``.
    """
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    qpos = lengths[:, None] - window + jnp.arange(window)  # [B, w]
    qw = jnp.take_along_axis(q, jnp.clip(qpos, 0, t - 1)[:, None, :, None], axis=2)  # [B, Hq, w, D]
    qw = qw.reshape(b, hkv, hq // hkv, window, d)
    s = jnp.einsum("bhgwd,bhtd->bhgwt", qw, k, preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(d))
    kpos = jnp.arange(t)
    mask = (kpos[None, None, :] <= qpos[:, :, None]) & (kpos[None, None, :] < lengths[:, None, None])
    mask &= (qpos >= 0)[:, :, None]
    s = jnp.where(mask[:, None, None], s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(mask[:, None, None], p, 0.0)
    return p.sum(axis=3).mean(axis=2)


def accumulated_scores(q, k, lengths, chunk: int = 512) -> jnp.ndarray:
    """H2O accumulated attention ``[B, Hkv, T]``: column sums of the causal softmax over all real queries
    (averaged over each KV group's query heads).

    Flash-style, in ``chunk x chunk`` tiles of (queries, keys), so memory is linear in ``T`` (``O(T + chunk^2)``
    per head, never a ``[chunk, T]`` or ``[T, T]`` block): a first pass takes each query's log-sum-exp over its
    causal keys (online over the key tiles ``j <= i``), a second adds ``exp(s - lse)`` into each key tile's
    column sums over the query tiles ``i >= j``. Tiles above the diagonal are never computed, so the work is the
    ``T^2/2`` causal scores twice (the same as one dense pass over ``[T, T]``)."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    c = min(chunk, t)
    n = -(-t // c)
    pad = ((0, 0), (0, 0), (0, n * c - t), (0, 0))
    qc = jnp.pad(q, pad).reshape(b, hkv, g, n, c, d)
    kc = jnp.pad(k, pad).reshape(b, hkv, n, c, d)
    offs = jnp.arange(c)
    scale = 1.0 / jnp.sqrt(jnp.float32(d))

    def tile(i, j):
        """Scaled scores ``[B, Hkv, G, C, C]`` of query tile ``i`` against key tile ``j`` and their mask
        (causal, keys and queries inside each sequence's length: padded queries vote for nothing)."""
        qi = jax.lax.dynamic_index_in_dim(qc, i, axis=3, keepdims=False)  # [B, Hkv, G, C, D]
        kj = jax.lax.dynamic_index_in_dim(kc, j, axis=2, keepdims=False)  # [B, Hkv, C, D]
        qpos, kpos = i * c + offs, j * c + offs
        s = jnp.einsum("bhgtd,bhsd->bhgts", qi, kj, preferred_element_type=jnp.float32) * scale
        mask = (kpos[None, :] <= qpos[:, None])[None] & (kpos[None, None, :] < lengths[:, None, None])
        mask &= qpos[None, :, None] < lengths[:, None, None]
        return s, mask[:, None, None]

    def row_lse(i):  # [B, Hkv, G, C]: log-sum-exp of query tile i over its causal keys (-inf: no key)
        def add(j, carry):
            m, l = carry
            s, mask = tile(i, j)
            m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, NEG_INF), axis=-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            return m_new, l * jnp.exp(m - m_new) + p.sum(axis=-1)

        init = (jnp.full((b, hkv, g, c), NEG_INF, jnp.float32), jnp.zeros((b, hkv, g, c), jnp.float32))
        m, l = jax.lax.fori_loop(0, i + 1, add, init)
        return m + jnp.log(l)

    lse = jax.lax.map(row_lse, jnp.arange(n))  # [N, B, Hkv, G, C]

    def column(j):  # [B, Hkv, C]: softmax weights on key tile j summed over the query tiles i >= j and the group
        def add(i, acc):
            s, mask = tile(i, j)
            li = jax.lax.dynamic_index_in_dim(lse, i, axis=0, keepdims=False)
            return acc + jnp.where(mask, jnp.exp(s - li[..., None]), 0.0).sum(axis=(2, 3))

        return jax.lax.fori_loop(j, n, add, jnp.zeros((b, hkv, c), jnp.float32))

    acc = jax.lax.map(column, jnp.arange(n))  # [N, B, Hkv, C]
    return jnp.moveaxis(acc, 0, 2).reshape(b, hkv, n * c)[..., :t] / g


def pool1d(x: jnp.ndarray, kernel: int, kind: str) -> jnp.ndarray:
    """Stride-1 'same' pooling over the last axis (PyTorch ``avg_pool1d``/``max_pool1d`` with
    ``padding=kernel//2``; average counts the zero padding, as PyTorch's default does)."""
    if kernel == 1:
        return x
    pad = kernel // 2
    dims = (1,) * (x.ndim - 1) + (kernel,)
    pads = ((0, 0),) * (x.ndim - 1) + ((pad, pad),)
    if kind == "max":
        return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, dims, (1,) * x.ndim, pads)
    return jax.lax.reduce_window(x, 0.0, jax.lax.add, dims, (1,) * x.ndim, pads) / kernel


def kept_window(budgets, window: int):
    """Per-sequence kept window ``[B]``: ``min(window, budget)`` (a budget below the window keeps its most
    recent ``budget`` tokens instead of overshooting)."""
    return jnp.minimum(window, budgets).astype(jnp.int32)


def topk_with_window(scores, lengths, budgets, window: int, slots: int, windows=None):
    """Per-KV-head selection: top ``budget - w`` prefix tokens plus the last ``w`` tokens.

    scores: ``[B, Hkv, T]`` (larger is kept); lengths, budgets: ``[B]`` int; window: static largest window;
    windows: ``[B]`` per-sequence windows ``<= window`` (default :func:`kept_window`); slots: static output size
    (>= every budget). Returns ``idx [B, Hkv, slots]`` int32 positions in increasing order and
    ``ok [B, Hkv, slots]`` marking real entries. A sequence with ``length <= budget`` keeps every token.
    """
    b, h, t = scores.shape
    windows = kept_window(budgets, window) if windows is None else windows
    kmax = min(max(slots - window, 0), t)
    prefix = (lengths - windows)[:, None, None]  # [B,1,1]
    pos = jnp.arange(t)
    cand = pos[None, None, :] < prefix
    masked = jnp.where(cand, scores, NEG_INF)
    if kmax:
        val, top = top_k(masked, kmax)  # [B, H, kmax]
        keep = (jnp.arange(kmax)[None, None, :] < (budgets - windows)[:, None, None]) & (val > NEG_INF / 2)
        top = jnp.sort(jnp.where(keep, top, t + slots), axis=-1)
        keep = top < t
    else:
        top = jnp.zeros((b, h, 0), jnp.int32)
        keep = jnp.zeros((b, h, 0), bool)
    return append_window(jnp.where(keep, top, -1), keep, lengths, budgets, window, slots, windows)


def append_window(idx, ok, lengths, budgets, window: int, slots: int, windows=None):
    """Selected positions plus the last ``w`` prompt tokens, compacted to ``slots`` entries.

    idx, ok: ``[B, Hkv, N]`` selected positions (in position order) and their validity; lengths, budgets:
    ``[B]``; window: static largest window; windows: ``[B]`` per-sequence windows (default
    :func:`kept_window`). Returns ``idx [B, Hkv, slots]`` int32 (-1 for empty slots) and ``ok``: real entries
    first, in position order (the selected prefix tokens precede the window). A sequence with
    ``length <= budget`` keeps every token (no compression).
    """
    b, h = idx.shape[:2]
    windows = kept_window(budgets, window) if windows is None else windows
    off = jnp.arange(window)
    win = jnp.broadcast_to((lengths - window)[:, None, None] + off, (b, h, window))
    win_ok = (win >= 0) & (off[None, None, :] >= (window - windows)[:, None, None])
    idx = jnp.concatenate([idx, win], axis=-1)
    ok = jnp.concatenate([ok, win_ok], axis=-1)
    order = jnp.argsort(~ok, axis=-1, stable=True)  # real entries first, relative order kept
    idx = jnp.take_along_axis(idx, order, axis=-1)
    ok = jnp.take_along_axis(ok, order, axis=-1)
    pad = slots - idx.shape[-1]
    if pad > 0:
        idx = jnp.concatenate([idx, jnp.full((b, h, pad), -1, idx.dtype)], axis=-1)
        ok = jnp.concatenate([ok, jnp.zeros((b, h, pad), bool)], axis=-1)
    idx, ok = idx[..., :slots], ok[..., :slots]
    whole = (lengths <= budgets)[:, None, None]
    every = jnp.broadcast_to(jnp.arange(slots), (b, h, slots))
    idx = jnp.where(whole, every, idx).astype(jnp.int32)
    ok = jnp.where(whole, every < lengths[:, None, None], ok)
    return jnp.where(ok, idx, -1), ok
