"""One round of Chelsea's Chunked Soft Matching (CSM) at fixed shapes, and its host-side schedule.

Chelsea (Hu et al., 2025, arXiv:2506.11418) §5.2–5.3 and App. C.2; resolutions of what the paper leaves open
follow ``docs/notes/chelsea.md`` (A1–A8, A15, A16):

- a cache buffer holds its occupied slots at the front (``[0, length)``); the first ``n_sink`` slots and the
  last ``n_recent`` occupied slots are never merged; the middle ``[n_sink, length - n_recent)`` is cut into
  chunks of ``c`` slots aligned at ``n_sink``;
- inside a chunk, even offsets are set A (sources), odd offsets set B (destinations) (Theorem 6.1); each A
  token's edge goes to its most cosine-similar B key in the chunk (``kernels_pallas.chunked_similarity``);
- the ``m`` most similar edges over all chunks of a head are kept (global top-m, ties to the lower index);
- each B token and the A tokens pointing at it merge into one slot: keys and values are count-weighted means,
  counts add (§5.3, ``k = sum n_i k_i / sum n_i``); the centroid stays in the B slot and surviving slots keep
  their order (order-preserving compaction, A6).

Sinks and the recent window may be per batch element (``[B]`` arrays, :func:`csm_round`). Merge counts ``m`` are
per batch element (all heads of an element merge the same number, so occupancy stays a
per-element ``length [B]``); the static ``max_merges`` and output size come from the host-side ``plan``.
Shapes: k, v ``[B, H, S, D]``; n ``[B, H, S]`` float32 counts (0 = empty slot); length, merges ``[B]`` int32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.chunked_similarity import chunk_best_match
from kvjax import sharding
from kvjax.budget import floor_mul
from kvjax.methods.base import rows_at, top_k

#: r is handled in units of 1/RATIO_UNIT so host plans and traced merge counts agree exactly (integer math).
RATIO_UNIT = 10000


def quantise_ratio(r: float) -> int:
    return int(round(r * RATIO_UNIT))


def merges_for(length, budget: int, n_sink: int, n_recent: int, r_q: int):
    """Merges of one round: ``min(max(floor(r M), 1), length - budget)`` with ``M = length - n_sink - n_recent``
    (spec §2.4, A1, A3: r counts the mergeable middle; the cap lands exactly on the budget). ``max(., 1)``
    guarantees progress when ``r M < 1``. 0 when ``length <= budget``. Works on ints, numpy int64 arrays (the
    host-side round plans) and int32 arrays (traced). ``floor(r_q M / RATIO_UNIT)`` is computed split
    (:func:`kvjax.budget.floor_mul`): no intermediate exceeds ``max(M, RATIO_UNIT^2)``, so the traced int32 count
    is exact for every ``M < 2^31`` (the plain product ``r_q M`` overflowed int32 above ~430k tokens)."""
    mid = length - n_sink - n_recent
    if isinstance(length, int):
        return 0 if length <= budget else min(max(floor_mul(mid, r_q, RATIO_UNIT), 1), length - budget)
    xp = np if isinstance(length, np.ndarray) else jnp
    m = xp.minimum(xp.maximum(floor_mul(mid, r_q, RATIO_UNIT), 1), length - budget)
    return xp.where(length > budget, m, 0).astype(np.int64 if xp is np else jnp.int32)


@dataclasses.dataclass(frozen=True)
class Round:
    """A static round: ratio (quantised), the largest merge count any element can need, the output slots."""

    r_q: int
    max_merges: int
    out_slots: int


def plan(start: int, budget: int, n_sink: int, n_recent: int, ratios, floor_slots: int) -> tuple[Round, ...]:
    """Rounds that take a cache of ``start`` occupied slots down to ``budget`` (one Chelsea call, Alg. 1).

    ``ratios(i)`` is the ratio of round ``i`` (App. C.2 schedule). ``start`` is the worst case: the merge count
    and the occupancy after a round are non-decreasing in the input length, so shorter sequences need no more
    rounds and fit the same static sizes. ``floor_slots`` is the largest occupancy of an element that does not
    compress (it must still fit every round's output).
    """
    rounds, s, i = [], start, 0
    while s > budget:
        r_q = quantise_ratio(ratios(i))
        m = merges_for(s, budget, n_sink, n_recent, r_q)
        s -= m
        rounds.append(Round(r_q, m, max(s, floor_slots)))
        i += 1
    return tuple(rounds)


def csm_round(
    k,
    v,
    n,
    length,
    merges,
    *,
    n_sink,
    n_recent,
    chunk: int,
    max_merges: int,
    out_slots: int,
    impl: str | None = None,
    return_matches: bool = False,
):
    """Merge ``merges [B]`` tokens per head (Chelsea §5.2–5.3) and compact to ``out_slots`` slots.

    Requires ``0 <= merges <= (length - n_sink - n_recent) // 2`` (the valid A tokens) and
    ``merges <= max_merges``. Returns ``(k, v, n)`` with ``out_slots`` slots; the new occupancy is
    ``length - merges``. ``return_matches=True`` also returns ``(src, dst)`` ``[B, H, P*c/2]`` int32 slot
    indices of every A token and its best B partner, with ``src = -1`` where the edge was not selected.

    ``n_sink`` and ``n_recent`` are Python ints (static) or ``[B]`` int32 arrays (per-sequence windows, used by
    Chelsea for prompts whose budget is too small for the configured windows). With an array ``n_sink`` the keys
    of each sequence are shifted so that its middle starts at slot 0 for the similarity (chunks stay aligned at
    its own sink boundary): for ``n_sink[b] == c`` the result is that of the static ``n_sink=c``.

    Cost: the chunked similarity reads the middle's keys once (``P (c/2)^2 D`` multiply-adds); the merge works
    per kept edge (``max_merges`` rows gathered, :func:`_merge_edges`) and the compaction gathers the surviving
    rows once. Merged slots are count-weighted means computed in float32; every other slot is copied unchanged.
    """
    b, h, s, _ = k.shape
    half = chunk // 2
    if isinstance(n_sink, int):
        mid = s - n_sink
        p = max(1, -(-mid // chunk))
        km = jnp.pad(k[:, :, n_sink:], ((0, 0), (0, 0), (0, p * chunk - mid), (0, 0)))
    else:  # shift each sequence so that its middle starts at slot 0 (chunks aligned at its own sink boundary)
        p = max(1, -(-s // chunk))
        at = jnp.minimum(jnp.arange(p * chunk)[None, :] + jnp.asarray(n_sink, jnp.int32)[:, None], s - 1)  # [B, P c]
        km = jax.vmap(lambda x, i: x[:, i])(k, at)  # one row gather; rows past the middle are never valid
    off = _per_seq(n_sink, b)  # [B, 1, 1] slot of the middle's first chunk
    end = length[:, None, None] - off - _per_seq(n_recent, b)  # middle slots [0, end) can merge
    valid = jnp.broadcast_to(jnp.arange(p * chunk)[None, None, :] < end, (b, h, p * chunk))
    best, jst = sharding.per_head(lambda x, ok: chunk_best_match(x, ok, chunk, impl=impl), km, valid)  # [B,H,P,c/2]
    best, jst = best.reshape(b, h, p * half), jst.reshape(b, h, p * half)
    a_slot = off + (jnp.arange(p * half) // half) * chunk + 2 * (jnp.arange(p * half) % half)  # [B, 1, P c/2]
    b_slot = (a_slot - 2 * (jnp.arange(p * half) % half) + 2 * jst + 1) % s  # [B, H, P c/2]
    if max_merges > 0:
        _, top = top_k(best, max_merges)  # the best edges first; ties: lower index first
    else:
        top = jnp.zeros((b, h, 0), jnp.int32)
    ok = jnp.arange(max_merges)[None, None, :] < merges[:, None, None]  # the first merges[b] edges are kept
    # The kept edges in A-slot order (the order their weights are summed in), the unused ones after them.
    e = jnp.sort(jnp.where(ok, top, p * half), axis=-1)
    ok = e < p * half
    e = jnp.minimum(e, p * half - 1)
    src = jnp.where(ok, jnp.take_along_axis(jnp.broadcast_to(a_slot, (b, h, p * half)), e, axis=-1), s)
    dst = jnp.where(ok, jnp.take_along_axis(b_slot, e, axis=-1), s)  # [B, H, K] slots; s: no edge
    out = _merge_edges(k, v, n, src.astype(jnp.int32), dst.astype(jnp.int32), out_slots)
    if not return_matches:
        return out
    sel = rows_at(jnp.zeros((b, h, p * half), bool), jnp.where(ok, e, p * half), True)
    return out, (jnp.where(sel, a_slot, -1).astype(jnp.int32), b_slot.astype(jnp.int32))


def _per_seq(x, b: int):
    """A static int or a ``[B]`` array as ``[B, 1, 1]`` int32."""
    return jnp.broadcast_to(jnp.asarray(x, jnp.int32).reshape(-1, 1, 1), (b, 1, 1))


def _merge_edges(k, v, n, src, dst, out_slots: int):
    """Merge the kept edges ``src -> dst`` (``[B, H, K]`` slots, ``S`` where unused; sorted by ``src``) and compact
    to ``out_slots`` slots (Chelsea §5.3, order-preserving).

    Each destination B slot takes the count-weighted mean of itself and its sources, ``(n_b k_b + sum n_a k_a) /
    (n_b + sum n_a)`` in float32, the sources summed in slot order; every other slot is kept as it is. Work is per
    edge (gathers of ``K`` rows) plus one gather of the kept rows (the compaction), so a round with few merges (a
    decode call merges ``g``) reads the cache once, and writes it once, with no buffer-sized intermediate."""
    b, h, s, _ = k.shape
    kk = src.shape[-1]
    rows = jax.vmap(jax.vmap(lambda row, i: row[i]))  # x [B, H, S, ...], i [B, H, ...] in range -> rows
    used = src < s
    # the first edge into each destination accumulates the cluster (its index: a scatter-min over slots)
    first = rows_at(
        jnp.full((b, h, s), kk, jnp.int32), dst, jnp.broadcast_to(jnp.arange(kk, dtype=jnp.int32), dst.shape), "min"
    )
    lead = rows(first, jnp.minimum(dst, s - 1))  # [B, H, K]
    lead = jnp.where(used, lead, kk)
    src_c, dst_c = jnp.minimum(src, s - 1), jnp.minimum(dst, s - 1)
    na = jnp.where(used, rows(n, src_c), 0.0)
    nb = rows(n, dst_c)

    def cluster(x):
        xa, xb = rows(x, src_c).astype(jnp.float32), rows(x, dst_c).astype(jnp.float32)
        total = rows_at(nb[..., None] * xb, lead, na[..., None] * xa, "add")  # at each cluster's first edge
        count = rows_at(nb, lead, na, "add")
        return (total / jnp.where(count > 0, count, 1.0)[..., None]).astype(x.dtype), count

    k_new, count = cluster(k)
    v_new, _ = cluster(v)
    # per slot: the edge whose cluster replaces it (-1: none), and whether it survives
    is_lead = used & (lead == jnp.arange(kk)[None, None, :])
    patch = rows_at(
        jnp.full((b, h, s), -1, jnp.int32),
        jnp.where(is_lead, dst, s),
        jnp.broadcast_to(jnp.arange(kk, dtype=jnp.int32), dst.shape),
    )
    keep = (n > 0) & ~rows_at(jnp.zeros((b, h, s), bool), src, True)
    rank = jnp.cumsum(keep, axis=-1, dtype=jnp.int32) - 1  # [B, H, S] output slot of each kept slot
    at = rows_at(
        jnp.zeros((b, h, out_slots), jnp.int32),
        jnp.where(keep, rank, out_slots),
        jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), keep.shape),
    )  # [B, H, out] slot read
    live = jnp.arange(out_slots)[None, None, :] <= rank[..., -1:]
    pa = rows(patch, at)  # [B, H, out]
    pe = jnp.maximum(pa, 0)

    def pick(x, new):
        shape = live.shape + (1,) * (x.ndim - 3)
        got = rows(x, at)
        if kk:
            got = jnp.where((pa >= 0).reshape(shape), rows(new, pe), got)
        return jnp.where(live.reshape(shape), got, 0).astype(x.dtype)

    return pick(k, k_new), pick(v, v_new), pick(n, count)
