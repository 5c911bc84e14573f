"""The XLA decode-attention path (``impl="xla"``, the CPU default): its cost follows the slots it reads.

Same contract as :func:`~kernels_pallas.decode_attention.reference.decode_attention_reference` (the spec, which
computes over all ``S`` slots and masks), but nothing is computed for a slot that cannot take part:

- without ``block_indices`` the slots ``[0, max_b lengths[b])`` are read in contiguous chunks of ``chunk`` rows
  (a ``lax.fori_loop`` whose trip count is the live length, so bucket padding and unwritten decode slots are
  never touched);
- with ``block_indices`` the listed blocks (sorted and de-duplicated by ``_common.plan_blocks``, blocks past
  ``lengths`` dropped) are *gathered* ``chunk // block_size`` at a time and attended; the trip count is the
  largest number of blocks any ``(b, h)`` lists, so listing fewer blocks costs less.

Each chunk is attended with the flash-decoding recurrence (Dao et al. 2023, §3.1) and merged into the running
partials ``(o, m, l)``, so the result equals the reference up to float rounding. A chunk of ``[B, Hkv, chunk,
D]`` keys and values is sized to stay in the CPU's cache (``chunk_rows``), so a gathered chunk is written and
read back from cache, not from memory.

Shapes as in the reference: q ``[B, Hq, D]``; k, v ``[B, Hkv, S, D]``; valid, bias ``[B, Hkv, S]``; lengths
``[B]``; block_indices ``[B, Hkv, N]`` or ``[B, N]``. Einsum axes: b batch, h KV head, g query head in the
group, s slot of the chunk, d head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.decode_attention._common import effective_lengths, plan_blocks
from kernels_pallas.decode_attention.reference import NEG_INF

#: Bytes of one chunk of keys (``[B, Hkv, chunk, D]``) the loop aims for: a chunk and its values stay in cache.
CHUNK_BYTES = 2 << 20


def chunk_rows(b: int, hkv: int, d: int, itemsize: int, target: int = CHUNK_BYTES) -> int:
    """Rows per chunk: the power of two in ``[64, 4096]`` closest below ``target`` bytes of keys."""
    rows = max(target // max(b * hkv * d * itemsize, 1), 1)
    return int(min(max(1 << (int(rows).bit_length() - 1), 64), 4096))


def _attend_chunk(qg, kk, vv, take, add, scale):
    """Scores ``scale * qg·kk`` of ``qg [B,Hkv,G,D]`` against ``kk [B,Hkv,C,D]``, masked by ``take [B,Hkv,C]`` with the
    additive ``add [B,Hkv,C]`` (or None): returns the chunk's ``(o [B,Hkv,G,D], m, l [B,Hkv,G])``."""
    s = jnp.einsum("bhsd,bhgd->bhgs", kk, qg, preferred_element_type=jnp.float32) * scale
    if add is not None:
        s = s + add[:, :, None, :].astype(jnp.float32)
    s = jnp.where(take[:, :, None, :], s, NEG_INF)
    m = jnp.max(s, axis=-1)
    p = jnp.where(take[:, :, None, :], jnp.exp(s - m[..., None]), 0.0)
    o = jnp.einsum("bhgs,bhsd->bhgd", p.astype(vv.dtype), vv, preferred_element_type=jnp.float32)
    return o, m, jnp.sum(p, axis=-1)


def _merge(a, b):
    (oa, ma, la), (ob, mb, lb) = a, b
    m = jnp.maximum(ma, mb)
    ca, cb = jnp.exp(ma - m), jnp.exp(mb - m)
    return oa * ca[..., None] + ob * cb[..., None], m, la * ca + lb * cb


def decode_attention_xla(q, k, v, valid=None, lengths=None, bias=None, block_indices=None, block_size: int = 128,
                         chunk: int | None = None):
    """Partials ``(o [B,Hq,D], m [B,Hq], l [B,Hq])`` float32 over the taking-part slots (see the module
    docstring); ``chunk``: rows per loop step (default :func:`chunk_rows`)."""
    b, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.reshape(b, hkv, g, d)
    scale = 1.0 / np.sqrt(np.float32(d))
    chunk = chunk or chunk_rows(b, hkv, d, np.dtype(k.dtype).itemsize)
    n_len = effective_lengths(lengths, b, s)
    init = (jnp.zeros((b, hkv, g, d), jnp.float32), jnp.full((b, hkv, g), NEG_INF, jnp.float32),
            jnp.zeros((b, hkv, g), jnp.float32))
    if block_indices is not None and np.shape(block_indices)[-1] == 0:  # nothing listed: the empty partial
        o, m, l = init
        return o.reshape(b, hq, d), m.reshape(b, hq), l.reshape(b, hq)
    if block_indices is None:
        body, trips = _contiguous(qg, k, v, valid, bias, n_len, min(chunk, s), scale)
    else:
        body, trips = _listed(qg, k, v, valid, bias, n_len, block_indices, int(min(block_size, s)), chunk, scale)
    o, m, l = jax.lax.fori_loop(0, trips, lambda i, c: _merge(c, body(i)), init)
    return o.reshape(b, hq, d), m.reshape(b, hq), l.reshape(b, hq)


