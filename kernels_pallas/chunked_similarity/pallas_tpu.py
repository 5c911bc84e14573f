"""Pallas TPU kernel: per chunk, the best B match and cosine score of every A token (Chelsea §5.2).

Grid ``(B*H, P)``: one chunk per step, a ``[c/2, 2D]`` key tile (A in lanes ``[0, D)``, B in ``[D, 2D)``), one
``(c/2) x (c/2)`` MXU matmul, a masked column max and an iota-min argmax. No in-kernel gathers. See
``_common`` for the layout and ``reference`` for the contract.
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


@functools.partial(jax.jit, static_argnames=("chunk", "interpret"))
def chunk_best_match_tpu(k, valid, chunk: int, interpret: bool = False):
    b, h, m, d = k.shape
    kp, va, vb = _common.pack(k, valid, chunk)
    bh, p, half, _ = kp.shape
    out_shape = (jax.ShapeDtypeStruct((bh, p, 1, half), jnp.float32), jax.ShapeDtypeStruct((bh, p, 1, half), jnp.int32))
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
        name="chunk_best_match_tpu",
    )(kp, va, vb)
    return _common.unpack(best, idx, b, h)
