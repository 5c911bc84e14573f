"""What a PQCache decode step attends and reads (method note ``docs/notes/pqcache.md`` §2.4-2.5, §8.5-8.8): the new
token, the sinks, the local window and the retrieved rows, each attended as partials and merged. :func:`parts` is
the plan of those attention calls; :func:`sparse_attend` (the step) and :func:`read_bytes` (what it reads, for
``bytes_read_per_step``) both walk it, so the byte count follows the code that reads: a part, a chunk size or a
trip count changed in one is changed in the other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.decode_attention import default_impl as attention_impl
from kernels_pallas.decode_attention.xla import chunk_rows
from kvjax.model import attention
from kvjax.model.attention import NEG_INF
from kvjax.methods.base import rows_at


def rows_mask(idx, ok, s: int) -> jnp.ndarray:
    """``[B, Hkv, S]`` bool: the slots ``idx [B, Hkv, N]`` whose ``ok`` is set."""
    b, h = idx.shape[:2]
    return rows_at(jnp.zeros((b, h, s), bool), idx, ok, "max")


def empty_partial(q):
    b, hq, d = q.shape
    return (
        jnp.zeros((b, hq, d), jnp.float32),
        jnp.full((b, hq), NEG_INF, jnp.float32),
        jnp.zeros((b, hq), jnp.float32),
    )


def range_trips(lo, hi, c: int, lo0=None):
    """Chunks of ``c`` slots from ``min(lo)`` that cover every ``[lo[b], hi[b])`` (traced or host arrays; ``lo0``:
    ``min(lo)`` where the caller has it)."""
    xp = jnp if isinstance(lo, jax.Array) or isinstance(hi, jax.Array) else np
    return xp.maximum(xp.max(hi) - (xp.min(lo) if lo0 is None else lo0) + c - 1, 0) // c


def attend_range(q, k, v, lo, hi, chunk: int):
    """Partials of ``q [B, Hq, D]`` over the contiguous slots ``[lo[b], hi[b])`` of ``k, v [B, Hkv, S, D]``, read
    in chunks of ``chunk`` slots from ``min(lo)`` (one slice of every row per chunk; trip count: :func:`range_trips`;
    rows of a row's chunk outside its own range are masked)."""
    b, h, s, _ = k.shape
    c = min(chunk, s)
    lo0 = jnp.min(lo)

    def body(i, acc):
        first = lo0 + i * c
        start = jnp.clip(first, 0, s - c)
        rows = start + jnp.arange(c, dtype=jnp.int32)  # [C]
        take = (rows[None, :] >= jnp.maximum(first, lo)[:, None]) & (rows[None, :] < hi[:, None])  # [B, C]
        cut = lambda x: jax.lax.dynamic_slice_in_dim(x, start, c, axis=2)  # noqa: E731
        return attention.merge(acc, attention.attend(q, cut(k), cut(v), jnp.broadcast_to(take[:, None], (b, h, c))))

    return jax.lax.fori_loop(0, range_trips(lo, hi, c, lo0), body, empty_partial(q))


def attend_rows(q, k, v, idx, ok, chunk: int):
    """Partials of ``q`` over the rows ``idx [B, Hkv, N]`` (``ok`` a prefix of each row) of ``k, v``, gathered
    ``chunk`` rows at a time (trip count: the most ``ok`` entries of any row over ``chunk``, as
    :func:`kvjax.model.attention.chunk_trips` counts them)."""
    n = idx.shape[-1]
    c = min(chunk, n)
    pad = -n % c
    if pad:
        idx = jnp.concatenate([idx, jnp.broadcast_to(idx[..., -1:], (*idx.shape[:2], pad))], axis=-1)
        ok = jnp.concatenate([ok, jnp.zeros((*ok.shape[:2], pad), bool)], axis=-1)
    trips = (jnp.max(jnp.sum(ok, axis=-1)) + c - 1) // c

    def body(i, acc):
        ii = jax.lax.dynamic_slice_in_dim(idx, i * c, c, axis=2)
        take = jax.lax.dynamic_slice_in_dim(ok, i * c, c, axis=2)
        kk = jnp.take_along_axis(k, ii[..., None], axis=2, mode="clip")
        vv = jnp.take_along_axis(v, ii[..., None], axis=2, mode="clip")
        return attention.merge(acc, attention.attend(q, kk, vv, take))

    return attention.chunk_loop(trips, c, idx.shape[-1], body, empty_partial(q))


def attend_window(q, k, v, lo, hi, width: int):
    """Partials of ``q`` over ``[lo[b], hi[b])`` (at most ``width`` rows each) without a loop: one slice of ``width``
    rows per sequence from ``clip(lo, 0, S - width)`` (a gather on XLA:CPU, so the CPU takes
    :func:`attend_range`'s shared slices instead)."""
    b, h, s, _ = k.shape
    width = min(width, s)
    start = jnp.clip(lo, 0, s - width)
    cut = lambda x: jax.vmap(lambda xb, st: jax.lax.dynamic_slice_in_dim(xb, st, width, axis=1))(x, start)  # noqa: E731
    rows = start[:, None] + jnp.arange(width, dtype=jnp.int32)
    take = (rows >= lo[:, None]) & (rows < hi[:, None])  # [B, W]
    return attention.attend(q, cut(k), cut(v), jnp.broadcast_to(take[:, None], (b, h, width)))


def row_chunk(k) -> int:
    """Rows per attention chunk: cache-sized on the XLA path (``chunk_rows``), everything at once where the
    decode attention is a Pallas kernel (one gather, one kernel call)."""
    if attention_impl() == "xla":
        b, h, _, d = k.shape
        return chunk_rows(b, h, d, np.dtype(k.dtype).itemsize)
    return 1 << 30


def parts(k, *, sink: int, window: int, topk: int) -> tuple[tuple[str, int], ...]:
    """The sparse step's attention calls over ``k [B, Hkv, S, D]``, in merge order, with the rows each call reads:
    the new token (``"token"``, 1, from the step's input), the sinks (``"sink"``, all ``sink`` rows), the local window
    (``"window"``: one slice of its width per sequence, one pass, :func:`kvjax.model.attention.one_pass`, else chunks of
    ``min(chunk, W)`` from the batch's earliest window start) and the retrieved rows (``"retrieved"``: chunks of
    ``min(chunk, topk)``); ``chunk``: :func:`row_chunk`. Static: read at trace time (the step) or on the host (the
    byte count)."""
    s, chunk = k.shape[2], row_chunk(k)
    out = [("token", 1)]
    if sink:
        out.append(("sink", sink))
    if window:
        out.append(("window", min(window, s) if attention.one_pass() else min(chunk, window, s)))
    if topk:
        out.append(("retrieved", min(chunk, topk)))
    return tuple(out)


def sparse_attend(q, k, v, kc, vc, t, w, idx, ok, *, sink: int, window: int, topk: int):
    """Partials of ``q [B, Hq, D]`` over the step's sparse set, as :func:`parts` plans it: the new token ``k, v [B,
    Hkv, D]`` (at ``t [B]``), the sinks ``[0, min(sink, t))``, the window ``[max(t - w, sink), t)`` and the
    retrieved rows ``idx``/``ok [B, Hkv, topk]`` of the cache ``kc, vc [B, Hkv, S, D]``."""
    b, h, s, _ = kc.shape
    dt = kc.dtype
    part = attention.token_partial(q, k.astype(dt), v.astype(dt))
    for name, c in parts(kc, sink=sink, window=window, topk=topk)[1:]:
        if name == "sink":
            live = jnp.broadcast_to((jnp.arange(sink)[None, :] < t[:, None])[:, None, :], (b, h, sink))
            got = attention.attend(q, kc[:, :, :sink], vc[:, :, :sink], live)
        elif name == "window":
            hi, lo = jnp.minimum(t, s), jnp.maximum(t - w, sink)
            one = attention.one_pass()
            got = attend_window(q, kc, vc, lo, hi, c) if one else attend_range(q, kc, vc, lo, hi, c)
        else:
            got = attend_rows(q, kc, vc, idx, ok, c)
        part = attention.merge(part, got)
    return part


def read_bytes(k, t, w, kk, end, *, hq: int, sink: int, window: int, topk: int) -> dict[str, int]:
    """Host bytes :func:`sparse_attend` reads for the step whose new token is at ``t [B]`` (window sizes ``w``,
    retrieved counts ``kk``, candidate ends ``end``: host int arrays), walking the same :func:`parts`: ``kv``, the K
    and V rows of every call's chunks (padding rows of a last chunk included; the new token's are the input), and
    ``attention``, per call the query and the partial outputs plus one mask byte per row."""
    b, h, s, d = k.shape
    item = np.dtype(k.dtype).itemsize
    qo = b * hq * d * item + b * hq * (d + 2) * 4  # one call's query and partial outputs
    calls = rows = kv = 0
    for name, c in parts(k, sink=sink, window=window, topk=topk):
        if name in ("token", "sink"):
            trips = 1
        elif name == "window":
            one = attention.one_pass()
            trips = 1 if one else int(range_trips(np.maximum(t - w, sink), np.minimum(t, s), c))
        else:
            trips = attention.chunk_trips(np.minimum(kk, np.maximum(end - sink, 0)).max(), c, topk)
        calls, rows = calls + trips, rows + trips * c
        kv += 0 if name == "token" else b * h * trips * c * 2 * d * item
    return {"kv": kv, "attention": calls * qo + b * h * rows}
