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


def csm_round(k, v, n, length, merges, *, n_sink, n_recent, chunk: int, max_merges: int,
              out_slots: int, impl: str | None = None, return_matches: bool = False):
    """Merge ``merges [B]`` tokens per head (Chelsea §5.2–5.3) and compact to ``out_slots`` slots.

    Requires ``0 <= merges <= (length - n_sink - n_recent) // 2`` (the valid A tokens) and
    ``merges <= max_merges``. Returns ``(k, v, n)`` with ``out_slots`` slots; the new occupancy is
    ``length - merges``. ``return_matches=True`` also returns ``(src, dst)`` ``[B, H, P*c/2]`` int32 slot
    indices of every A token and its best B partner, with ``src = -1`` where the edge was not selected.

    ``n_sink`` and ``n_recent`` are Python ints (static) or ``[B]`` int32 arrays (per-sequence windows, used by
    Chelsea for prompts whose budget is too small for the configured windows). With an array ``n_sink`` each
    sequence is rotated so that its middle starts at slot 0 (chunks stay aligned at its own sink boundary),
    merged with no static sinks, and rotated back before the compaction: for ``n_sink[b] == c`` the result is
    exactly that of the static ``n_sink=c``.
    """
    if isinstance(n_sink, int):
        k2, v2, n2, matches = _merge(k, v, n, length, merges, n_sink, n_recent, chunk, max_merges, impl)
    else:
        s = k.shape[2]
        ns = jnp.asarray(n_sink, jnp.int32)
        back = (s - ns) % s  # rotated slot j holds slot (j + ns) mod s
        k2, v2, n2, matches = _merge(_rotate(k, ns), _rotate(v, ns), _rotate(n, ns), length - ns, merges, 0,
                                     n_recent, chunk, max_merges, impl)
        k2, v2, n2 = _rotate(k2, back), _rotate(v2, back), _rotate(n2, back)
        src, dst = matches
        nsb = ns[:, None, None]
        matches = (jnp.where(src >= 0, (src + nsb) % s, -1).astype(jnp.int32), ((dst + nsb) % s).astype(jnp.int32))
    out = compact(k2, v2, n2, out_slots)
    return (out, matches) if return_matches else out


def _rotate(x, shift):
    """``x [B, H, S, ...]`` rotated along the slot axis: slot ``j`` of sequence ``b`` becomes slot ``(j + shift[b])
    mod S`` (``shift [B]`` in ``[0, S)``). One contiguous window per sequence of ``x`` repeated twice (an
    element-wise ``take_along_axis`` built ``[B, H, S, D]`` index arrays, three times the buffer, on every
    step)."""
    s = x.shape[2]
    twice = jnp.concatenate([x, x], axis=2)
    return jax.vmap(lambda row, i: jax.lax.dynamic_slice_in_dim(row, i, s, axis=1))(twice, shift)


