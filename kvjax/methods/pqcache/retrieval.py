"""PQCache's retrieval (paper §3.1 decode; method note ``docs/notes/pqcache.md`` §8.7): which ``k_b`` candidates
``[sink, end[b])`` a decode step attends, ranked by the query's approximate scores ``q · k_hat`` from the codes, and
what finding them reads (:func:`read_bytes`).

Two paths, the same set: the *table* path scores each code tuple once (``(2^bits)^m`` of them, weighted by the
candidates counted per tuple, :mod:`kvjax.methods.pqcache.index`), finds the ``k``-th key by bisection and marks the
slots above it (and the first ties) in one pass over the codes; the *per-slot* path looks every candidate's score
up (:func:`~kernels_pallas.pq_lookup.pq_lookup`) and takes the top ``k``. GQA: a query group's per-head softmax
weights over the candidates, summed. Axes in einsums: b batch, h KV head, g query head in group, i sub-space, c
centroid, d sub-vector dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.pq_lookup import pq_lookup
from kvjax.model import attention
from kvjax.model.attention import NEG_INF
from kvjax.methods.pqcache import index as pq_index
from kvjax.methods.core import threshold as th
from kvjax.methods.base import sum_small_axis

#: Slots per chunk of the code pass on CPU (a multiple of the 32-slot bit word; :func:`scan_chunk`).
SCAN_CHUNK = 4096
#: Code buffers are allocated in whole bit words.
WORD = 32


def scan_chunk(sc: int) -> int:
    """Slots per chunk of the code pass over ``sc`` slots: ``SCAN_CHUNK`` on CPU, every slot in one pass
    (:func:`kvjax.model.attention.one_pass`)."""
    return sc if attention.one_pass() else min(SCAN_CHUNK, sc)


def lut(centroids, q) -> jnp.ndarray:
    """``lut [B, Hkv, G, m, K]`` float32: ``q_i · C_{i,c}`` per query head (paper §3.1); ``centroids [B, Hkv, m, K,
    D/m]``, ``q [B, Hq, D]``."""
    b, hq, d = q.shape
    h, m = centroids.shape[1], centroids.shape[2]
    qs = q.astype(jnp.float32).reshape(b, h, hq // h, m, d // m)
    return jnp.einsum("bhgid,bhicd->bhgic", qs, centroids, precision=jax.lax.Precision.HIGHEST)


def tuple_keys(lut, hist, d: int) -> jnp.ndarray:
    """``[B, Hkv, K^m]`` uint32 order keys (:func:`~kvjax.methods.core.threshold.sortable`) of each code tuple's
    aggregated score; 0 for a tuple no candidate holds. ``d`` the head dim. G = 1: ``s_hat / sqrt(D)``; else the sum
    over the group of ``softmax(s_hat / sqrt(D))`` over the candidates, whose maximum and normaliser come from the
    tuples weighted by ``hist`` (their counts)."""
    b, h, g, m, kc = lut.shape
    s = lut[..., 0, :]  # [B, Hkv, G, K]
    for i in range(1, m):  # the lookup's sum over sub-spaces, in its order
        s = (s[..., :, None] + lut[..., i, None, :]).reshape(b, h, g, -1)
    z = s / jnp.sqrt(jnp.float32(d))  # [B, Hkv, G, K^m]
    present = (hist > 0)[:, :, None, :]
    if g == 1:
        agg = z[:, :, 0]
    else:
        mx = jnp.max(jnp.where(present, z, NEG_INF), axis=-1, keepdims=True)
        e = jnp.where(present, jnp.exp(z - mx), 0.0)
        # the count-weighted sum as a dot: XLA:CPU's fused multiply-reduce took 10x as long (0.46 ms at 4096 tuples)
        tot = jnp.einsum("bhgk,bhk->bhg", e, hist.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)[..., None]
        agg = sum_small_axis(e / jnp.maximum(tot, 1e-30), 2)
    return jnp.where(present[:, :, 0], th.sortable(agg), jnp.uint32(0))


def scan_codes(codes, keys, tau, sink: int, end, kc: int):
    """One pass over the candidates' codes (:func:`kvjax.model.attention.live_pass`: chunks of :func:`scan_chunk` up
    to ``max(end)``, or every slot at once where at least half are candidates): each slot's
    tuple key looked up in ``keys [B, Hkv, K^m]``, compared with ``tau [B, Hkv]``. Returns the bit words
    ``(above, tied) [B, Hkv, S_c / 32]`` uint32 of the candidates ``[sink, end[b])`` (zero past them)."""
    b, h, _, sc = codes.shape
    c = scan_chunk(sc)
    words = jnp.zeros((b, h, sc // WORD), jnp.uint32)

    def scan(start, c, acc):  # the words of slots [start, start + c)
        above, tied = acc
        key = jnp.take_along_axis(
            keys, pq_index.tuples(jax.lax.dynamic_slice_in_dim(codes, start, c, axis=3), kc), axis=-1
        )  # [B, Hkv, C]
        j = start + jnp.arange(c, dtype=jnp.int32)
        cand = ((j[None, :] >= sink) & (j[None, :] < end[:, None]))[:, None, :]  # [B, 1, C]
        put = lambda w, bits: jax.lax.dynamic_update_slice_in_dim(w, th.pack_bits(bits), start // WORD, 2)  # noqa
        return (put(above, cand & (key > tau[..., None])), put(tied, cand & (key == tau[..., None])))

    body = lambda i, acc: scan(jnp.minimum(i * c, sc - c), c, acc)  # noqa: E731 (a clamped last chunk: same words)
    init = (words, words)
    return attention.live_pass(jnp.max(end), c, sc, body, init, lambda: scan(0, sc, init))


def slot_keys(lut, codes, sink: int, end, d: int, impl):
    """Per-slot path: ``(keys [B, Hkv, S_c] uint32, cand [B, 1, S_c] bool)`` from the lookup's scores
    (:func:`~kernels_pallas.pq_lookup.pq_lookup`, no block past ``end`` read) and the group softmax over the
    candidates ``[sink, end)`` taken per slot (note §8.7)."""
    s_hat = pq_lookup(lut, codes, end, impl=impl)  # [B, Hkv, G, S_c]
    j = jnp.arange(codes.shape[-1])
    cand = ((j[None, :] >= sink) & (j[None, :] < end[:, None]))[:, None, None, :]  # [B, 1, 1, S_c]
    z = jnp.where(cand, s_hat / jnp.sqrt(jnp.float32(d)), NEG_INF)
    if lut.shape[2] == 1:
        agg = z[:, :, 0]
    else:
        p = jnp.where(cand, jnp.exp(z - jnp.max(z, axis=-1, keepdims=True)), 0.0)
        agg = sum_small_axis(p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30), 2)
    cand = cand[:, :, 0]
    return jnp.where(cand, th.sortable(agg), jnp.uint32(0)), cand


def retrieve(lut, codes, hist, end, kk, *, sink: int, topk: int, d: int, table: bool, impl, kc: int):
    """``(slots, ok) [B, Hkv, topk]``: the ``kk[b]`` candidates of ``[sink, end[b])`` with the largest aggregated
    scores, ties to the lower slot (= ``lax.top_k``), ascending; per device on a mesh. ``table``: the table path
    (``hist`` counted over the candidates), else the per-slot one."""
    if not table:
        keys, cand = slot_keys(lut, codes, sink, end, d, impl)
        return th.top_set(keys, jnp.broadcast_to(cand, keys.shape), kk[:, None], topk)
    keys = tuple_keys(lut, hist, d)
    tau, above = th.kth_key(keys, hist, kk[:, None])
    up, tie = scan_codes(codes, keys, tau, sink, end, kc)
    return th.compact(up | th.keep_first(tie, kk[:, None] - above), topk)


def read_bytes(centroids, codes, end, *, hq: int, topk: int, table: bool, pallas: bool, kc: int) -> dict[str, int]:
    """Bytes :func:`retrieve` (and the LUT before it) reads for candidates ending at ``end [B]`` (host ints), by
    part (see ``PQCache.bytes_read_breakdown``): ``codes`` (the code pass's slots, :func:`scan_codes`; on the per-slot
    path the lookup's: the Pallas kernels stop at the candidate end, the XLA reference reads all ``S_c``),
    ``centroids``, ``lut`` (float32, written then read), ``table`` (counts, keys and per-query-head tuple scores) or
    ``scores`` (the lookup's ``[Hq, S_c]`` float32, written and read by the group softmax, and the ``[Hkv, S_c]``
    keys), ``words`` (two bit words per 32 visited slots, written and read) and ``indices`` (the ``topk`` slots and
    flags)."""
    b, h, m, sc = codes.shape
    g = hq // h
    out = dict.fromkeys(("codes", "centroids", "lut", "table", "scores", "words", "indices"), 0)
    out["centroids"] = int(centroids.size * 4)
    out["lut"] = 2 * b * hq * m * kc * 4
    if table:
        scanned = attention.live_pass_rows(int(end.max()), scan_chunk(sc), sc)
        out["codes"] = b * h * m * scanned
        out["table"] = b * h * kc**m * 4 * (2 + g)
    else:
        scanned = sc
        out["codes"] = int(h * m * np.sum(end)) if pallas else b * h * m * sc
        out["scores"] = 2 * b * hq * sc * 4 + b * h * sc * 4
    out["words"] = 2 * 2 * b * h * (scanned // WORD) * 4
    out["indices"] = b * h * topk * (4 + 1)
    return out
