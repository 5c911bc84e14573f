"""Pallas TPU kernels of ClusterKV's cosine K-means: the assignment (§III-B, "semantic distance") and the
centroid update (§IV-B, Fig. 7) as a one-hot matmul (method note ``docs/notes/clusterkv.md`` §7.3, kernels A and B).

Layout: keys ``x [N, L_pad, D]`` as stored (bf16/f32, cast to f32 in VMEM); normalised centroids
``c_hat [N, C_pad, D]`` f32 (``C_pad`` a multiple of 128, padded rows invalid); centroid validity as a column
``[N, C_pad, 1]``; row validity and labels as lane-dense rows ``[N, 1, L_pad]``. Working on the transposed
similarity ``S^T [C_pad, tL]`` puts the labels of a tile on lanes, so no in-kernel transpose is needed.

Assignment, grid ``(N, L_pad/tL)``, both axes parallel: ``S^T = c_hat @ x_tile^T`` on the MXU (f32,
``HIGHEST``), invalid centroids masked to ``-inf``, the max over centroids (sublanes), then the lowest centroid
reaching it (iota, compare, min: argmax with lowest-index ties, no gathers), labels ``[1, tL]``; ``C`` for
invalid rows and when no centroid is valid.

Update, grid ``(N, L_pad/tL)`` with ``L`` the reduction ("arbitrary") axis: the transposed one-hot
``OH^T [C_pad, tL] = (iota_c == labels)`` is built in VMEM, then ``sums [C_pad, D] += OH^T @ x_tile`` (f32,
``HIGHEST``: the one-hot is exact) and ``counts [1, C_pad] += 1 @ OH`` (the one-hot's column sum, on the MXU
so that it lands on lanes) accumulate in the resident output blocks (index maps ignore the L step; zeroed at
the first step with ``pl.when``). No atomics, no scatter: the paper's shared-memory ``atomicAdd`` kernel
(Fig. 7) becomes an MXU matmul, deterministic. Rows must be finite: a NaN/inf row poisons the sums through
``0 * inf`` even when its label is the sentinel.

TPU-legal blocks (``tiling.check_block_shape``, also in interpret mode): ``(tL, D)`` of ``(L_pad, D)`` and the
``(1, tL)`` label/valid rows need ``tL`` a multiple of 128 or ``tL = L`` (one tile); centroid blocks are whole.
VMEM per step is about ``C_pad * tL * 4 B`` times a few (the similarity and its masks) plus the centroid block
``C_pad * D * 4 B`` (double-buffered): lower ``block_l`` for very large ``C``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.cosine_kmeans import _common
from kernels_pallas.cosine_kmeans.reference import HIGHEST
from kernels_pallas.decode_attention.tiling import check_block_shape


def _check_blocks(specs, block_l: int, l: int) -> None:
    """``check_block_shape`` on every ``(name, array_shape, block_shape)``; the error names ``block_l``."""
    for name, shape, block in specs:
        try:
            check_block_shape(name, shape, block)
        except ValueError as e:
            raise ValueError(
                f"block_l={block_l} gives a TPU-illegal row tile for L={l}: use a multiple of 128, "
                f"or block_l >= L (one tile). {e}"
            ) from None


def _assign_kernel(x_ref, c_ref, cv_ref, v_ref, lab_ref, *, c: int):
    x = x_ref[...].astype(jnp.float32)  # [tL, D]
    cn = c_ref[...]  # [C_pad, D] f32, normalised
    st = jax.lax.dot_general(
        cn, x, (((1,), (1,)), ((), ())), precision=HIGHEST, preferred_element_type=jnp.float32
    )  # [C_pad, tL]
    st = jnp.where(cv_ref[...] > 0.5, st, -jnp.inf)  # cv [C_pad, 1]
    best = jnp.max(st, axis=0, keepdims=True)  # [1, tL]
    rows = jax.lax.broadcasted_iota(jnp.int32, st.shape, 0)
    idx = jnp.min(jnp.where(st == best, rows, st.shape[0]), axis=0, keepdims=True)  # lowest index on ties
    ok = (v_ref[...] > 0.5) & (best > -jnp.inf)  # v [1, tL]
    lab_ref[...] = jnp.where(ok, idx, c)


@functools.partial(jax.jit, static_argnames=("block_l", "interpret"))
def cosine_assign_tpu(
    x, centroids, valid=None, cvalid=None, *, block_l: int = _common.TPU_BLOCK_L, interpret: bool = False
):
    """Labels ``[N, L]`` int32 (contract of ``reference.cosine_assign_reference``)."""
    n, l, d = x.shape
    c = centroids.shape[1]
    tl = _common.tpu_row_tile(l, block_l)
    c_pad = _common.round_up(c, _common.TPU_C_ALIGN)
    xp, cn, cv, v = _common.pack_assign(x, centroids, valid, cvalid, tl, c_pad, d)
    l_pad = xp.shape[1]
    cv = cv.reshape(n, c_pad, 1)
    v = v.reshape(n, 1, l_pad)
    row_map = lambda i, j: (i, j, 0)  # noqa: E731
    lane_map = lambda i, j: (i, 0, j)  # noqa: E731
    head_map = lambda i, j: (i, 0, 0)  # noqa: E731
    specs = [
        ("x", xp.shape, (None, tl, d), row_map),
        ("centroids", cn.shape, (None, c_pad, d), head_map),
        ("cvalid", cv.shape, (None, c_pad, 1), head_map),
        ("valid", v.shape, (None, 1, tl), lane_map),
    ]
    out_spec = ("labels", (n, 1, l_pad), (None, 1, tl), lane_map)
    _check_blocks([s[:3] for s in specs + [out_spec]], block_l, l)
    lab = pl.pallas_call(
        functools.partial(_assign_kernel, c=c),
        grid=(n, l_pad // tl),
        in_specs=[pl.BlockSpec(block, imap) for _, _, block, imap in specs],
        out_specs=pl.BlockSpec(out_spec[2], out_spec[3]),
        out_shape=jax.ShapeDtypeStruct(out_spec[1], jnp.int32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name="cosine_assign_tpu",
    )(xp, cn, cv, v)
    return lab[:, 0, :l]


def _update_kernel(x_ref, lab_ref, sum_ref, cnt_ref):
    @pl.when(pl.program_id(1) == 0)
    def _init():
        sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
        cnt_ref[...] = jnp.zeros(cnt_ref.shape, jnp.int32)

    x = x_ref[...].astype(jnp.float32)  # [tL, D]
    lab = lab_ref[...]  # [1, tL] int32
    c_pad, tl = sum_ref.shape[0], x.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (c_pad, tl), 0)
    oh = jnp.where(rows == lab, 1.0, 0.0).astype(jnp.float32)  # [C_pad, tL] transposed one-hot
    sum_ref[...] += jax.lax.dot_general(
        oh, x, (((1,), (0,)), ((), ())), precision=HIGHEST, preferred_element_type=jnp.float32
    )  # [C_pad, D]
    ones = jnp.ones((8, tl), jnp.float32)  # 8 rows: one full sublane tile for the MXU
    cnt = jax.lax.dot_general(
        ones, oh, (((1,), (1,)), ((), ())), precision=HIGHEST, preferred_element_type=jnp.float32
    )  # [8, C_pad], exact (0/1, f32 sum)
    cnt_ref[...] += cnt[0:1].astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("num_clusters", "block_l", "interpret"))
def centroid_update_tpu(x, labels, num_clusters: int, *, block_l: int = _common.TPU_BLOCK_L, interpret: bool = False):
    """``(sums [N, C, D] float32, counts [N, C] int32)`` (contract of ``reference.centroid_update_reference``)."""
    n, l, d = x.shape
    c = num_clusters
    tl = _common.tpu_row_tile(l, block_l)
    c_pad = _common.round_up(c, _common.TPU_C_ALIGN)
    xp, lab = _common.pack_update(x, labels, c, tl, d)
    l_pad = xp.shape[1]
    lab = lab.reshape(n, 1, l_pad)
    row_map = lambda i, j: (i, j, 0)  # noqa: E731
    lane_map = lambda i, j: (i, 0, j)  # noqa: E731
    head_map = lambda i, j: (i, 0, 0)  # noqa: E731
    specs = [("x", xp.shape, (None, tl, d), row_map), ("labels", lab.shape, (None, 1, tl), lane_map)]
    out_specs = [
        ("sums", (n, c_pad, d), (None, c_pad, d), head_map),
        ("counts", (n, 1, c_pad), (None, 1, c_pad), head_map),
    ]
    _check_blocks([s[:3] for s in specs + out_specs], block_l, l)
    sums, counts = pl.pallas_call(
        _update_kernel,
        grid=(n, l_pad // tl),
        in_specs=[pl.BlockSpec(block, imap) for _, _, block, imap in specs],
        out_specs=[pl.BlockSpec(block, imap) for _, _, block, imap in out_specs],
        out_shape=[jax.ShapeDtypeStruct((n, c_pad, d), jnp.float32), jax.ShapeDtypeStruct((n, 1, c_pad), jnp.int32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="centroid_update_tpu",
    )(xp, lab)
    return _common.unpack_update(sums, counts[:, 0], c, d)
