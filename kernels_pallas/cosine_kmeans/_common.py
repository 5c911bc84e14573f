"""Tile defaults and input padding shared by the cosine K-means kernels (plain XLA on the inputs).

Rows ``L`` are cut into tiles of ``tL``; when ``L`` is not a multiple of the tile the rows are padded here
(one copy of ``x``): padded rows are invalid in the assignment (label ``C``) and carry the sentinel label in
the update, so they change nothing. Callers that want no copy allocate ``L`` as a multiple of
:data:`ROW_ALIGN` (a multiple of every default tile) or fit in one tile. Centroids are normalised here, once
per call in XLA (``[N, C, D]`` is small), and padded with zero rows that are marked invalid: to a multiple of
:data:`TPU_C_ALIGN` on TPU, to a power of two on GPU (Triton tiles are powers of two, so ``D`` is zero-padded
there too; zero channels change no dot product and no sum). Validity travels as float32 ``0/1``.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.checks import next_pow2
from kernels_pallas.cosine_kmeans.reference import normalise_centroids

#: Row tile of the pure-JAX assignment (``impl="xla"``) on the CPU: memory ``O(block x C)``, not ``O(L x C)``.
XLA_BLOCK_L = 512
#: On a GPU or TPU the xla path's row tile keeps its ``[N, block, C]`` float32 similarity (and the update's
#: ``[N, C, block]`` one-hot) under this many bytes: few, large operations (each loop trip is a host round trip on
#: a GPU), memory still linear in L.
ACCEL_BLOCK_BYTES = 2 << 30
#: Default row tile on TPU (method note ``docs/notes/clusterkv.md`` §7.3: ``tL = 256-512``); a multiple of 128
#: (lane-dense labels).
TPU_BLOCK_L = 512
#: Centroids are padded to a multiple of this on TPU (one lane tile / MXU width).
TPU_C_ALIGN = 128
#: Default row tile on GPU (Triton; a power of two >= 16).
GPU_BLOCK_L = 64
#: Centroid tile on GPU: the assignment loops over centroid tiles, the update has one program per tile.
GPU_BLOCK_C = 64
#: Smallest Triton ``tl.dot`` dimension: row tiles, centroid tiles and ``D`` are padded to at least this.
GPU_MIN_DIM = 16
#: Allocate ``L`` as a multiple of this to avoid the padding copy (every default tile divides it).
ROW_ALIGN = 512


def accelerated() -> bool:
    """Whether the xla path runs in large blocks (a GPU or TPU; read at trace time through
    :func:`kernels_pallas.impl_choice.backend`, which tests replace to force it on the CPU)."""
    from kernels_pallas.impl_choice import backend

    return backend() != "cpu"


def xla_block_l(n: int, l: int, c: int) -> int:
    """The xla path's row tile: :data:`XLA_BLOCK_L` on the CPU; on a GPU or TPU the most rows (a multiple of
    :data:`ROW_ALIGN`, at least one) whose ``[n, rows, c]`` float32 block fits :data:`ACCEL_BLOCK_BYTES`, or all
    ``l`` rows when they fit."""
    if not accelerated():
        return XLA_BLOCK_L
    rows = ACCEL_BLOCK_BYTES // max(4 * n * c, 1)
    return l if rows >= l else max(ROW_ALIGN, rows // ROW_ALIGN * ROW_ALIGN)


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def tpu_row_tile(l: int, block_l: int) -> int:
    """The TPU row tile: ``block_l``, or all of ``L`` when it fits in one tile (no padding then)."""
    return l if l <= block_l else block_l


def gpu_row_tile(l: int, block_l: int) -> int:
    """The GPU row tile: ``block_l`` (a power of two), shrunk to ``next_pow2(L)`` (at least 16) for short ``L``."""
    return min(block_l, max(GPU_MIN_DIM, next_pow2(l)))


def _pad(a, widths, value=0):
    if all(w == 0 for w in widths):
        return a
    return jnp.pad(a, [(0, w) for w in widths], constant_values=value)


def pack_assign(x, centroids, valid, cvalid, tl: int, c_pad: int, d_pad: int):
    """``x [N, L, D]``, centroids ``[N, C, D]``, valid ``[N, L]``/None, cvalid ``[N, C]``/None ->
    ``(x [N, L_pad, D_pad] (dtype kept), c_hat [N, C_pad, D_pad] f32, cv [N, C_pad] f32, v [N, L_pad] f32)``."""
    n, l, d = x.shape
    c = centroids.shape[1]
    l_pad = round_up(l, tl)
    xp = _pad(x, (0, l_pad - l, d_pad - d))
    cn = _pad(normalise_centroids(centroids), (0, c_pad - c, d_pad - d))
    cv = jnp.ones((n, c), jnp.float32) if cvalid is None else cvalid.astype(jnp.float32)
    v = jnp.ones((n, l), jnp.float32) if valid is None else valid.astype(jnp.float32)
    return xp, cn, _pad(cv, (0, c_pad - c)), _pad(v, (0, l_pad - l))


def pack_update(x, labels, num_clusters: int, tl: int, d_pad: int):
    """``x [N, L, D]``, labels ``[N, L]`` -> ``(x [N, L_pad, D_pad] (dtype kept), labels [N, L_pad] int32)``;
    padded rows get the sentinel label ``C``."""
    _, l, d = x.shape
    l_pad = round_up(l, tl)
    lab = _pad(labels.astype(jnp.int32), (0, l_pad - l), value=num_clusters)
    return _pad(x, (0, l_pad - l, d_pad - d)), lab


def unpack_update(sums, counts, c: int, d: int):
    """``sums [N, C_pad, D_pad]``, counts ``[N, C_pad]`` -> ``[N, C, D]``, ``[N, C]`` (free when unpadded)."""
    if sums.shape[1] != c or sums.shape[2] != d:
        sums = sums[:, :c, :d]
    if counts.shape[1] != c:
        counts = counts[:, :c]
    return sums, counts
