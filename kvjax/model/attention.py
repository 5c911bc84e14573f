"""Decode attention over a buffer of slots, returning mergeable partials (docs/architecture.md#kernels-return-partials).

``attend`` computes, for one new query per head, attention over ``S`` slots with a validity mask and an
optional additive bias (e.g. Chelsea's ``log N``), and returns the flash-decoding partials
``(o_unnormalised, m, l)``: ``m`` the running max of the scaled scores, ``l = sum exp(s - m)`` and
``o = sum exp(s - m) v``. Partials over disjoint slot sets merge exactly with ``merge`` and ``normalise``
gives softmax attention. GQA is native: KV heads are never repeated. ``attend`` delegates to
``kernels_pallas.decode_attention`` (pure-JAX reference on CPU, Pallas kernels on TPU/GPU; same contract).
``attend_with_scores`` is the pass H2O needs beside the partials: one loop over the live slots that also keeps
every slot's score ``q·k`` (the kernels return no per-slot values), so the weights cost no second read of K.

Shapes: q ``[B, Hq, D]``; k, v ``[B, Hkv, S, D]``; valid ``[B, Hkv, S]`` bool; bias ``[B, Hkv, S]`` float;
o ``[B, Hq, D]`` float32; m, l ``[B, Hq]`` float32. Axes: b batch, h KV head, g query head in group, s slot,
d head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.decode_attention import (
    NEG_INF,  # -1e30
    decode_attention,
    decode_attention_runs,
    merge,
)
from kernels_pallas.decode_attention import normalise as _normalise
from kvjax.model import sinks as _sinks
from kernels_pallas.decode_attention.xla import chunk_rows
from kvjax import sharding

__all__ = [
    "NEG_INF",
    "attend",
    "attend_runs",
    "attend_with_scores",
    "attend_with_weights",
    "merge",
    "normalise",
    "scores",
    "token_partial",
]


_CURRENT = object()


def normalise(partial, sinks=_CURRENT) -> jnp.ndarray:
    """Softmax-normalised output ``[B, Hq, D]`` float32 of partials ``(o, m, l)`` (zero where no slot took part).
    With attention sinks (``sinks [Hq]``; default: the sinks of the layer being run, :mod:`kvjax.model.sinks`, None on a
    model without them) each head's sink logit joins the denominator: ``o / (l + exp(sink - m))``."""
    sinks = _sinks.current() if sinks is _CURRENT else sinks
    if sinks is None:
        return _normalise(partial)
    return _sinks.normalise_with_sinks(partial, sinks)


