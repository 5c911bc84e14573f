"""Decode attention over a buffer of slots, returning mergeable partials (DESIGN principle 6).

``attend`` computes, for one new query per head, attention over ``S`` slots with a validity mask and an
optional additive bias (e.g. Chelsea's ``log N``), and returns the flash-decoding partials
``(o_unnormalised, m, l)``: ``m`` the running max of the scaled scores, ``l = sum exp(s - m)`` and
``o = sum exp(s - m) v``. Partials over disjoint slot sets merge exactly with ``merge`` and ``normalise``
gives softmax attention. GQA is native: KV heads are never repeated. This is the pure-JAX (``xla``) version;
the Pallas kernels (``kernels_pallas.decode_attention``) implement the same contract.

Shapes: q ``[B, Hq, D]``; k, v ``[B, Hkv, S, D]``; valid ``[B, Hkv, S]`` bool; bias ``[B, Hkv, S]`` float;
o ``[B, Hq, D]`` float32; m, l ``[B, Hq]`` float32. Axes: b batch, h KV head, g query head in group, s slot,
d head dim.
"""

from __future__ import annotations

import jax.numpy as jnp

NEG_INF = -1e30


def scores(q: jnp.ndarray, k: jnp.ndarray) -> jnp.ndarray:
    """Scaled scores ``q·k/sqrt(D)`` as ``[B, Hkv, G, S]`` float32."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, d)
    return jnp.einsum("bhgd,bhsd->bhgs", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(d))


def attend(q, k, v, valid, bias=None):
    """Partials ``(o_unnormalised [B,Hq,D], m [B,Hq], l [B,Hq])`` of attention over the valid slots.

    A row with no valid slot returns ``o = 0, l = 0, m = NEG_INF`` (it merges as an empty set).
    """
    b, hq, d = q.shape
    s = scores(q, k)
    if bias is not None:
        s = s + bias[:, :, None, :].astype(jnp.float32)
    mask = valid[:, :, None, :]
    s = jnp.where(mask, s, NEG_INF)
    m = jnp.max(s, axis=-1)  # [B, Hkv, G]
    p = jnp.where(mask, jnp.exp(s - m[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum("bhgs,bhsd->bhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, hq, d), m.reshape(b, hq), l.reshape(b, hq)


def merge(a, b):
    """Merge two partials over disjoint slot sets (exact)."""
    oa, ma, la = a
    ob, mb, lb = b
    m = jnp.maximum(ma, mb)
    ca, cb = jnp.exp(ma - m), jnp.exp(mb - m)
    return oa * ca[..., None] + ob * cb[..., None], m, la * ca + lb * cb


def normalise(partial) -> jnp.ndarray:
    """Softmax-normalised output ``[B, Hq, D]`` float32 (zero where no slot was valid)."""
    o, _, l = partial
    return o / jnp.where(l > 0, l, 1.0)[..., None]


def probabilities(q, k, valid, bias=None) -> jnp.ndarray:
    """Softmax weights ``[B, Hkv, G, S]`` float32 of the new query over the slots (H2O's accumulation)."""
    s = scores(q, k)
    if bias is not None:
        s = s + bias[:, :, None, :]
    s = jnp.where(valid[:, :, None, :], s, NEG_INF)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    p = jnp.where(valid[:, :, None, :], p, 0.0)
    return p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
