"""Pure-JAX reference of ClusterKV's cosine K-means steps (the spec of the Pallas kernels and the CPU path).

ClusterKV §III-B clusters the keys of each head with K-means under the "semantic distance"
``D(i, j) = 1 - <k_i, k_j> / (|k_i| |k_j|)``: the assignment step gives each key the centroid of largest cosine
similarity, the update step makes each centroid the mean of the (raw, un-normalised) keys assigned to it, and
an empty cluster keeps its old centroid (method note ``docs/notes/clusterkv.md`` §2.3). The row norm of a key does
not change which centroid has the largest cosine, so keys are used as they are; centroids are normalised
``c / (||c|| + 1e-8)``. Method note §7.3 batches this over ``N = batch x layers x KV heads`` clusterings.

Shapes (einsum axes: n clustering (one head of one layer), l row (key), c centroid, d channel):
  x ``[N, L, D]`` bf16/f32 keys; centroids ``[N, C, D]`` float32 raw; valid ``[N, L]`` bool;
  cvalid ``[N, C]`` bool; labels ``[N, L]`` int32 in ``[0, C]`` (``C`` is the sentinel: no cluster);
  sums ``[N, C, D]`` float32; counts ``[N, C]`` int32.
Float32 math with ``precision=HIGHEST`` throughout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

EPS = 1e-8  # centroid-norm floor: c / (||c|| + EPS) (the ClusterKV code's eps)
HIGHEST = jax.lax.Precision.HIGHEST


def normalise_centroids(centroids: jnp.ndarray) -> jnp.ndarray:
    """``[N, C, D]`` -> ``c / (||c||_2 + 1e-8)`` float32 (a zero centroid stays zero)."""
    c = centroids.astype(jnp.float32)
    return c / (jnp.sqrt(jnp.sum(c * c, axis=-1, keepdims=True)) + EPS)


@jax.jit
def cosine_assign_reference(x, centroids, valid=None, cvalid=None) -> jnp.ndarray:
    """Labels ``[N, L]`` int32: ``argmax_c`` over valid centroids of ``x · c_hat`` (lowest ``c`` on ties);
    ``C`` for an invalid row and for every row when no centroid is valid."""
    c = centroids.shape[1]
    sim = jnp.einsum(
        "nld,ncd->nlc",
        x.astype(jnp.float32),
        normalise_centroids(centroids),
        precision=HIGHEST,
        preferred_element_type=jnp.float32,
    )  # [N, L, C]
    if cvalid is not None:
        sim = jnp.where(cvalid[:, None, :], sim, -jnp.inf)
    best = jnp.max(sim, axis=-1)
    ok = best > -jnp.inf
    if valid is not None:
        ok = ok & valid
    # argmax as the lowest index attaining the maximum: two plain reductions (XLA:CPU runs jnp.argmax's
    # variadic (value, index) reduction about 2.4x slower than a max and a min, ClusterKV's prefill).
    first = jnp.min(jnp.where(sim == best[..., None], jnp.arange(c, dtype=jnp.int32), c), axis=-1)
    return jnp.where(ok, first, c).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("num_clusters",))
def centroid_update_reference(x, labels, num_clusters: int):
    """``(sums [N, C, D] float32, counts [N, C] int32)`` of the rows per label; labels outside ``[0, C)`` (the
    sentinel ``C`` included) are ignored. A ``segment_sum`` over ``N * (C + 1)`` segments (one spare per
    clustering for the ignored rows): ``O(N L D)`` work, no ``[N, L, C]`` one-hot."""
    n, l, d = x.shape
    c = num_clusters
    lab = labels.astype(jnp.int32)
    lab = jnp.where((lab >= 0) & (lab < c), lab, c)
    seg = (lab + (c + 1) * jnp.arange(n, dtype=jnp.int32)[:, None]).reshape(-1)  # [N*L]
    sums = jax.ops.segment_sum(x.astype(jnp.float32).reshape(n * l, d), seg, num_segments=n * (c + 1))
    counts = jax.ops.segment_sum(jnp.ones((n * l,), jnp.int32), seg, num_segments=n * (c + 1))
    return sums.reshape(n, c + 1, d)[:, :c], counts.reshape(n, c + 1)[:, :c]


def new_centroids(centroids, sums, counts) -> jnp.ndarray:
    """The update step: ``sums / counts`` (mean of the raw member rows) where ``counts > 0``, else the old
    centroid (an empty or invalid cluster keeps its centroid). ``[N, C, D]`` float32."""
    mean = sums / jnp.maximum(counts, 1).astype(jnp.float32)[..., None]
    return jnp.where(counts[..., None] > 0, mean, centroids.astype(jnp.float32))
