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


def slot_mask(b: int, hkv: int, s: int, valid=None, lengths=None, block_indices=None,
              block_size: int = 128) -> jnp.ndarray:
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


def decode_attention_reference(q, k, v, valid=None, lengths=None, bias=None, block_indices=None,
                               block_size: int = 128):
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
