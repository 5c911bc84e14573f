"""Pallas GPU (Triton) kernel: per chunk, the best B match and cosine score of every A token (Chelsea §5.2).

Same grid and layout as the TPU kernel (``_common``): one program per (head, chunk), a ``[c/2, 2D]`` tile,
one ``tl.dot`` of ``(c/2) x D x (c/2)``, a masked column max and iota-min argmax. Triton needs power-of-two
block dims: ``c/2`` and ``D`` must be powers of two (checked).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.chunked_similarity import _common


def _kernel(k_ref, va_ref, vb_ref, best_ref, idx_ref, *, d: int):
    a = k_ref[0, 0, :, :d]
    bb = k_ref[0, 0, :, d:]
    best, idx = _common.block_body(a, bb, va_ref[0, 0], vb_ref[0, 0])
    best_ref[0, 0] = best
    idx_ref[0, 0] = idx


def _pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@functools.partial(jax.jit, static_argnames=("chunk", "interpret", "num_warps"))
def chunk_best_match_gpu(k, valid, chunk: int, interpret: bool = False, num_warps: int = 4):
    b, h, m, d = k.shape
    if not (_pow2(chunk // 2) and _pow2(d)):
        raise ValueError(
            f"pallas_gpu needs chunk/2 and head_dim to be powers of two, got chunk={chunk}, "
            f"head_dim={d}; use impl='xla' or a power-of-two chunk"
        )
    kp, va, vb = _common.pack(k, valid, chunk)
    bh, p, half, _ = kp.shape
    out_shape = (jax.ShapeDtypeStruct((bh, p, 1, half), jnp.float32), jax.ShapeDtypeStruct((bh, p, 1, half), jnp.int32))
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        params["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    best, idx = pl.pallas_call(
        functools.partial(_kernel, d=d),
        grid=(bh, p),
        in_specs=[
            pl.BlockSpec((1, 1, half, 2 * d), lambda i, j: (i, j, 0, 0)),
            pl.BlockSpec((1, 1, 1, half), lambda i, j: (i, j, 0, 0)),
            pl.BlockSpec((1, 1, half, 1), lambda i, j: (i, j, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((1, 1, 1, half), lambda i, j: (i, j, 0, 0)),
            pl.BlockSpec((1, 1, 1, half), lambda i, j: (i, j, 0, 0)),
        ],
        out_shape=out_shape,
        interpret=interpret,
        name="chunk_best_match_gpu",
        **params,
    )(kp, va, vb)
    return _common.unpack(best, idx, b, h)
