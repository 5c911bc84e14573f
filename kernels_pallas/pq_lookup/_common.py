"""Layout shared by the Pallas PQ-lookup kernels.

The kernels see the LUT flattened per (batch, KV head) as ``[B*Hkv, G, m*K]`` (sub-space ``i`` owns columns
``[i*K, (i+1)*K)``) and the codes sub-space-major as int32 ``[B*Hkv, m, S_pad]`` so the token axis is the lane
axis (``S_pad`` a multiple of the token tile). The state keeps codes token-major uint8 ``[B, Hkv, S, m]``;
the transpose/cast here is one pass over ``m`` bytes per token, small next to the ``2*D*itemsize`` bytes per
token of the K/V that a retrieved token costs.
"""

from __future__ import annotations

import jax.numpy as jnp


def pack(lut, codes, block_t: int):
    b, h, g, m, k = lut.shape
    s = codes.shape[2]
    s_pad = -(-s // block_t) * block_t
    lut2 = lut.astype(jnp.float32).reshape(b * h, g, m * k)
    c = jnp.moveaxis(codes, -1, 2).astype(jnp.int32).reshape(b * h, m, s)
    if s_pad != s:
        c = jnp.pad(c, ((0, 0), (0, 0), (0, s_pad - s)))
    return lut2, c, s_pad


def unpack(out, b: int, h: int, s: int):
    return out[:, :, :s].reshape(b, h, out.shape[1], s)
