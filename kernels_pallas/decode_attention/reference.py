"""Pure-JAX decode attention returning flash-decoding partials: the spec and the CPU (``xla``) path.

One new query per head attends over ``S`` slots (docs/architecture.md#kernels-return-partials). A slot ``s`` of
batch row ``b``, KV head ``h`` takes part iff all of: ``valid[b, h, s]`` (when given), ``s < lengths[b]`` (when
given), and its block ``s // block_size`` is listed in ``block_indices[b, h]`` (when given; entries outside
``[0, S/block_size)``, e.g. ``-1``, list nothing, repeats count once). Scores are ``q·k / sqrt(D) + bias``
(the bias is e.g. Chelsea's ``log N``, §5 Eq. 2). The result is the partial triple

    m = max_s score,   l = sum_s exp(score - m),   o = sum_s exp(score - m) v_s

(FlashAttention-2 / flash-decoding, Dao et al. 2023, §3.1), all float32; a row with no taking-part slot has
``o = 0, l = 0, m = NEG_INF`` and merges as the empty set. ``merge`` combines partials over disjoint slot sets
exactly, ``normalise`` gives softmax attention.

Shapes: q ``[B, Hq, D]``; k, v ``[B, Hkv, S, D]`` (``Hq = G * Hkv``, GQA, KV never repeated); valid
``[B, Hkv, S]`` bool; lengths ``[B]`` int; bias ``[B, Hkv, S]`` float; block_indices ``[B, Hkv, N]`` or
``[B, N]`` int. Out: o ``[B, Hq, D]``, m, l ``[B, Hq]`` float32. Einsum axes: b batch, h KV head, g query head
within the group, s slot, d head dim, n listed block.
"""

from __future__ import annotations

import jax.numpy as jnp

#: Score of a slot that does not take part (finite, so ``m - m`` never gives NaN).
NEG_INF = -1e30


def slot_mask(
    b: int, hkv: int, s: int, valid=None, lengths=None, block_indices=None, block_size: int = 128
) -> jnp.ndarray:
    """Bool ``[B, Hkv, S]``: which slots take part (see the module docstring)."""
    mask = jnp.ones((b, hkv, s), bool)
    if valid is not None:
        mask = mask & valid.astype(bool)
    slots = jnp.arange(s, dtype=jnp.int32)
    if lengths is not None:
        mask = mask & (slots[None, None, :] < jnp.asarray(lengths, jnp.int32)[:, None, None])
    if block_indices is not None:
        bi = jnp.asarray(block_indices, jnp.int32)
        if bi.ndim == 2:
            bi = jnp.broadcast_to(bi[:, None, :], (b, hkv, bi.shape[-1]))
        listed = jnp.any(bi[:, :, :, None] == (slots // block_size)[None, None, None, :], axis=2)
        mask = mask & listed
    return mask


def decode_attention_reference(q, k, v, valid=None, lengths=None, bias=None, block_indices=None, block_size: int = 128):
    """Partials ``(o [B,Hq,D], m [B,Hq], l [B,Hq])`` float32 (see the module docstring)."""
    b, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, d)
    sc = jnp.einsum("bhgd,bhsd->bhgs", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(d))
    if bias is not None:
        sc = sc + bias[:, :, None, :].astype(jnp.float32)
    mask = slot_mask(b, hkv, s, valid, lengths, block_indices, block_size)[:, :, None, :]
    sc = jnp.where(mask, sc, NEG_INF)
    m = jnp.max(sc, axis=-1)  # [B, Hkv, G]
    p = jnp.where(mask, jnp.exp(sc - m[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum("bhgs,bhsd->bhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, hq, d), m.reshape(b, hq), l.reshape(b, hq)


def runs_mask(b: int, hkv: int, g: int, s: int, starts, lens) -> jnp.ndarray:
    """Bool ``[B, Hkv, G, S]``: slot ``s`` takes part for query head ``g`` of KV head ``h`` iff it lies in a run
    ``[starts[b,h,r], starts[b,h,r] + lens[b,h,(g,)r])`` (``lens [B, Hkv, R]`` is shared by the group's heads)."""
    st = jnp.asarray(starts, jnp.int32)[:, :, None, :, None]  # [B, Hkv, 1, R, 1]
    ln = jnp.asarray(lens, jnp.int32)
    ln = (ln[:, :, None] if ln.ndim == 3 else ln)[..., None]  # [B, Hkv, G or 1, R, 1]
    slots = jnp.arange(s, dtype=jnp.int32)
    inside = (slots >= st) & (slots < st + ln)
    return jnp.broadcast_to(jnp.any(inside, axis=3), (b, hkv, g, s))


def decode_attention_runs_reference(q, k, v, starts, lens):
    """Partials ``(o [B,Hq,D], m [B,Hq], l [B,Hq])`` float32 over runs of slots (the spec of
    :func:`~kernels_pallas.decode_attention.decode_attention_runs`): query head ``g`` of KV head ``h`` attends
    the slots of :func:`runs_mask`; computed over all ``S`` slots and masked."""
    b, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.reshape(b, hkv, g, d)
    sc = jnp.einsum("bhgd,bhsd->bhgs", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(d))
    mask = runs_mask(b, hkv, g, s, starts, lens)
    sc = jnp.where(mask, sc, NEG_INF)
    m = jnp.max(sc, axis=-1)
    p = jnp.where(mask, jnp.exp(sc - m[..., None]), 0.0)
    o = jnp.einsum("bhgs,bhsd->bhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, hq, d), m.reshape(b, hq), jnp.sum(p, axis=-1).reshape(b, hq)


def merge(a, b):
    """Merge two partials ``(o, m, l)`` over disjoint slot sets (exact)."""
    oa, ma, la = a
    ob, mb, lb = b
    m = jnp.maximum(ma, mb)
    ca, cb = jnp.exp(ma - m), jnp.exp(mb - m)
    return oa * ca[..., None] + ob * cb[..., None], m, la * ca + lb * cb


def normalise(partial) -> jnp.ndarray:
    """Softmax-normalised output ``[B, Hq, D]`` float32 (zero where no slot took part)."""
    o, _, l = partial
    return o / jnp.where(l > 0, l, 1.0)[..., None]
