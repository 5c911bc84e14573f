"""Layout shared by the Pallas PQ-lookup kernels.

Codes are stored **sub-space-major** ``[B, Hkv, m, S]`` uint8 (tokens on the last, lane axis): the layout the
kernels read, so a caller that keeps its codes this way (``kvjax.methods.pqcache`` does) pays no per-call
transpose or cast. The kernels see free reshapes of the inputs: the LUT as ``[B*Hkv, G, m*K]`` (sub-space ``i``
owns columns ``[i*K, (i+1)*K)``) and the codes as ``[B*Hkv, m, S]``, cast to int32 inside the kernel. When
``S`` is not a multiple of the token tile the codes are padded here (one copy); callers that want no copy
allocate ``S`` as a multiple of :data:`CODE_ALIGN` (a multiple of every default tile).

``lengths [B]``: token blocks starting at or past ``lengths[b]`` are neither read nor computed (their scores
are written as ``NEG_INF``); inside the last live block, slots ``>= lengths[b]`` are ``NEG_INF`` too.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.decode_attention.reference import NEG_INF  # noqa: E402, F401  (defined once; read as _common.NEG_INF)

#: Allocate code buffers with ``S`` a multiple of this (the default tiles 128 on GPU and 512 on TPU divide it).
CODE_ALIGN = 512


def pack(lut, codes, lengths, block_t: int):
    """``(lut2 [B*Hkv, G, m*K] f32, codes [B*Hkv, m, S_pad] (original dtype), lens [B] int32, S_pad)``."""
    b, h, g, m, k = lut.shape
    s = codes.shape[-1]
    s_pad = -(-s // block_t) * block_t
    lut2 = lut.astype(jnp.float32).reshape(b * h, g, m * k)
    c = codes.reshape(b * h, m, s)
    if s_pad != s:
        c = jnp.pad(c, ((0, 0), (0, 0), (0, s_pad - s)))
    lens = jnp.full((b,), s, jnp.int32) if lengths is None else jnp.minimum(jnp.asarray(lengths, jnp.int32), s)
    return lut2, c, lens, s_pad


def unpack(out, b: int, h: int, g: int, s: int):
    """``[B*Hkv, Gp, S_pad]`` -> ``[B, Hkv, G, S]`` (a free reshape when ``Gp == G`` and ``S_pad == S``)."""
    if out.shape[1] != g or out.shape[2] != s:
        out = out[:, :g, :s]
    return out.reshape(b, h, g, s)
