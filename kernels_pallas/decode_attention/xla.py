"""The XLA decode-attention path (``impl="xla"``, the CPU default): its cost follows the slots it reads.

Same contract as :func:`~kernels_pallas.decode_attention.reference.decode_attention_reference` (the spec, which
computes over all ``S`` slots and masks), but nothing is computed for a slot that cannot take part:

- without ``block_indices`` the slots ``[0, max_b lengths[b])`` are read in contiguous chunks of ``chunk`` rows
  (a ``lax.fori_loop`` whose trip count is the live length, so bucket padding and unwritten decode slots are
  never touched);
- with ``block_indices`` the listed blocks (sorted and de-duplicated by ``_common.plan_blocks``, blocks past
  ``lengths`` dropped) are *gathered* ``chunk // block_size`` at a time and attended; the trip count is the
  largest number of blocks any ``(b, h)`` lists, so listing fewer blocks costs less;
- :func:`decode_attention_runs_xla` reads *runs*: per ``(b, h)`` a list of contiguous slot ranges of any start
  and length (ClusterKV's clusters in its cluster-sorted layout, a recent window, the sinks), each cut into
  windows of ``block_size`` rows that are gathered and attended the same way. A run's last window is shifted
  back to end at the run's end (its rows already read are masked), so a run of at least ``block_size`` rows reads
  no slot outside it; a shorter run reads ``block_size`` rows. Each query head of a group can take its own prefix
  of a run (``lens [B, Hkv, G, R]``): the run is read once per KV head and masked per query head.

Both listed forms are one loop (:func:`_window_loop`) over *windows*: ``(first, stop)`` row ranges of at most
``block_size`` rows, read as one ``block_size``-row gather window from ``min(first, stop - block_size)`` (clamped
into the buffer) with the rows outside ``[first, stop)`` masked. The gather reads each window as one contiguous
``block_size * D`` slice of the ``[B, Hkv, S * D]`` view of the buffer (a free reshape): on XLA:CPU this copies
at close to the contiguous read rate, where a ``[block_size, D]`` window gather, or a gather of single rows,
costs up to twice as much per row (measured: ``benchmarks/roofline.py`` and the module's docstring history).

Each chunk is attended with the flash-decoding recurrence (Dao et al. 2023, §3.1) and merged into the running
partials ``(o, m, l)``, so the result equals the reference up to float rounding. A chunk of ``[B, Hkv, chunk,
D]`` keys and values is sized to stay in the CPU's cache (``chunk_rows``), so a gathered chunk is written and
read back from cache, not from memory.

Shapes as in the reference: q ``[B, Hq, D]``; k, v ``[B, Hkv, S, D]``; valid, bias ``[B, Hkv, S]``; lengths
``[B]``; block_indices ``[B, Hkv, N]`` or ``[B, N]``; run starts ``[B, Hkv, R]``, lens ``[B, Hkv, R]`` or ``[B,
Hkv, G, R]``. Einsum axes: b batch, h KV head, g query head in the group, s slot of the chunk, d head dim.
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
    """Scores ``scale * qg·kk`` of ``qg [B,Hkv,G,D]`` against ``kk [B,Hkv,C,D]``, masked by ``take [B,Hkv,C]`` (or per
    query head ``[B,Hkv,G,C]``) with the additive ``add [B,Hkv,C]`` (or None): returns the chunk's ``(o [B,Hkv,G,D],
    m, l [B,Hkv,G])``."""
    s = jnp.einsum("bhsd,bhgd->bhgs", kk, qg, preferred_element_type=jnp.float32) * scale
    if add is not None:
        s = s + add[:, :, None, :].astype(jnp.float32)
    t = take if take.ndim == 4 else take[:, :, None, :]
    s = jnp.where(t, s, NEG_INF)
    m = jnp.max(s, axis=-1)
    p = jnp.where(t, jnp.exp(s - m[..., None]), 0.0)
    o = jnp.einsum("bhgs,bhsd->bhgd", p.astype(vv.dtype), vv, preferred_element_type=jnp.float32)
    return o, m, jnp.sum(p, axis=-1)


def _merge(a, b):
    (oa, ma, la), (ob, mb, lb) = a, b
    m = jnp.maximum(ma, mb)
    ca, cb = jnp.exp(ma - m), jnp.exp(mb - m)
    return oa * ca[..., None] + ob * cb[..., None], m, la * ca + lb * cb


def _init(b, hkv, g, d):
    return (
        jnp.zeros((b, hkv, g, d), jnp.float32),
        jnp.full((b, hkv, g), NEG_INF, jnp.float32),
        jnp.zeros((b, hkv, g), jnp.float32),
    )


def _out(part, b, hq, d):
    o, m, l = part
    return o.reshape(b, hq, d), m.reshape(b, hq), l.reshape(b, hq)


def decode_attention_xla(
    q, k, v, valid=None, lengths=None, bias=None, block_indices=None, block_size: int = 128, chunk: int | None = None
):
    """Partials ``(o [B,Hq,D], m [B,Hq], l [B,Hq])`` float32 over the taking-part slots (see the module
    docstring); ``chunk``: rows per loop step (default :func:`chunk_rows`)."""
    b, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.reshape(b, hkv, g, d)
    scale = 1.0 / np.sqrt(np.float32(d))
    chunk = chunk or chunk_rows(b, hkv, d, np.dtype(k.dtype).itemsize)
    n_len = effective_lengths(lengths, b, s)
    if block_indices is not None and np.shape(block_indices)[-1] == 0:  # nothing listed: the empty partial
        return _out(_init(b, hkv, g, d), b, hq, d)
    if block_indices is None:
        body, trips = _contiguous(qg, k, v, valid, bias, n_len, min(chunk, s), scale)
        return _out(jax.lax.fori_loop(0, trips, lambda i, c: _merge(c, body(i)), _init(b, hkv, g, d)), b, hq, d)
    bs = int(min(block_size, s))
    idx, count = plan_blocks(block_indices, n_len, b, hkv, s, bs)  # [B, Hkv, N] sorted, count first
    first = idx * bs
    stop = jnp.minimum(first + bs, n_len[:, None, None])
    return _out(_window_loop(qg, k, v, valid, bias, first, stop, count, bs, chunk, scale), b, hq, d)


def decode_attention_runs_xla(q, k, v, starts, lens, *, max_rows: int, block_size: int = 16, chunk: int | None = None):
    """Partials ``(o [B,Hq,D], m [B,Hq], l [B,Hq])`` float32 over runs of slots: query head ``g`` of KV head ``h``
    attends the rows ``[starts[b,h,r], starts[b,h,r] + lens[b,h,(g,)r])`` of every run ``r`` (runs of one ``(b, h)``
    must not overlap; a length of 0 lists nothing). ``max_rows`` (static) bounds ``Σ_r max_g lens`` for every
    ``(b, h)``: it sizes the window list (``ceil(max_rows / block_size) + R`` windows); runs beyond it are dropped,
    so it must hold."""
    b, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = hq // hkv
    bs = int(min(block_size, s))
    chunk = chunk or chunk_rows(b, hkv, d, np.dtype(k.dtype).itemsize)
    scale = 1.0 / np.sqrt(np.float32(d))
    first, stop, count = run_windows(starts, lens, bs, -(-int(max_rows) // bs) + starts.shape[-1])
    part = _window_loop(q.reshape(b, hkv, g, d), k, v, None, None, first, stop, count, bs, chunk, scale)
    return _out(part, b, hq, d)


def run_windows(starts, lens, bs: int, max_windows: int):
    """Cut runs into windows of at most ``bs`` rows: ``(first [B,Hkv,W], stop [B,Hkv,W] or [B,Hkv,G,W], count
    [B,Hkv])`` with ``W = max_windows``, the ``count`` real windows first (run order, then row order), the
    others empty (``stop = first``). starts ``[B,Hkv,R]``; lens ``[B,Hkv,R]`` or ``[B,Hkv,G,R]`` (per query head:
    the window list covers the longest, ``stop`` is per head)."""
    span = lens if lens.ndim == 3 else jnp.max(lens, axis=2)  # [B, Hkv, R]
    span = jnp.maximum(span, 0).astype(jnp.int32)
    nwin = (span + bs - 1) // bs
    cum = jnp.cumsum(nwin, axis=-1)  # inclusive
    count = cum[..., -1]
    w = jnp.arange(max_windows, dtype=jnp.int32)
    lead = cum.shape[:-1]
    # the run of each window: a binary search (a loop of log2(R) trips) on CPU; on GPU/TPU one comparison of every
    # window with every run end, no loop (a GPU runs each trip of a loop with its own launches)
    how = "scan" if jax.default_backend() == "cpu" else "compare_all"
    r = jax.vmap(lambda c: jnp.searchsorted(c, w, side="right", method=how))(cum.reshape(-1, cum.shape[-1]))
    r = jnp.minimum(r.reshape(*lead, max_windows), starts.shape[-1] - 1).astype(jnp.int32)  # run of window w
    at = lambda x: jnp.take_along_axis(x, r, axis=-1)  # noqa: E731
    off = (w - at(cum - nwin)) * bs  # rows of the run before the window
    first = at(starts.astype(jnp.int32)) + off
    real = w < count[..., None]
    if lens.ndim == 3:
        stop = first + jnp.clip(at(span) - off, 0, bs)
        return first, jnp.where(real, stop, first), count
    take = jnp.take_along_axis(
        lens.astype(jnp.int32), jnp.broadcast_to(r[:, :, None], lens.shape[:3] + r.shape[-1:]), axis=-1
    )  # [B, Hkv, G, W]
    stop = first[:, :, None] + jnp.clip(take - off[:, :, None], 0, bs)
    return first, jnp.where(real[:, :, None], stop, first[:, :, None]), count


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


def gather_windows(x, at, bs: int):
    """``x [B, Hkv, S, ...]`` rows ``[at, at + bs)`` for ``at [B, Hkv, N]`` (``0 <= at <= S - bs``) -> ``[B, Hkv,
    N * bs, ...]``: one XLA gather of ``bs * prod(...)``-element slices of the flat ``[B, Hkv, S * prod(...)]`` view
    (a bitcast), the cheapest form measured on XLA:CPU."""
    b, h, n = at.shape
    s = x.shape[2]
    inner = int(np.prod(x.shape[3:], dtype=np.int64))
    flat = x.reshape(b, h, s * inner)
    bi = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None, None], at.shape)
    hi = jnp.broadcast_to(jnp.arange(h, dtype=jnp.int32)[None, :, None], at.shape)
    idx = jnp.stack([bi, hi, at.astype(jnp.int32) * inner], axis=-1)  # [B, Hkv, N, 3]
    dn = jax.lax.GatherDimensionNumbers(offset_dims=(3,), collapsed_slice_dims=(0, 1), start_index_map=(0, 1, 2))
    out = jax.lax.gather(flat, idx, dn, slice_sizes=(1, 1, bs * inner), mode="clip")  # [B, Hkv, N, bs * inner]
    return out.reshape(b, h, n * bs, *x.shape[3:])


def _window_mask(at, first, stop, count, bs: int):
    """``[B, Hkv, W * bs]`` bool (``[B, Hkv, G, W * bs]`` for a per-query ``stop``): row ``j`` of window ``n``,
    read from ``at + j``, takes part iff the window is listed (``n < count``) and ``first <= at + j < stop``. Built
    once before the loop and sliced per chunk: computed inside the loop body, XLA:CPU fused it into the softmax and
    the step cost ~30% more (32k slots, 410 listed 16-row blocks: 8.4 -> 6.1 ms)."""
    b, hkv, w = at.shape
    listed = jnp.arange(w, dtype=jnp.int32)[None, None, :] < count[..., None]  # [B, Hkv, W]
    rows = at[..., None] + jnp.arange(bs, dtype=jnp.int32)  # [B, Hkv, W, bs]
    if stop.ndim == 4:
        take = (listed[..., None] & (rows >= first[..., None]))[:, :, None] & (rows[:, :, None] < stop[..., None])
        return take.reshape(b, hkv, stop.shape[2], w * bs)
    return (listed[..., None] & (rows >= first[..., None]) & (rows < stop[..., None])).reshape(b, hkv, w * bs)


def _window_loop(qg, k, v, valid, bias, first, stop, count, bs: int, chunk: int, scale):
    """Partials ``(o, m, l)`` ``[B, Hkv, G, ...]`` over windows: window ``n`` of ``(b, h)`` takes rows ``[first, stop)``
    (``stop [B, Hkv, W]``, or per query head ``[B, Hkv, G, W]``; at most ``bs`` rows, the windows ``>= count[b,
    h]`` none), read as the ``bs`` rows from ``min(first, max_g stop - bs)`` clamped into ``[0, S - bs]``. Chunk
    ``i`` gathers windows ``[i nb, (i + 1) nb)`` with ``nb = max(chunk // bs, 1)``; trip count: the most windows any
    ``(b, h)`` has, over ``nb``."""
    b, hkv, s, _ = k.shape
    g = qg.shape[2]
    per_query = stop.ndim == 4
    w = first.shape[-1]
    nb = max(min(chunk // bs, w), 1)
    pad = -w % nb
    if pad:
        first = jnp.concatenate([first, jnp.broadcast_to(first[..., -1:], (b, hkv, pad))], axis=-1)
        stop = jnp.concatenate([stop, jnp.broadcast_to(stop[..., -1:], stop.shape[:-1] + (pad,))], axis=-1)
    top = jnp.max(stop, axis=2) if per_query else stop  # [B, Hkv, W]
    at = jnp.clip(jnp.minimum(first, top - bs), 0, s - bs)
    take = _window_mask(at, first, stop, count, bs)  # [B, Hkv, (G,) W * bs], built once

    def body(i, carry):
        a = jax.lax.dynamic_slice_in_dim(at, i * nb, nb, axis=2)
        tk = jax.lax.dynamic_slice_in_dim(take, i * nb * bs, nb * bs, axis=take.ndim - 1)
        gather = lambda x: gather_windows(x, a, bs)  # noqa: E731
        if valid is not None:
            ok = gather(valid).astype(bool)
            tk = tk & (ok[:, :, None] if per_query else ok)
        part = _attend_chunk(qg, gather(k), gather(v), tk, None if bias is None else gather(bias), scale)
        return _merge(carry, part)

    return jax.lax.fori_loop(0, (jnp.max(count) + nb - 1) // nb, body, _init(b, hkv, g, qg.shape[-1]))
