"""Pure-JAX reference of the PQ lookup (PQCache §3.1, "aggregate the results for all the tokens according to
PQ codes"): the spec of the Pallas kernels and the CPU path.

``scores[b, h, g, s] = sum_i lut[b, h, g, i, codes[b, h, i, s]]`` for ``s < lengths[b]``, ``NEG_INF`` beyond.

lut ``[B, Hkv, G, m, K]`` float32 (``K = 2^bits`` centroids per sub-space, ``lut = q_sub · centroid``),
codes ``[B, Hkv, m, S]`` integer (uint8, sub-space-major), lengths ``[B]`` int32 or None (every slot) ->
scores ``[B, Hkv, G, S]`` float32. Axes: b batch, h KV head, g query head of the group, i sub-space,
c centroid, s token slot.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.decode_attention.reference import NEG_INF  # noqa: E402  (defined once)


def pq_lookup_reference(lut: jnp.ndarray, codes: jnp.ndarray, lengths=None) -> jnp.ndarray:
    """Gather-sum over sub-spaces (``take_along_axis``); see the module docstring for shapes."""
    lut = lut.astype(jnp.float32)
    idx = codes.astype(jnp.int32)  # [B, Hkv, m, S]
    g = lut.shape[2]
    idx = jnp.broadcast_to(idx[:, :, None], (*idx.shape[:2], g, *idx.shape[2:]))  # [B, Hkv, G, m, S]
    out = jnp.take_along_axis(lut, idx, axis=-1).sum(axis=3)
    if lengths is None:
        return out
    live = jnp.arange(codes.shape[-1])[None, :] < jnp.asarray(lengths, jnp.int32)[:, None]  # [B, S]
    return jnp.where(live[:, None, None, :], out, NEG_INF)