def _contiguous(qg, k, v, valid, bias, n_len, c, scale):
    """Chunk ``i`` is the slots ``[i c, (i + 1) c)``; the last chunk is shifted back inside the buffer and its
    rows already visited are masked. Trip count: ``ceil(max lengths / c)``."""
    b, hkv, s, _ = k.shape

    def body(i):
        start = jnp.minimum(i * c, s - c)
        rows = start + jnp.arange(c, dtype=jnp.int32)  # [C]
        take = (rows[None, :] >= i * c) & (rows[None, :] < n_len[:, None])  # [B, C]
        take = jnp.broadcast_to(take[:, None, :], (b, hkv, c))
        sl = lambda x: jax.lax.dynamic_slice_in_dim(x, start, c, axis=2)  # noqa: E731
        if valid is not None:
            take = take & sl(valid).astype(bool)
        return _attend_chunk(qg, sl(k), sl(v), take, None if bias is None else sl(bias), scale)

    return body, (jnp.max(n_len) + c - 1) // c


def _gather_blocks(x, starts, bs: int):
    """``x [B, Hkv, S, ...]`` rows ``[starts, starts + bs)`` for ``starts [B, Hkv, N]`` (``<= S - bs``) -> ``[B,
    Hkv, N * bs, ...]``: one XLA gather of ``bs``-row windows (on CPU a copy per window, the cheapest form measured:
    ``benchmarks/roofline.py``)."""
    b, h, n = starts.shape
    bi = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None, None], starts.shape)
    hi = jnp.broadcast_to(jnp.arange(h, dtype=jnp.int32)[None, :, None], starts.shape)
    at = jnp.stack([bi, hi, starts.astype(jnp.int32)], axis=-1)  # [B, Hkv, N, 3]
    rest = tuple(range(4, x.ndim + 1))
    dn = jax.lax.GatherDimensionNumbers(offset_dims=(3, *rest), collapsed_slice_dims=(0, 1),
                                        start_index_map=(0, 1, 2))
    out = jax.lax.gather(x, at, dn, slice_sizes=(1, 1, bs, *x.shape[3:]), mode="clip")  # [B, Hkv, N, bs, ...]
    return out.reshape(b, h, n * bs, *x.shape[3:])


def _listed(qg, k, v, valid, bias, n_len, block_indices, bs: int, chunk: int, scale):
    """Chunk ``i`` gathers the ``i``-th group of ``nb = max(chunk // bs, 1)`` planned blocks of every ``(b, h)``.
    A block that would run past ``S`` is read from ``S - bs`` with its earlier rows masked. Trip count: the most
    blocks any ``(b, h)`` visits, over ``nb``."""
    b, hkv, s, _ = k.shape
    idx, count = plan_blocks(block_indices, n_len, b, hkv, s, bs)  # [B, Hkv, N] sorted, count first
    n = idx.shape[-1]
    nb = max(min(chunk // bs, n), 1)
    pad = -n % nb
    if pad:
        idx = jnp.concatenate([idx, jnp.broadcast_to(idx[..., -1:], (b, hkv, pad))], axis=-1)

    def body(i):
        ib = jax.lax.dynamic_slice_in_dim(idx, i * nb, nb, axis=2)  # [B, Hkv, nb]
        listed = (i * nb + jnp.arange(nb, dtype=jnp.int32))[None, None, :] < count[..., None]  # [B, Hkv, nb]
        first = ib * bs
        starts = jnp.minimum(first, s - bs)
        rows = starts[..., None] + jnp.arange(bs, dtype=jnp.int32)  # [B, Hkv, nb, bs]
        take = listed[..., None] & (rows >= first[..., None]) & (rows < n_len[:, None, None, None])
        take = take.reshape(b, hkv, nb * bs)
        gather = lambda x: _gather_blocks(x, starts, bs)  # noqa: E731
        if valid is not None:
            take = take & gather(valid).astype(bool)
        return _attend_chunk(qg, gather(k), gather(v), take, None if bias is None else gather(bias), scale)

    return body, (jnp.max(count) + nb - 1) // nb
