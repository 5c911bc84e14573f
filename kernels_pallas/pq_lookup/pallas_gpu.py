"""Pallas GPU (Triton) kernel of the PQ lookup (PQCache §3.1; method note ``docs/notes/pqcache.md`` §8.6).

Grid ``(B*Hkv, S_pad/tT)``. Per program: for each sub-space ``i`` a row of ``tT`` codes is loaded from the
sub-space-major uint8 layout (as stored; cast to int32 in registers), turned into a one-hot ``[tT, K]`` against
an iota, and multiplied elementwise with the LUT row of each query head (``[K]``), then reduced over ``K``:
``scores[g, t] = sum_i LUT[g, i*K + codes_i[t]]``. Only 2-D tiles, loads with static indices, iota, compare,
multiply and reduce: no gathers, no ``tl.dot`` (G is often below Triton's 16-row minimum). Triton needs
power-of-two block dims: ``tT``, ``m`` and ``K = 2^bits`` must be (checked); G is padded to a power of two with
zero LUT rows. A program whose block starts at or past ``lengths[b]`` loads nothing and writes ``NEG_INF``
(``pl.when``); slots ``>= lengths[b]`` of the last live block are masked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.checks import is_pow2

from kernels_pallas.pq_lookup import _common


def _kernel(len_ref, lut_ref, codes_ref, out_ref, *, g: int, m: int, k: int, tt: int):
    j = pl.program_id(1)
    length = len_ref[0]
    start = j * tt

    @pl.when(start < length)
    def _live():
        cols = jax.lax.broadcasted_iota(jnp.int32, (tt, k), 1)
        slot = start + jax.lax.broadcasted_iota(jnp.int32, (tt,), 0)
        hots = []
        for i in range(m):
            ci = codes_ref[0, i, :].astype(jnp.int32)  # [tT]
            hots.append(jnp.where(cols == ci[:, None], 1.0, 0.0).astype(jnp.float32))  # [tT, K]
        for gi in range(g):
            acc = jnp.zeros((tt,), jnp.float32)
            for i in range(m):
                row = lut_ref[0, gi, pl.ds(i * k, k)]  # [K]
                acc = acc + jnp.sum(hots[i] * row[None, :], axis=1)
            out_ref[0, gi, :] = jnp.where(slot < length, acc, _common.NEG_INF)

    @pl.when(start >= length)
    def _dead():
        for gi in range(g):
            out_ref[0, gi, :] = jnp.full((tt,), _common.NEG_INF, jnp.float32)


@functools.partial(jax.jit, static_argnames=("block_t", "interpret", "num_warps"))
def pq_lookup_gpu(lut, codes, lengths=None, block_t: int = 128, interpret: bool = False, num_warps: int = 4):
    b, h, g, m, k = lut.shape
    s = codes.shape[-1]
    if not (is_pow2(block_t) and is_pow2(k) and is_pow2(m)):
        raise ValueError(
            f"pallas_gpu needs block_t, K=2^bits and m to be powers of two, got block_t={block_t}, "
            f"K={k}, m={m}; use a power-of-two block_t or impl='xla'"
        )
    lut2, c, lens, s_pad = _common.pack(lut, codes, lengths, block_t)
    gp = 1 << (g - 1).bit_length()  # Triton blocks are powers of two: pad the query heads with zero rows
    if gp != g:
        lut2 = jnp.pad(lut2, ((0, 0), (0, gp - g), (0, 0)))
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        params["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    out = pl.pallas_call(
        functools.partial(_kernel, g=gp, m=m, k=k, tt=block_t),
        grid=(b * h, s_pad // block_t),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (i // h,)),
            pl.BlockSpec((1, gp, m * k), lambda i, j: (i, 0, 0)),
            pl.BlockSpec((1, m, block_t), lambda i, j: (i, 0, j)),
        ],
        out_specs=pl.BlockSpec((1, gp, block_t), lambda i, j: (i, 0, j)),
        out_shape=jax.ShapeDtypeStruct((b * h, gp, s_pad), jnp.float32),
        interpret=interpret,
        name="pq_lookup_gpu",
        **params,
    )(lens, lut2, c)
    return _common.unpack(out, b, h, g, s)