def scores(q: jnp.ndarray, k: jnp.ndarray) -> jnp.ndarray:
    """Scaled scores ``q·k/sqrt(D)`` as ``[B, Hkv, G, S]`` float32."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, d)
    return jnp.einsum("bhgd,bhsd->bhgs", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(d))


def attend(q, k, v, valid, bias=None, *, lengths=None, block_indices=None, block_size: int | None = None, impl=None):
    """Partials ``(o_unnormalised [B,Hq,D], m [B,Hq], l [B,Hq])`` of attention over the valid slots.

    ``lengths [B]``: only slots ``[0, lengths[b])`` can take part, and the Pallas kernels read no block past it
    (every method passes its fill count, so decode never reads bucket padding or unwritten decode slots);
    ``block_indices``: the slot blocks of ``block_size`` slots to visit (block_size None: 128 with a block list,
    else the kernel's tuned tile, ``kernels_pallas.decode_attention.tuning``). A row with no valid slot returns ``o = 0,
    l = 0, m = NEG_INF`` (it merges as an empty set). Routed through
    ``kernels_pallas.decode_attention.decode_attention``: ``impl``
    is ``"xla" | "pallas_tpu" | "pallas_gpu"`` or None (by backend: the Pallas kernel on TPU/GPU, the pure-JAX
    reference on CPU). On a mesh (:mod:`kvjax.sharding`) the kernel runs per device on its sequences and heads.
    """

    def run(q, k, v, valid, lengths, bias, block_indices):  # one device's sequences and heads on a mesh
        return decode_attention(q, k, v, valid, lengths, bias, block_indices, block_size=block_size, impl=impl)

    shared = (6,) if block_indices is not None and block_indices.ndim == 2 else ()  # [B, N]: one list per sequence
    return sharding.per_head(run, q, k, v, valid, lengths, bias, block_indices, batch_only=shared)


def token_partial(q, k, v):
    """Partials ``(o [B,Hq,D], m [B,Hq], l [B,Hq])`` float32 of ``q [B, Hq, D]`` over one key/value per KV head
    (``k, v [B, Hkv, D]``, e.g. the new token): ``o = v``, ``m = q·k / sqrt(D)``, ``l = 1``. Exact, and no kernel
    call over a one-slot buffer (a Pallas block of one row does not lower on TPU)."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, d)
    m = jnp.einsum("bhd,bhgd->bhg", k, qg, preferred_element_type=jnp.float32) / np.sqrt(np.float32(d))
    o = jnp.broadcast_to(v.astype(jnp.float32)[:, :, None, :], qg.shape)
    return o.reshape(b, hq, d), m.reshape(b, hq), jnp.ones((b, hq), jnp.float32)


def attend_runs(q, k, v, starts, lens, *, max_rows: int, block_size: int = 16, impl=None):
    """Partials ``(o, m, l)`` of attention over runs of slots: query head ``g`` of KV head ``h`` attends
    ``[starts[b,h,r], starts[b,h,r] + lens[b,h,(g,)r])`` for every run ``r`` (starts ``[B, Hkv, R]``, lens ``[B,
    Hkv, R]`` or per query head ``[B, Hkv, G, R]``; runs of one ``(b, h)`` disjoint; ``max_rows`` a static bound on
    ``Σ_r max_g lens``). Each run is read as contiguous windows of ``block_size`` rows, once per KV head
    (``kernels_pallas.decode_attention.decode_attention_runs``). On a mesh it runs per device on its sequences
    and heads."""

    def run(q, k, v, starts, lens):
        return decode_attention_runs(q, k, v, starts, lens, max_rows=max_rows, block_size=block_size, impl=impl)

    return sharding.per_head(run, q, k, v, starts, lens)


def attend_with_weights(q, k, v, valid, lengths=None):
    """The partials ``(o, m, l)`` and the softmax weights ``[B, Hkv, G, S]`` float32 of the new query over the
    taking-part slots (zero elsewhere), from :func:`attend_with_scores` (one pass over the live chunks of K and V;
    the weights ``exp(s - m) / l`` are formed over all ``S`` slots, so this is for tests and small buffers: H2O's
    step forms them chunk by chunk, only over its live slots)."""
    b, hq, d = q.shape
    lengths = jnp.full((b,), k.shape[2], jnp.int32) if lengths is None else lengths
    (o, m, l), s, _, _ = attend_with_scores(q, k, v, valid, lengths)
    hkv = k.shape[1]
    mg, lg = m.reshape(b, hkv, -1), l.reshape(b, hkv, -1)
    take = valid.astype(bool) & (jnp.arange(k.shape[2])[None, None, :] < lengths[:, None, None])
    p = jnp.where(take[:, :, None, :], jnp.exp(s - mg[..., None]), 0.0)
    return (o, m, l), p / jnp.where(lg > 0, lg, 1.0)[..., None]


def one_pass() -> bool:
    """Whether a decode step reads its buffers in one pass (GPU/TPU) rather than in the CPU's loops over cache-sized
    chunks: a GPU runs each trip of a loop after a host synchronisation (:func:`chunk_loop`). Read at trace time;
    every chunk size of the methods' steps follows it."""
    return jax.default_backend() != "cpu"


def live_chunk(s: int, b: int, hkv: int, d: int, itemsize: int, chunk: int | None = None) -> int:
    """Slots per step of a loop over the live slots: ``chunk`` if given, else on CPU a cache-sized chunk
    (``kernels_pallas.decode_attention.xla.chunk_rows``), elsewhere all ``S`` at once (:func:`one_pass`); at most
    ``S``."""
    if chunk is None:
        chunk = s if one_pass() else chunk_rows(b, hkv, d, itemsize)
    return int(max(min(chunk, s), 1))


def live_rows(i, c: int, s: int, lengths):
    """Chunk ``i`` of a loop over the slots ``[0, max lengths)`` in chunks of ``c``: ``(start, rows [C], fresh [B,
    C])`` -- the chunk is ``[start, start + c)``, the last one shifted back inside the buffer (``start = min(i c, S -
    c)``), and ``fresh`` marks its rows not visited by an earlier chunk and below the sequence's length."""
    start = jnp.minimum(i * c, s - c)
    rows = start + jnp.arange(c, dtype=jnp.int32)
    fresh = (rows[None, :] >= i * c) & (rows[None, :] < lengths[:, None])
    return start, rows, fresh


def live_trips(lengths, c: int):
    """Trip count of a loop over ``[0, max lengths)`` in chunks of ``c`` (dynamic: bucket padding and unwritten
    slots are never visited)."""
    return (jnp.max(lengths).astype(jnp.int32) + c - 1) // c


def chunk_loop(trips, c: int, s: int, body, init):
    """``lax.fori_loop(0, trips, body, init)`` over chunks of ``c`` of ``s`` slots; when one chunk covers them all
    (``c >= s``: :func:`live_chunk`'s default on GPU/TPU) the body once, ``body(0, init)``, and no loop. On a GPU a
    loop with a dynamic trip count is a while loop whose predicate the host reads back before every iteration (a
    synchronisation that stalls the step's queue), so a loop of at most one trip is the body alone. The body must
    leave what it does not take (rows past the lengths: :func:`live_rows`'s ``fresh``) untouched, so the trip that
    the loop would have skipped (``trips == 0``) changes nothing."""
    if c >= s:
        return body(0, init)
    return jax.lax.fori_loop(0, trips, body, init)


def half_live(live, s: int):
    """Whether at least half of ``s`` rows are live (``live``: a traced or host int): where a CPU pass over small
    per-row data (Quest's page bounds, PQCache's codes) is cheaper as one product over every row than as a loop over
    the live chunks (the loop's slices and writes cost more than reading the rest: :func:`live_pass`)."""
    return 2 * live >= s


def live_pass(live, c: int, s: int, body, init, whole):
    """A pass over the ``live`` leading rows of ``s``: :func:`chunk_loop` over chunks of ``c``, or, where ``c < s``
    (the CPU's chunks) and at least half the rows are live (:func:`half_live`), ``whole()``, which covers all ``s``
    at once (a ``lax.cond``: both are compiled, one runs). :func:`live_pass_rows` counts its rows on the host."""
    chunked = lambda: chunk_loop((live + c - 1) // c, c, s, body, init)  # noqa: E731
    return chunked() if c >= s else jax.lax.cond(half_live(live, s), whole, chunked)


def live_pass_rows(live: int, c: int, s: int) -> int:
    """On the host, the rows :func:`live_pass` reads over ``live`` rows of ``s`` in chunks of ``c``."""
    if c >= s or half_live(live, s):
        return s
    return min(chunk_trips(live, c, s) * c, s)


def chunk_trips(live: int, c: int, s: int) -> int:
    """On the host, the trips :func:`chunk_loop` makes over ``live`` rows in chunks of ``c`` of ``s``: one where a
    chunk covers them (the body runs once, live rows or not), else ``ceil(live / c)`` (for the byte counts)."""
    return 1 if c >= s else -(-int(live) // c)


def attend_with_scores(q, k, v, valid, lengths, *, start=None, chunk: int | None = None):
    """One pass over the live chunks of K and V: the partials of attention over the taking-part slots and, as a
    by-product of the same ``q·k``, every slot's scaled score (H2O accumulates the weights ``exp(s - m) / l``).

    A slot ``s`` of ``(b, h)`` takes part iff ``s < lengths[b]`` and ``valid[b, h, s]`` (bool, or an int array such
    as slot positions: taking part where ``>= 0``). The loop visits only ``[0, max lengths)``, ``chunk`` slots per
    step (:func:`live_chunk`), each chunk attended with the flash-decoding recurrence and merged (as
    ``kernels_pallas.decode_attention.xla``). Returns ``((o [B,Hq,D], m [B,Hq], l [B,Hq]), scores [B, Hkv, G, S]
    float32 (``q·k/sqrt(D)`` of the visited slots, 0 for slots never visited), taken [B, Hkv] int32 (slots taking
    part), free [B, Hkv] int32 (the first slot below ``lengths[b]`` that does not take part, else ``lengths[b]``))``.
    ``start``: partials ``(o [B,Hq,D], m [B,Hq], l [B,Hq])`` the chunks are merged into (e.g. a new token's own,
    attended beside the buffer; default the empty partial), so the result leaves the loop whole. Reads K, V and
    ``valid`` of the live slots once, writes the scores once.
    """
    b, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = hq // hkv
    c = live_chunk(s, b, hkv, d, np.dtype(k.dtype).itemsize, chunk)
    lengths = jnp.asarray(lengths, jnp.int32)
    qg = q.reshape(b, hkv, g, d)
    scale = 1.0 / np.sqrt(np.float32(d))

    def body(i, carry):
        part, sc, taken, free = carry
        start, rows, fresh = live_rows(i, c, s, lengths)
        sl = lambda x: jax.lax.dynamic_slice_in_dim(x, start, c, axis=2)  # noqa: E731
        ok = sl(valid)
        ok = ok if ok.dtype == jnp.bool_ else ok >= 0
        fresh = fresh[:, None, :]
        take = fresh & ok  # [B, Hkv, C]
        x = jnp.einsum("bhsd,bhgd->bhgs", sl(k), qg, preferred_element_type=jnp.float32) * scale
        sc = jax.lax.dynamic_update_slice_in_dim(sc, x, start, axis=3)
        x = jnp.where(take[:, :, None, :], x, NEG_INF)
        mc = jnp.max(x, axis=-1)
        p = jnp.where(take[:, :, None, :], jnp.exp(x - mc[..., None]), 0.0)
        oc = jnp.einsum("bhgs,bhsd->bhgd", p.astype(v.dtype), sl(v), preferred_element_type=jnp.float32)
        part = merge(part, (oc, mc, jnp.sum(p, axis=-1)))
        taken = taken + jnp.sum(take, axis=-1, dtype=jnp.int32)
        free = jnp.minimum(free, jnp.min(jnp.where(fresh & ~ok, rows, s), axis=-1))
        return part, sc, taken, free

    if start is None:
        start = (
            jnp.zeros((b, hq, d), jnp.float32),
            jnp.full((b, hq), NEG_INF, jnp.float32),
            jnp.zeros((b, hq), jnp.float32),
        )
    start = tuple(x.astype(jnp.float32).reshape((b, hkv, g) + x.shape[2:]) for x in start)
    init = (
        start,
        jnp.zeros((b, hkv, g, s), jnp.float32),
        jnp.zeros((b, hkv), jnp.int32),
        jnp.broadcast_to(lengths[:, None], (b, hkv)),
    )
    # a loop even of one trip (not chunk_loop): H2O writes the victim's slot of K, V and the positions after this
    # read, at an index the read decides, and straight-line XLA copies those buffers twice to order the two
    (o, m, l), sc, taken, free = jax.lax.fori_loop(0, live_trips(lengths, c), body, init)
    return (o.reshape(b, hq, d), m.reshape(b, hq), l.reshape(b, hq)), sc, taken, free
