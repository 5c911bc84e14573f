"""Pallas TPU kernel of the PQ lookup as a one-hot matmul (PQCache §3.1; method note §8.6).

Grid ``(B*Hkv, S_pad/tT)``. Per step: the LUT block ``[G, m*K]`` (whole, so block dims equal array dims) and a
codes tile ``[m, tT]`` (int32, tokens on lanes). The transposed one-hot ``OH[m*K, tT]`` is built in VMEM as
``iota(axis 0) == codes_i + i*K`` OR-ed over the ``m`` sub-spaces, and ``scores[G, tT] = LUT @ OH`` runs on the
MXU in float32 (``HIGHEST``: the one-hot is exact, so each score is an exact f32 sum of ``m`` LUT entries up
to rounding). No in-kernel gathers (they do not lower on TPU). With m=2, b=6, ``m*K = 128`` is one lane tile.
TPU-legal tiles: ``tT`` a multiple of 128 (lanes of the codes and output tiles).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.pq_lookup import _common


def _kernel(lut_ref, codes_ref, out_ref, *, m: int, k: int):
    lut = lut_ref[0]  # [G, m*K] f32
    codes = codes_ref[0]  # [m, tT] int32
    tt = codes.shape[-1]
    rows = jax.lax.broadcasted_iota(jnp.int32, (m * k, tt), 0)
    hot = rows == codes[0:1, :]
    for i in range(1, m):
        hot = hot | (rows == codes[i:i + 1, :] + i * k)
    out_ref[0] = jax.lax.dot_general(lut, jnp.where(hot, 1.0, 0.0).astype(jnp.float32), (((1,), (0,)), ((), ())),
                                     precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("block_t", "interpret"))
def pq_lookup_tpu(lut, codes, block_t: int = 512, interpret: bool = False):
    b, h, g, m, k = lut.shape
    s = codes.shape[2]
    lut2, c, s_pad = _common.pack(lut, codes, block_t)
    out = pl.pallas_call(
        functools.partial(_kernel, m=m, k=k),
        grid=(b * h, s_pad // block_t),
        in_specs=[pl.BlockSpec((1, g, m * k), lambda i, j: (i, 0, 0)),
                  pl.BlockSpec((1, m, block_t), lambda i, j: (i, 0, j))],
        out_specs=pl.BlockSpec((1, g, block_t), lambda i, j: (i, 0, j)),
        out_shape=jax.ShapeDtypeStruct((b * h, g, s_pad), jnp.float32),
        interpret=interpret,
    )(lut2, c)
    return _common.unpack(out, b, h, s)
