"""Exact top-k without a sort: a threshold found by bisection on the score bits, then bit-packed compaction.

``lax.top_k(x, k)`` keeps the ``k`` largest entries of ``x``, ties to the lower index. The same set is

- every entry with ``key > tau`` plus the lowest-indexed ``k - count(key > tau)`` entries with ``key == tau``,
  where ``key`` is the float's bits mapped to an order-preserving ``uint32`` (:func:`sortable`) and ``tau`` the
  largest key with ``count(key >= tau) >= k`` (:func:`kth_key`: 32 bisection steps, one per bit, each a count
  over the keys; the counts may be weighted, so a table of distinct values with multiplicities works as well as
  one entry per slot);
- turned into slot indices from one bit per slot, packed 32 to a ``uint32`` word (:func:`pack_bits`): the
  first ``need`` tied slots are cut with :func:`keep_first` and the ``k`` positions are read off the words
  (:func:`compact`: prefix counts over the words, the word of each output from a count of words per prefix
  value, then the n-th set bit inside it), so nothing of the size of the slot axis is sorted, searched per
  output or scattered: ``O(W + k)`` after the pass that packs the bits.

On an accelerator :func:`kth_key` takes ``tau`` from one sort of the keys and a prefix sum of their weights instead
of the 32 counts (``KVJAX_KTH_KEY``, :func:`kth_key_method`): the same ``tau``, but XLA runs each of the
bisection's 32 trips as a loop iteration with its own kernel launches, which on the H200 of 2026-11-26 left the
recall methods' steps 9-46x their bytes (benchmarks/results/archive/roofline_h200_32k_b8_timing_calls.txt), while on
a CPU the sort was the largest op of their steps (the reason for the bisection).

The positions come out ascending (``lax.top_k`` orders by value; a set is the same set). Shapes: keys, weights
``[..., N]``; words ``[..., W]`` (slot ``s`` is bit ``s % 32`` of word ``s // 32``); counts ``[...]`` int32.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from kvjax.model import attention

_SIGN = 0x80000000
#: Environment variable choosing :func:`kth_key`'s method: "bisect" or "sort" (unset: by backend).
ENV_KTH_KEY = "KVJAX_KTH_KEY"
KTH_KEY_METHODS = ("bisect", "sort")


def kth_key_method() -> str:
    """How :func:`kth_key` finds ``tau`` (read at trace time): ``$KVJAX_KTH_KEY`` if set, else "bisect" on the CPU
    backend (32 weighted counts: XLA:CPU's sort was the recall steps' largest op) and "sort" on GPU/TPU (one sort
    and a prefix sum instead of a 32-trip loop). Both give the same ``tau`` (tests/kvjax/test_threshold.py)."""
    how = os.environ.get(ENV_KTH_KEY) or ("sort" if attention.one_pass() else "bisect")
    if how not in KTH_KEY_METHODS:
        raise ValueError(f"{ENV_KTH_KEY}={how!r} is not one of {KTH_KEY_METHODS}; unset it to choose by backend")
    return how


def sortable(x: jnp.ndarray) -> jnp.ndarray:
    """float32 -> uint32 in the total order ``lax.top_k`` ranks by (``-0.0`` just below ``+0.0``). Every
    non-NaN float maps above ``0``, so ``0`` is free as the key of "nothing"."""
    b = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(b >= jnp.uint32(_SIGN), ~b, b | jnp.uint32(_SIGN))


def kth_key(keys: jnp.ndarray, weights: jnp.ndarray, k: jnp.ndarray):
    """``(tau [...] uint32, above [...] int32)``: ``tau`` the largest key with ``sum(weights[keys >= tau]) >=
    k``, ``above = sum(weights[keys > tau])``. keys ``[..., N]`` uint32, weights ``[..., N]`` int32 (``>= 0``),
    k broadcastable to ``keys.shape[:-1]``. When the total weight is below ``k``, ``tau = 0`` (below every real
    key: everything is kept); ``k <= 0`` gives ``tau = 0xFFFFFFFF`` and keeps nothing. By :func:`kth_key_method`:
    built from the top bit down (32 weighted counts), or read off the keys sorted in descending order at the first
    position whose prefix weight reaches ``k`` (a key of positive weight, so the same ``tau``)."""
    k = jnp.broadcast_to(jnp.asarray(k, jnp.int32), keys.shape[:-1])
    weights = weights.astype(jnp.int32)
    if kth_key_method() == "sort":
        desc, w = jax.lax.sort((~keys, weights), dimension=keys.ndim - 1, num_keys=1)  # ~: descending keys
        j = jnp.sum(jnp.cumsum(w, axis=-1) < k[..., None], axis=-1)  # first prefix >= k; N: total below k
        at = ~jnp.take_along_axis(desc, jnp.minimum(j, keys.shape[-1] - 1)[..., None], axis=-1)[..., 0]
        tau = jnp.where(k <= 0, jnp.uint32(0xFFFFFFFF), jnp.where(j < keys.shape[-1], at, jnp.uint32(0)))
    else:

        def count(t):
            return jnp.sum(jnp.where(keys >= t[..., None], weights, 0), axis=-1)

        def bit(i, tau):
            trial = tau | jnp.left_shift(jnp.uint32(1), jnp.asarray(31 - i, jnp.uint32))
            return jnp.where(count(trial) >= k, trial, tau)

        tau = jax.lax.fori_loop(0, 32, bit, jnp.zeros(keys.shape[:-1], jnp.uint32))
    above = jnp.sum(jnp.where(keys > tau[..., None], weights, 0), axis=-1)
    return tau, above.astype(jnp.int32)


def top_set(keys: jnp.ndarray, cand: jnp.ndarray, k: jnp.ndarray, width: int):
    """``lax.top_k``'s set of the ``k [...]`` largest ``keys [..., 32 W]`` (uint32, :func:`sortable`) among the
    ``cand`` entries (bool, same shape; ties to the lower index), ascending, without a sort: ``(slots [..., width]
    int32, ok [..., width] bool)`` (:func:`compact`; ``width >= k``)."""
    tau, above = kth_key(keys, cand.astype(jnp.int32), k)
    up = pack_bits(cand & (keys > tau[..., None]))
    tie = pack_bits(cand & (keys == tau[..., None]))
    return compact(up | keep_first(tie, jnp.asarray(k, jnp.int32) - above), width)


def pack_bits(mask: jnp.ndarray) -> jnp.ndarray:
    """``[..., 32 W]`` bool -> ``[..., W]`` uint32 (slot ``s`` is bit ``s % 32`` of word ``s // 32``)."""
    m = mask.reshape(*mask.shape[:-1], -1, 32).astype(jnp.uint32)
    return jnp.sum(jnp.left_shift(m, jnp.arange(32, dtype=jnp.uint32)), axis=-1, dtype=jnp.uint32)


def _popcount(x):
    return jax.lax.population_count(x).astype(jnp.int32)


def _low_mask(n):
    """uint32 with the ``n`` low bits set, ``n`` in ``[0, 32]``."""
    n = jnp.asarray(n, jnp.uint32)
    return jnp.where(n >= 32, jnp.uint32(0xFFFFFFFF), jnp.left_shift(jnp.uint32(1), jnp.minimum(n, 31)) - 1)


def nth_bit(x: jnp.ndarray, n: jnp.ndarray) -> jnp.ndarray:
    """Position (int32, ``0..31``) of the ``n``-th set bit of ``x`` (0-based, from the low end): the largest
    ``p`` with ``popcount(x & (2^p - 1)) <= n`` (5 halving steps). Meaningless when ``n >= popcount(x)``."""
    p = jnp.zeros(jnp.broadcast_shapes(x.shape, jnp.shape(n)), jnp.int32)
    for step in (16, 8, 4, 2, 1):
        q = p + step
        ok = (q <= 31) & (_popcount(x & _low_mask(q)) <= n)
        p = jnp.where(ok, q, p)
    return p


def _slot_in_word(words, cnt, incl, w, r):
    """Slot ``32 w + bit`` of the ``r``-th set bit (counted over all words) given its word ``w``."""
    before = jnp.take_along_axis(incl, w, axis=-1) - jnp.take_along_axis(cnt, w, axis=-1)
    return w * 32 + nth_bit(jnp.take_along_axis(words, w, axis=-1), r - before)


def keep_first(words: jnp.ndarray, n: jnp.ndarray) -> jnp.ndarray:
    """``words [..., W]`` with only the ``n [...]`` lowest set bits kept (``n <= 0``: none)."""
    n = jnp.asarray(n, jnp.int32)
    cnt = _popcount(words)
    incl = jnp.cumsum(cnt, axis=-1)
    r = jnp.maximum(n - 1, 0)[..., None]  # the n-th set bit (when n >= 1)
    w = jnp.sum(incl <= r, axis=-1, keepdims=True).astype(jnp.int32)  # its word: words with incl <= r
    last = _slot_in_word(words, cnt, incl, jnp.minimum(w, words.shape[-1] - 1), r)[..., 0]
    wi = jnp.arange(words.shape[-1], dtype=jnp.int32)
    lw, lb = (last // 32)[..., None], (last % 32)[..., None]
    keep = jnp.where(wi < lw, jnp.uint32(0xFFFFFFFF), jnp.where(wi == lw, _low_mask(lb + 1), jnp.uint32(0)))
    keep = jnp.where((n >= incl[..., -1])[..., None], jnp.uint32(0xFFFFFFFF), keep)
    return jnp.where((n > 0)[..., None], words & keep, jnp.uint32(0))


def compact(words: jnp.ndarray, k: int):
    """The first ``k`` set slots of ``words [..., W]``, ascending: ``(slots [..., k] int32, ok [..., k] bool)``;
    entries past the number of set bits are ``ok = False`` (their slot is clipped into ``[0, 32 W)``).

    The word holding output ``r`` is the number of words whose inclusive prefix count is ``<= r``: a count of
    the words per prefix value (an add of the ``W`` words into ``k + 1`` bins) summed up to ``r`` (a cumulative
    sum over ``k``), so the work is ``O(W + k)``, not a search per output; then the bit inside the word
    (:func:`nth_bit`)."""
    cnt = _popcount(words)
    incl = jnp.cumsum(cnt, axis=-1)  # [..., W]
    lead, nw = words.shape[:-1], words.shape[-1]
    flat = jnp.minimum(incl, k).reshape(-1, nw)
    bins = jax.vmap(lambda v: jnp.zeros((k + 1,), jnp.int32).at[v].add(1))(flat)  # [N, k + 1]
    w = jnp.minimum(jnp.cumsum(bins[:, :k], axis=-1).reshape(*lead, k), nw - 1)  # [..., k]
    r = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), w.shape)
    slot = _slot_in_word(words, cnt, incl, w, r)
    return jnp.clip(slot, 0, 32 * nw - 1), r < incl[..., -1:]
