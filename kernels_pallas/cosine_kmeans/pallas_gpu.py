"""Pallas GPU (Triton) kernels of ClusterKV's cosine K-means: the assignment (§III-B, "semantic distance") and
the centroid update (§IV-B, Fig. 7) as a one-hot matmul (method note ``docs/notes/clusterkv.md`` §7.3, kernels A
and B).

Backend: in jax 0.10-0.11 a GPU ``pl.pallas_call`` lowers to Mosaic GPU by default; passing
``compiler_params=jax.experimental.pallas.triton.CompilerParams(...)`` selects the Triton lowering, which is
what these kernels are written for (``tl.dot`` on 2-D tiles of at least 16, dynamic ``pl.ds`` slices in
``fori_loop``s). Triton tiles are powers of two: ``D`` and ``C`` are zero-padded to powers of two (at least
16; padded centroids invalid) and the row tile ``tL`` must be a power of two (checked). Dots run in f32 with
``HIGHEST`` (IEEE, not TF32: TF32 would move near-tie labels and round the sums).

Assignment, grid ``(N, L_pad/tL)``: a program holds a ``[tL, D_pad]`` key tile and walks the normalised
centroids in tiles of ``tC`` (``fori_loop``), so the ``[tL, C]`` similarity never exists whole: per tile
``S = x @ c_hat_tile^T`` (``[tL, tC]``), invalid centroids masked to ``-inf``, the tile max and the lowest index
reaching it (iota, compare, min), merged into a running ``(best, label)`` that only moves on a strictly larger
value (so ties keep the lowest centroid index). Labels ``[tL]``; ``C`` for invalid rows and when no centroid
is valid.

Update, grid ``(N, C_pad/tC)``: a program owns ``tC`` clusters and loops over all row tiles (``fori_loop``),
accumulating ``sums [tC, D_pad] += OH^T @ x_tile`` with the transposed one-hot ``OH^T [tC, tL] = (c0 + iota ==
labels)`` and ``counts += rowsum(OH^T)`` in registers: no cross-program reduction, no atomics (the paper's
shared-memory ``atomicAdd`` kernel, Fig. 7, becomes ``tl.dot``), deterministic. Keys are re-read once per
centroid tile (``C_pad/tC`` times; L2 serves most of it). Rows must be finite: a NaN/inf row poisons the sums
through ``0 * inf`` even when its label is the sentinel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas.checks import is_pow2, next_pow2
from kernels_pallas.cosine_kmeans import _common
from kernels_pallas.cosine_kmeans.reference import HIGHEST


def _check_block_l(block_l: int) -> None:
    if not (is_pow2(block_l) and block_l >= _common.GPU_MIN_DIM):
        raise ValueError(
            f"block_l={block_l} must be a power of two >= {_common.GPU_MIN_DIM} for pallas_gpu "
            f"(Triton tiles); e.g. {_common.GPU_BLOCK_L}, or use impl='xla'"
        )


def _pads(c: int, d: int):
    """``(C_pad, tC, D_pad)``: powers of two, at least ``GPU_MIN_DIM``; ``tC`` divides ``C_pad``."""
    c_pad = max(_common.GPU_MIN_DIM, next_pow2(c))
    return c_pad, min(c_pad, _common.GPU_BLOCK_C), max(_common.GPU_MIN_DIM, next_pow2(d))


def _assign_kernel(x_ref, c_ref, cv_ref, v_ref, lab_ref, *, c: int, c_pad: int, tc: int):
    x = x_ref[...].astype(jnp.float32)  # [tL, D_pad]
    tl = x.shape[0]

    def body(t, carry):
        best, idx = carry
        c0 = pl.multiple_of(t * tc, tc)
        ct = c_ref[pl.ds(c0, tc), :]  # [tC, D_pad] f32, normalised
        s = jax.lax.dot_general(
            x, ct, (((1,), (1,)), ((), ())), precision=HIGHEST, preferred_element_type=jnp.float32
        )  # [tL, tC]
        s = jnp.where(cv_ref[pl.ds(c0, tc)][None, :] > 0.5, s, -jnp.inf)
        tb = jnp.max(s, axis=1)  # [tL]
        cols = c0 + jax.lax.broadcasted_iota(jnp.int32, (tl, tc), 1)
        ti = jnp.min(jnp.where(s == tb[:, None], cols, c_pad), axis=1)  # lowest index in the tile
        take = tb > best  # strictly larger: an earlier tile keeps a tie
        return jnp.where(take, tb, best), jnp.where(take, ti, idx)

    init = (jnp.full((tl,), -jnp.inf, jnp.float32), jnp.zeros((tl,), jnp.int32))
    best, idx = jax.lax.fori_loop(0, c_pad // tc, body, init)
    ok = (v_ref[...] > 0.5) & (best > -jnp.inf)
    lab_ref[...] = jnp.where(ok, idx, c)


@functools.partial(jax.jit, static_argnames=("block_l", "interpret", "num_warps", "num_stages"))
def cosine_assign_gpu(
    x,
    centroids,
    valid=None,
    cvalid=None,
    *,
    block_l: int = _common.GPU_BLOCK_L,
    interpret: bool = False,
    num_warps: int = 4,
    num_stages: int = 2,
):
    """Labels ``[N, L]`` int32 (contract of ``reference.cosine_assign_reference``)."""
    _check_block_l(block_l)
    n, l, d = x.shape
    c = centroids.shape[1]
    tl = _common.gpu_row_tile(l, block_l)
    c_pad, tc, d_pad = _pads(c, d)
    xp, cn, cv, v = _common.pack_assign(x, centroids, valid, cvalid, tl, c_pad, d_pad)
    l_pad = xp.shape[1]
    lab = pl.pallas_call(
        functools.partial(_assign_kernel, c=c, c_pad=c_pad, tc=tc),
        grid=(n, l_pad // tl),
        in_specs=[
            pl.BlockSpec((None, tl, d_pad), lambda i, j: (i, j, 0)),
            pl.BlockSpec((None, c_pad, d_pad), lambda i, j: (i, 0, 0)),
            pl.BlockSpec((None, c_pad), lambda i, j: (i, 0)),
            pl.BlockSpec((None, tl), lambda i, j: (i, j)),
        ],
        out_specs=pl.BlockSpec((None, tl), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((n, l_pad), jnp.int32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="cosine_assign_gpu",
    )(xp, cn, cv, v)
    return lab[:, :l]


def _update_kernel(x_ref, lab_ref, sum_ref, cnt_ref, *, tl: int, tc: int, n_tiles: int):
    d_pad = x_ref.shape[-1]
    c0 = pl.program_id(1) * tc
    rows = c0 + jax.lax.broadcasted_iota(jnp.int32, (tc, tl), 0)

    def body(t, carry):
        acc, cnt = carry
        l0 = pl.multiple_of(t * tl, tl)
        x = x_ref[pl.ds(l0, tl), :].astype(jnp.float32)  # [tL, D_pad]
        lab = lab_ref[pl.ds(l0, tl)]  # [tL] int32
        oh = jnp.where(rows == lab[None, :], 1.0, 0.0).astype(jnp.float32)  # [tC, tL] transposed one-hot
        acc = acc + jax.lax.dot_general(
            oh, x, (((1,), (0,)), ((), ())), precision=HIGHEST, preferred_element_type=jnp.float32
        )  # [tC, D_pad]
        return acc, cnt + jnp.sum(oh, axis=1)

    init = (jnp.zeros((tc, d_pad), jnp.float32), jnp.zeros((tc,), jnp.float32))
    acc, cnt = jax.lax.fori_loop(0, n_tiles, body, init)
    sum_ref[...] = acc
    cnt_ref[...] = cnt.astype(jnp.int32)  # exact: integer-valued f32 below 2^24


@functools.partial(jax.jit, static_argnames=("num_clusters", "block_l", "interpret", "num_warps", "num_stages"))
def centroid_update_gpu(
    x,
    labels,
    num_clusters: int,
    *,
    block_l: int = _common.GPU_BLOCK_L,
    interpret: bool = False,
    num_warps: int = 4,
    num_stages: int = 2,
):
    """``(sums [N, C, D] float32, counts [N, C] int32)`` (contract of ``reference.centroid_update_reference``)."""
    _check_block_l(block_l)
    n, l, d = x.shape
    c = num_clusters
    if l >= 1 << 24:
        raise ValueError(f"x has L={l} rows; pallas_gpu counts in float32 and needs L < 2^24")
    tl = _common.gpu_row_tile(l, block_l)
    c_pad, tc, d_pad = _pads(c, d)
    xp, lab = _common.pack_update(x, labels, c, tl, d_pad)
    l_pad = xp.shape[1]
    sums, counts = pl.pallas_call(
        functools.partial(_update_kernel, tl=tl, tc=tc, n_tiles=l_pad // tl),
        grid=(n, c_pad // tc),
        in_specs=[
            pl.BlockSpec((None, l_pad, d_pad), lambda i, j: (i, 0, 0)),
            pl.BlockSpec((None, l_pad), lambda i, j: (i, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, tc, d_pad), lambda i, j: (i, j, 0)),
            pl.BlockSpec((None, tc), lambda i, j: (i, j)),
        ],
        out_shape=[jax.ShapeDtypeStruct((n, c_pad, d_pad), jnp.float32), jax.ShapeDtypeStruct((n, c_pad), jnp.int32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="centroid_update_gpu",
    )(xp, lab)
    return _common.unpack_update(sums, counts, c, d)
