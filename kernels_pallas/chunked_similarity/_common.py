"""Layout shared by the Pallas kernels of ``chunked_similarity``.

The keys ``[B, H, M, D]`` are viewed (a free, contiguous reshape) as ``[B*H, P, c/2, 2D]``: row ``i`` of chunk
``p`` holds the A token (offset ``2i``) in lanes ``[0, D)`` and the B token (offset ``2i+1``) in lanes
``[D, 2D)``, so the even/odd split is a lane slice, no strided access. Validity travels as two float32 arrays:
A as a row ``[B*H, P, 1, c/2]`` and B as a column ``[B*H, P, c/2, 1]``, so that the kernel masks the transposed
similarity ``S^T [j, i]`` without in-kernel transposes or gathers. Every block's last two dims equal the array's
(TPU-legal for any even ``c``; ``c/2`` a multiple of 8 and ``2D`` of 128 give dense tiles).

:func:`chunk_best_match_call` is the one ``pallas_call`` of both kernels: the TPU and the GPU (Triton) kernel are
the same program over the same grid, told apart only by the platform's compiler parameters and their names.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def pack(k: jnp.ndarray, valid: jnp.ndarray, chunk: int):
    b, h, m, d = k.shape
    p, half = m // chunk, chunk // 2
    kp = k.reshape(b * h, p, half, 2 * d)
    vc = valid.reshape(b * h, p, half, 2).astype(jnp.float32)
    va = vc[..., 0][:, :, None, :]  # [BH, P, 1, c/2]
    vb = vc[..., 1][:, :, :, None]  # [BH, P, c/2, 1]
    return kp, va, vb


def unpack(best, idx, b: int, h: int):
    bh, p, _, half = best.shape
    return best.reshape(b, h, p, half), idx.reshape(b, h, p, half)


def block_body(a, bb, va, vb):
    """One chunk: a, bb ``[c/2, D]`` keys; va ``[1, c/2]``, vb ``[c/2, 1]`` -> best, idx ``[1, c/2]``.

    Computes ``S^T = normalise(B) normalise(A)^T`` (``[j, i]``), masks, and reduces over the B rows (axis 0):
    max, then the lowest row reaching it (argmax with lowest-index ties, via iota and min; no gathers).
    """
    a = a.astype(jnp.float32)
    bb = bb.astype(jnp.float32)
    a = a * jax.lax.rsqrt(jnp.maximum(jnp.sum(a * a, axis=-1, keepdims=True), 1e-24))
    bb = bb * jax.lax.rsqrt(jnp.maximum(jnp.sum(bb * bb, axis=-1, keepdims=True), 1e-24))
    st = jax.lax.dot_general(
        bb, a, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )  # [c/2 (j), c/2 (i)]
    ok = (vb > 0.5) & (va > 0.5)
    st = jnp.where(ok, st, -jnp.inf)
    best = jnp.max(st, axis=0, keepdims=True)  # [1, c/2]
    rows = jax.lax.broadcasted_iota(jnp.int32, st.shape, 0)
    half = st.shape[0]
    idx = jnp.min(jnp.where(st == best, rows, half), axis=0, keepdims=True)
    idx = jnp.where(best > -jnp.inf, idx, 0)
    return best, idx.astype(jnp.int32)


def _kernel(k_ref, va_ref, vb_ref, best_ref, idx_ref, *, d: int):
    a = k_ref[0, 0, :, :d]
    bb = k_ref[0, 0, :, d:]
    best, idx = block_body(a, bb, va_ref[0, 0], vb_ref[0, 0])
    best_ref[0, 0] = best
    idx_ref[0, 0] = idx


def chunk_best_match_call(k, valid, chunk: int, *, name: str, interpret: bool, compiler_params=None):
    """``(best, idx)`` of :func:`kernels_pallas.chunked_similarity.chunk_best_match` by the Pallas kernel: grid
    ``(B*H, P)``, one chunk's ``[c/2, 2D]`` key tile a step. ``compiler_params``: the platform's (``None``: Pallas's
    defaults, the TPU kernel's and interpret mode's); ``name``: the kernel's name in the compiled program."""
    b, h, m, d = k.shape
    kp, va, vb = pack(k, valid, chunk)
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
        name=name,
        compiler_params=compiler_params,
    )(kp, va, vb)
    return unpack(best, idx, b, h)
