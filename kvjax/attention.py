"""Decode attention over a buffer of slots, returning mergeable partials (docs/architecture.md#kernels-return-partials).

``attend`` computes, for one new query per head, attention over ``S`` slots with a validity mask and an
optional additive bias (e.g. Chelsea's ``log N``), and returns the flash-decoding partials
``(o_unnormalised, m, l)``: ``m`` the running max of the scaled scores, ``l = sum exp(s - m)`` and
``o = sum exp(s - m) v``. Partials over disjoint slot sets merge exactly with ``merge`` and ``normalise``
gives softmax attention. GQA is native: KV heads are never repeated. ``attend`` delegates to
``kernels_pallas.decode_attention`` (pure-JAX reference on CPU, Pallas kernels on TPU/GPU; same contract).

Shapes: q ``[B, Hq, D]``; k, v ``[B, Hkv, S, D]``; valid ``[B, Hkv, S]`` bool; bias ``[B, Hkv, S]`` float;
o ``[B, Hq, D]`` float32; m, l ``[B, Hq]`` float32. Axes: b batch, h KV head, g query head in group, s slot,
d head dim.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.decode_attention import (NEG_INF, decode_attention, decode_attention_runs,  # NEG_INF = -1e30
                                             merge, normalise)
from kvjax import sharding

__all__ = ["NEG_INF", "attend", "attend_runs", "attend_with_weights", "merge", "normalise", "scores"]


def scores(q: jnp.ndarray, k: jnp.ndarray) -> jnp.ndarray:
    """Scaled scores ``q·k/sqrt(D)`` as ``[B, Hkv, G, S]`` float32."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, d)
    return jnp.einsum("bhgd,bhsd->bhgs", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(d))


def attend(q, k, v, valid, bias=None, *, lengths=None, block_indices=None, block_size: int | None = None,
           impl=None):
    """Partials ``(o_unnormalised [B,Hq,D], m [B,Hq], l [B,Hq])`` of attention over the valid slots.

    ``lengths [B]``: only slots ``[0, lengths[b])`` can take part, and the Pallas kernels read no block past it
    (every method passes its fill count, so decode never reads bucket padding or unwritten decode slots);
    ``block_indices``: the slot blocks of ``block_size`` slots to visit (block_size None: 128 with a block list,
    else the kernel's tuned tile, ``kernels_pallas.decode_attention.tuning``). A row with no valid slot returns ``o = 0, l = 0, m = NEG_INF``
    (it merges as an empty set). Routed through ``kernels_pallas.decode_attention.decode_attention``: ``impl``
    is ``"xla" | "pallas_tpu" | "pallas_gpu"`` or None (by backend: the Pallas kernel on TPU/GPU, the pure-JAX
    reference on CPU). On a mesh (:mod:`kvjax.sharding`) the kernel runs per device on its sequences and heads.
    """
    args = {"q": q, "k": k, "v": v, "valid": valid, "lengths": lengths, "bias": bias,
            "block_indices": block_indices}
    names = [n for n, a in args.items() if a is not None]
    shared = [i for i, n in enumerate(names) if n == "block_indices" and block_indices.ndim == 2]  # [B, N]

    def run(*xs):
        return decode_attention(**dict(zip(names, xs)), block_size=block_size, impl=impl)

    return sharding.per_head(run, *(args[n] for n in names), batch_only=shared)  # local on a mesh


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
    """One pass over K: the partials ``(o, m, l)`` and the softmax weights ``[B, Hkv, G, S]`` float32 of the
    new query over the taking-part slots (H2O needs both; computing the scores once reads K once). Pure JAX
    (XLA fuses it) on every backend: the Pallas kernel returns no per-slot weights."""
    b, hq, d = q.shape
    s = scores(q, k)
    mask = valid
    if lengths is not None:
        mask = mask & (jnp.arange(k.shape[2])[None, None, :] < lengths[:, None, None])
    s = jnp.where(mask[:, :, None, :], s, NEG_INF)
    m = jnp.max(s, axis=-1)
    p = jnp.where(mask[:, :, None, :], jnp.exp(s - m[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum("bhgs,bhsd->bhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    w = p / jnp.where(l > 0, l, 1.0)[..., None]
    return (o.reshape(b, hq, d), m.reshape(b, hq), l.reshape(b, hq)), w
