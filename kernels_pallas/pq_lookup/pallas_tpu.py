"""Pallas TPU kernel of the PQ lookup as a one-hot matmul (PQCache §3.1; method note ``docs/notes/pqcache.md`` §8.6).

Grid ``(B*Hkv, S_pad/tT)``; ``lengths [B]`` is scalar-prefetched into SMEM. Per step: the LUT block
``[G, m*K]`` (whole, so block dims equal array dims) and a codes tile ``[m, tT]`` (uint8 as stored, tokens on
lanes; cast to int32 in VMEM). The transposed one-hot ``OH[m*K, tT]`` is built as ``iota(axis 0) == codes_i +
i*K`` OR-ed over the ``m`` sub-spaces, and ``scores[G, tT] = LUT @ OH`` runs on the MXU in float32
(``HIGHEST``: the one-hot is exact). No in-kernel gathers (they do not lower on TPU). With m=2, b=6, ``m*K =
128`` is one lane tile. TPU-legal tiles: ``tT`` a multiple of 128.

Blocks past ``lengths[b]``: the codes index map repeats the last live block (the pipeline issues no new DMA)
and the body only writes ``NEG_INF`` (``pl.when``); slots ``>= lengths[b]`` of the last live block are masked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.pq_lookup import _common


def _kernel(len_ref, lut_ref, codes_ref, out_ref, *, h: int, m: int, k: int, tt: int):
    row, j = pl.program_id(0), pl.program_id(1)
    length = len_ref[jax.lax.div(row, h)]  # lax.div, not //: see codes_map
    start = j * tt

    @pl.when(start < length)
    def _live():
        lut = lut_ref[0]  # [G, m*K] f32
        codes = codes_ref[0].astype(jnp.int32)  # [m, tT]
        rows = jax.lax.broadcasted_iota(jnp.int32, (m * k, tt), 0)
        hot = rows == codes[0:1, :]
        for i in range(1, m):
            hot = hot | (rows == codes[i : i + 1, :] + i * k)
        s = jax.lax.dot_general(
            lut,
            jnp.where(hot, 1.0, 0.0).astype(jnp.float32),
            (((1,), (0,)), ((), ())),
            precision=jax.lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )
        slot = start + jax.lax.broadcasted_iota(jnp.int32, (1, tt), 1)
        out_ref[0] = jnp.where(slot < length, s, _common.NEG_INF)

    @pl.when(start >= length)
    def _dead():
        out_ref[...] = jnp.full(out_ref.shape, _common.NEG_INF, jnp.float32)


@functools.partial(jax.jit, static_argnames=("block_t", "interpret"))
def pq_lookup_tpu(lut, codes, lengths=None, block_t: int = 512, interpret: bool = False):
    b, h, g, m, k = lut.shape
    s = codes.shape[-1]
    lut2, c, lens, s_pad = _common.pack(lut, codes, lengths, block_t)

    def codes_map(i, j, len_ref):
        # Non-negative ints: truncating lax.div is floor division without the sign correction ``//`` adds
        # (Mosaic's sign lowering queries the TPU generation, which fails when exporting for TPU off-device).
        last = jnp.maximum(jax.lax.div(len_ref[jax.lax.div(i, h)] + block_t - 1, block_t) - 1, 0)
        return i, 0, jnp.minimum(j, last)

    out = pl.pallas_call(
        functools.partial(_kernel, h=h, m=m, k=k, tt=block_t),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b * h, s_pad // block_t),
            in_specs=[
                pl.BlockSpec((1, g, m * k), lambda i, j, len_ref: (i, 0, 0)),
                pl.BlockSpec((1, m, block_t), codes_map),
            ],
            out_specs=pl.BlockSpec((1, g, block_t), lambda i, j, len_ref: (i, 0, j)),
        ),
        out_shape=jax.ShapeDtypeStruct((b * h, g, s_pad), jnp.float32),
        interpret=interpret,
        name="pq_lookup_tpu",
    )(lens, lut2, c)
    return _common.unpack(out, b, h, g, s)
