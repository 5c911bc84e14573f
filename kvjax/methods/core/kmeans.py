"""Batched Lloyd K-means for product quantization (PQCache §3.1 and §3.3; method note §2.3, §8.4, A5 of
``docs/notes/pqcache.md``).

Every leading index is an independent problem (batch x KV head x sub-space), solved at once with einsums:
x ``[..., P, d]`` rows (``d = D/m``), valid ``[..., P]`` bool (broadcastable), centroids ``[..., K, d]``
with ``K = 2^bits``. Distances are Euclidean (the authors' ``METRIC="euc"``); the iteration count is fixed
(the note's on-device default T = 10 instead of the paper's CPU-time-adaptive T); initial centroids are K
valid rows sampled without replacement (``init_rows``); an empty cluster keeps its previous centroid (note A5
default); a final assignment pass gives the codes (sklearn's ``labels_``). Ties in the assignment go to the
lowest centroid index. Math in float32 at ``Precision.HIGHEST``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def init_rows(key, valid: jnp.ndarray, k: int, positions: jnp.ndarray | None = None) -> jnp.ndarray:
    """``k`` row indices ``[B, k]`` int32 per sequence, sampled without replacement from the valid rows.

    valid: ``[B, P]`` bool; positions: the token position of each row, ``[P]`` or ``[B, P]`` int (default
    ``arange(P)``). Sampling is a Gumbel top-k with a fixed ``key`` (deterministic; the noise of a row is
    ``gumbel(fold_in(key, position))``, independent of ``P``, the batch index and the row order). A sequence
    with fewer than ``k`` valid rows repeats them cyclically (duplicate centroids stay empty; ties go to the
    first; ClusterKV marks them invalid instead). With no valid row the indices are arbitrary (those centroids
    are never used for the prompt).
    """
    b, p = valid.shape
    # One Gumbel draw per *position* (key folded with the position), shared by the batch rows: the draw of a
    # row does not depend on the padded length P (the prompt bucket) or on the batch, so the same prompt gets
    # the same init rows in any bucket (the budget contract's bucket invariance).
    pos = jnp.arange(p) if positions is None else jnp.asarray(positions)
    draw = lambda i: jax.random.gumbel(jax.random.fold_in(key, i), ())  # noqa: E731
    noise = jax.vmap(draw)(pos) if pos.ndim == 1 else jax.vmap(jax.vmap(draw))(pos)
    g = jnp.where(valid, noise if noise.ndim == 2 else noise[None, :], -jnp.inf)
    if p < k:
        g = jnp.pad(g, ((0, 0), (0, k - p)), constant_values=-jnp.inf)
    _, perm = jax.lax.top_k(g, k)  # valid rows first, in Gumbel order
    n = jnp.maximum(valid.sum(-1, keepdims=True), 1)
    idx = jnp.take_along_axis(perm, jnp.arange(k)[None, :] % n, axis=-1)
    return jnp.minimum(idx, p - 1).astype(jnp.int32)


def assign(x: jnp.ndarray, c: jnp.ndarray) -> jnp.ndarray:
    """Nearest centroid ``[..., P]`` int32 of each row: ``argmin_c |x - c|^2`` (= argmin ``|c|^2 - 2 x·c``)."""
    x = x.astype(jnp.float32)
    d2 = jnp.sum(c * c, axis=-1)[..., None, :] - 2.0 * jnp.einsum("...pd,...kd->...pk", x, c, precision=_HI)
    return jnp.argmin(d2, axis=-1).astype(jnp.int32)


def lloyd_step(x: jnp.ndarray, valid: jnp.ndarray, c: jnp.ndarray) -> jnp.ndarray:
    """One Lloyd iteration: assign the valid rows, move each centroid to its members' mean (empty: keep)."""
    x = x.astype(jnp.float32)
    k = c.shape[-2]
    hot = jax.nn.one_hot(assign(x, c), k, dtype=jnp.float32) * valid[..., None].astype(jnp.float32)
    sums = jnp.einsum("...pk,...pd->...kd", hot, x, precision=_HI)
    cnt = hot.sum(axis=-2)[..., None]
    return jnp.where(cnt > 0, sums / jnp.maximum(cnt, 1.0), c)


def kmeans(x: jnp.ndarray, valid: jnp.ndarray, c0: jnp.ndarray, iters: int):
    """``iters`` Lloyd steps from ``c0``, then a final assignment.

    x ``[..., P, d]``, valid ``[..., P]`` (broadcastable), c0 ``[..., K, d]`` -> (centroids ``[..., K, d]``
    float32, labels ``[..., P]`` int32; labels of invalid rows are their nearest centroid too).
    """
    c = jax.lax.fori_loop(0, iters, lambda _, c: lloyd_step(x, valid, c), c0.astype(jnp.float32))
    return c, assign(x, c)