def _merge(k, v, n, length, merges, n_sink: int, n_recent, chunk: int, max_merges: int, impl):
    """The merge of :func:`csm_round` with a static ``n_sink``, before compaction (``S`` slots out)."""
    b, h, s, d = k.shape
    half = chunk // 2
    mid = s - n_sink
    p = max(1, -(-mid // chunk))
    pad = p * chunk - mid

    def middle(x):
        x = x[:, :, n_sink:]
        return jnp.pad(x, ((0, 0), (0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 3))

    km, vm, nm = middle(k), middle(v), middle(n)
    slot = n_sink + jnp.arange(p * chunk)
    valid = jnp.broadcast_to(slot[None, None, :] < jnp.asarray(length - n_recent)[:, None, None], (b, h, p * chunk))
    best, jst = sharding.per_head(lambda x, ok: chunk_best_match(x, ok, chunk, impl=impl), km, valid)  # [B,H,P,c/2]

    # Global top-m edges per head; the first merges[b] of the static max_merges are taken.
    sel = jnp.zeros((b, h, p * half), bool)
    if max_merges > 0:
        _, top = top_k(best.reshape(b, h, p * half), max_merges)  # ties: lower index first
        ok = jnp.arange(max_merges)[None, None, :] < merges[:, None, None]
        sel = rows_at(sel, top, ok)
    sel = sel.reshape(b, h, p, half)

    kc = km.reshape(b, h, p, half, 2, d).astype(jnp.float32)
    dv = v.shape[-1]  # value dim (may differ from the key dim)
    vc = vm.reshape(b, h, p, half, 2, dv).astype(jnp.float32)
    nc = nm.reshape(b, h, p, half, 2)
    ka, kb, va, vb, na, nb = kc[..., 0, :], kc[..., 1, :], vc[..., 0, :], vc[..., 1, :], nc[..., 0], nc[..., 1]
    w = jnp.where(sel, na, 0.0)  # counts moved from each selected A token to its B partner
    # Scatter-add into the B rows: each A row's partner, as an index into its (sequence, head)'s P * c/2 B rows.
    rows = (jnp.arange(p)[:, None] * half + jst).reshape(b, h, p * half)
    flat = lambda x: x.reshape(b, h, p * half, *x.shape[4:])
    nb2 = rows_at(flat(nb), rows, flat(w), "add").reshape(b, h, p, half)
    kb_sum = rows_at(flat(nb[..., None] * kb), rows, flat(w[..., None] * ka), "add")
    vb_sum = rows_at(flat(nb[..., None] * vb), rows, flat(w[..., None] * va), "add")
    denom = jnp.where(nb2 > 0, nb2, 1.0)[..., None]
    kb2 = jnp.where(nb2[..., None] > 0, kb_sum.reshape(b, h, p, half, d) / denom, kb)
    vb2 = jnp.where(nb2[..., None] > 0, vb_sum.reshape(b, h, p, half, dv) / denom, vb)
    na2 = jnp.where(sel, 0.0, na)

    def full(x_a, x_b, head):
        x = jnp.stack([x_a, x_b], axis=4).reshape(b, h, p * chunk, *x_a.shape[4:])[:, :, :mid]
        return jnp.concatenate([head, x.astype(head.dtype)], axis=2)

    k2 = full(ka, kb2, k[:, :, :n_sink])
    v2 = full(va, vb2, v[:, :, :n_sink])
    n2 = full(na2, nb2, n[:, :, :n_sink])
    base = n_sink + jnp.arange(p)[:, None] * chunk  # [P, 1]
    src = jnp.where(sel, base + 2 * jnp.arange(half)[None, :], -1).reshape(b, h, p * half)
    dst = (base + 2 * jst + 1).reshape(b, h, p * half)
    return k2, v2, n2, (src.astype(jnp.int32), dst.astype(jnp.int32))


def compact(k, v, n, out_slots: int):
    """Move the occupied slots (``n > 0``) to the front, keeping their order; ``out_slots`` slots out (zeros past
    the occupied ones).

    A gather of rows (output slot ``j`` reads the ``j``-th occupied slot, found by a scatter of int32 slot
    numbers), not a scatter of rows into a zero buffer: the result is a fresh buffer that XLA can place in the
    input's (a while loop's carry is updated without a copy)."""
    b, h, s, _ = k.shape
    keep = n > 0
    rank = jnp.cumsum(keep, axis=-1, dtype=jnp.int32) - 1  # [B, H, S] output slot of each occupied slot
    src = rows_at(jnp.zeros((b, h, out_slots), jnp.int32), jnp.where(keep, rank, out_slots),
                  jnp.arange(s, dtype=jnp.int32))  # [B, H, out] occupied slot read by each output slot
    live = jnp.arange(out_slots)[None, None, :] <= rank[..., -1:]  # [B, H, out]
    rows = jax.vmap(jax.vmap(lambda row, i: row[i]))
    pick = lambda x: jnp.where(live.reshape(live.shape + (1,) * (x.ndim - 3)), rows(x, src), 0).astype(x.dtype)
    return pick(k), pick(v), pick(n)
