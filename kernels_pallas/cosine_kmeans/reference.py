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


@functools.partial(jax.jit, static_argnames=("num_clusters", "block_l"))
def centroid_update_onehot(x, labels, num_clusters: int, block_l: int | None = None):
    """:func:`centroid_update_reference` as one-hot matmuls (the accelerators' xla path): ``sums = OH^T @ x`` with
    ``OH [N, L, C]`` the labels' one-hot, in row blocks of ``block_l`` (default all rows) summed. Bfloat16 keys
    multiply a bfloat16 one-hot (exact products, float32 accumulation, the matrix unit's rate); other dtypes run in
    float32 at ``HIGHEST``. Sums equal the reference's up to float32 summation order; counts are exact. Rows whose
    label is outside ``[0, C)`` are zeroed first, so they need not be finite. No scatter (atomics on a GPU: a
    nondeterministic order)."""
    n, l, d = x.shape
    c = num_clusters
    bl = min(block_l or l, l)
    nb = -(-l // bl)
    dt = jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32
    lab = labels.astype(jnp.int32)
    lab = jnp.pad(jnp.where((lab >= 0) & (lab < c), lab, c), ((0, 0), (0, nb * bl - l)), constant_values=c)
    xs = jnp.pad(x, ((0, 0), (0, nb * bl - l), (0, 0)))
    ids = jnp.arange(c, dtype=jnp.int32)

    def block(i):
        lb = jax.lax.dynamic_slice_in_dim(lab, i * bl, bl, axis=1)  # [N, bl]
        xb = jax.lax.dynamic_slice_in_dim(xs, i * bl, bl, axis=1)  # [N, bl, D]
        hit = lb[:, :, None] == ids  # [N, bl, C]
        xb = jnp.where((lb < c)[..., None], xb, 0).astype(dt)
        sums = jnp.einsum("nlc,nld->ncd", hit.astype(dt), xb, precision=HIGHEST, preferred_element_type=jnp.float32)
        return sums, jnp.sum(hit, axis=1, dtype=jnp.int32)

    if nb == 1:
        return block(0)
    sums, counts = jax.lax.map(block, jnp.arange(nb))
    return sums.sum(axis=0), counts.sum(axis=0)


def new_centroids(centroids, sums, counts) -> jnp.ndarray:
    """The update step: ``sums / counts`` (mean of the raw member rows) where ``counts > 0``, else the old
    centroid (an empty or invalid cluster keeps its centroid). ``[N, C, D]`` float32."""
    mean = sums / jnp.maximum(counts, 1).astype(jnp.float32)[..., None]
    return jnp.where(counts[..., None] > 0, mean, centroids.astype(jnp.float32))
