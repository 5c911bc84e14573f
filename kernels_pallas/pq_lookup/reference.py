"""Pure-JAX reference of the PQ lookup (PQCache §3.1, "aggregate the results for all the tokens according to
PQ codes"): the spec of the Pallas kernels and the CPU path.

``scores[b, h, g, s] = sum_i lut[b, h, g, i, codes[b, h, s, i]]``

lut ``[B, Hkv, G, m, K]`` float32 (``K = 2^bits`` centroids per sub-space, ``lut = q_sub · centroid``),
codes ``[B, Hkv, S, m]`` integer (uint8) -> scores ``[B, Hkv, G, S]`` float32. Axes: b batch, h KV head,
g query head of the group, i sub-space, c centroid, s token slot.
"""

from __future__ import annotations

import jax.numpy as jnp


def pq_lookup_reference(lut: jnp.ndarray, codes: jnp.ndarray) -> jnp.ndarray:
    """Gather-sum over sub-spaces (``take_along_axis``); see the module docstring for shapes."""
    lut = lut.astype(jnp.float32)
    idx = jnp.moveaxis(codes.astype(jnp.int32), -1, 2)  # [B, Hkv, m, S]
    g = lut.shape[2]
    idx = jnp.broadcast_to(idx[:, :, None], (*idx.shape[:2], g, *idx.shape[2:]))  # [B, Hkv, G, m, S]
    return jnp.take_along_axis(lut, idx, axis=-1).sum(axis=3)
