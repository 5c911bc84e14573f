"""``cosine_kmeans``: the two steps of ClusterKV's per-head K-means on keys (ClusterKV §III-B, §IV-B).

>>> labels = cosine_assign(x, centroids, valid, cvalid)          # impl chosen by backend
>>> sums, counts = centroid_update(x, labels, num_clusters=C)     # per-cluster sums of the member rows
>>> centroids, labels = lloyd_step(x, centroids, valid, cvalid)  # one Lloyd iteration
>>> labels = cosine_assign(x, centroids, impl="xla")             # the pure-JAX reference

x ``[N, L, D]`` bf16/f32 keys (``N`` = batch x layers x KV heads, each clustered on its own); centroids
``[N, C, D]`` float32 raw (normalised inside: ``c / (||c|| + 1e-8)``); valid ``[N, L]`` bool (None: every
row); cvalid ``[N, C]`` bool (None: every centroid).

- ``cosine_assign -> labels [N, L] int32``: ``argmax_c`` over valid centroids of ``x · c_hat``, the cosine
  similarity up to the row norm (the "semantic distance" of §III-B; rows need not be normalised); ties go to
  the lowest centroid index; an invalid row, and every row when no centroid is valid, gets the sentinel ``C``.
- ``centroid_update -> (sums [N, C, D] float32, counts [N, C] int32)``: the member rows (as float32) summed
  per label; labels outside ``[0, C)`` (the sentinel ``C`` included) are ignored. The xla path is a segment sum on
  the CPU and, on a GPU or TPU, a one-hot matmul (``reference.centroid_update_onehot``: one large matmul per
  iteration, exact for bfloat16 keys, deterministic; XLA's scatter-add runs on atomics there). The kernels accumulate a
  one-hot matmul (§IV-B's update kernel, Fig. 7, without atomics; method note ``docs/notes/clusterkv.md`` §7.3
  kernel B), so rows must be finite (``0 * inf`` is NaN even for ignored rows); the reference (``segment_sum``)
  does not need that.
- ``lloyd_step -> (new_centroids [N, C, D] float32, labels [N, L] int32)``: assign against the old centroids,
  then each centroid becomes the mean of its member rows (raw keys); an empty (or invalid) cluster keeps its
  old centroid. ``labels`` are the assignment against the old centroids.

impl: ``"xla"`` (reference), ``"pallas_tpu"``, ``"pallas_gpu"`` (Triton), or None: ``$KVJAX_COSINE_KMEANS_IMPL`` if
set, else ``pallas_tpu`` on TPU, ``pallas_gpu`` on GPU where verified on the hardware
(``kernels_pallas/verified.py``), else ``xla``. A Pallas failure is raised, never replaced by the reference
silently.
``interpret=True`` runs a Pallas kernel in interpret mode (tests on CPU). ``block_l`` is the row tile
(defaults in ``_common``: 512 on TPU, 64 on GPU; for xla 512 on the CPU, and on a GPU or TPU as many rows as
keep the ``[N, block_l, C]`` float32 similarity block under ``_common.ACCEL_BLOCK_BYTES`` (2 GiB): the whole of
L at 32k tokens x batch 8, so an iteration is one matmul and one fused arg-max, not a loop of small tiles; its
similarity block is linear in L either way); pallas_tpu needs a multiple of 128 or ``>= L`` (checked by
``tiling.check_block_shape``), pallas_gpu a power of two ``>= 16``. A ragged ``L`` (and on GPU a ``D`` that is
not a power of two) is padded, one copy of ``x``; allocate ``L`` as a multiple of ``ROW_ALIGN`` (512) to
avoid it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.checks import check_int
from kernels_pallas.impl_choice import choose
from kernels_pallas.cosine_kmeans import _common
from kernels_pallas.cosine_kmeans._common import ROW_ALIGN
from kernels_pallas.cosine_kmeans.reference import (
    centroid_update_onehot,
    centroid_update_reference,
    cosine_assign_reference,
    new_centroids,
    normalise_centroids,
)

IMPLS = ("xla", "pallas_tpu", "pallas_gpu")
ENV_IMPL = "KVJAX_COSINE_KMEANS_IMPL"


def default_impl() -> str:
    """``$KVJAX_COSINE_KMEANS_IMPL`` if set, else the backend's kernel (tpu -> pallas_tpu, gpu ->
    pallas_gpu) where it has been verified (:mod:`kernels_pallas.impl_choice`), else xla."""
    return choose("cosine_kmeans", IMPLS, "xla")


def _check_impl(impl):
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {IMPLS} or None (chosen by backend)")
    return impl or default_impl()


def _check_x(x) -> None:
    if x.ndim != 3:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected [N, L, D] (rows of N independent clusterings)")
    if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"x has dtype {x.dtype}; expected bfloat16 or float32 keys (float16 is accepted too)")
    if x.shape[2] < 1:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected D >= 1 channels")


def _check_block_l(block_l) -> None:
    why = "pallas_tpu: a multiple of 128 or >= L; pallas_gpu: a power of two >= 16; None: the default"
    check_int("block_l", block_l, why, none_ok=True, numpy_ok=True)


def _check_mask(name: str, m, shape) -> None:
    if m is None:
        return
    if tuple(m.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(m.shape)}; expected {tuple(shape)}")
    if m.dtype != jnp.bool_:
        raise ValueError(f"{name} has dtype {m.dtype}; expected bool (pass {name} != 0)")


def check_assign_inputs(x, centroids, valid, cvalid, block_l) -> None:
    """ValueError naming the argument for bad shapes, dtypes or ``block_l``."""
    _check_x(x)
    n, l, d = x.shape
    if centroids.ndim != 3 or centroids.shape[0] != n or centroids.shape[2] != d:
        raise ValueError(
            f"centroids has shape {tuple(centroids.shape)}; expected [N={n}, C, D={d}] to match x {tuple(x.shape)}"
        )
    if centroids.shape[1] < 1:
        raise ValueError("centroids has C=0 centroids; expected C >= 1")
    if not jnp.issubdtype(centroids.dtype, jnp.floating):
        raise ValueError(f"centroids has dtype {centroids.dtype}; expected float32 (raw, un-normalised)")
    _check_mask("valid", valid, (n, l))
    _check_mask("cvalid", cvalid, (n, centroids.shape[1]))
    _check_block_l(block_l)


def check_update_inputs(x, labels, num_clusters, block_l) -> None:
    """ValueError naming the argument for bad shapes, dtypes, ``num_clusters`` or ``block_l``."""
    _check_x(x)
    check_int("num_clusters", num_clusters, "C; labels equal to C are ignored", numpy_ok=True)
    if tuple(labels.shape) != tuple(x.shape[:2]):
        raise ValueError(f"labels has shape {tuple(labels.shape)}; expected [N, L] = {tuple(x.shape[:2])}")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"labels has dtype {labels.dtype}; expected int32 cluster ids in [0, C]")
    _check_block_l(block_l)


def cosine_assign(
    x,
    centroids,
    valid=None,
    cvalid=None,
    *,
    impl: str | None = None,
    interpret: bool = False,
    block_l: int | None = None,
):
    """Labels ``[N, L]`` int32; see the module docstring (``reference.cosine_assign_reference`` is the spec)."""
    impl = _check_impl(impl)
    check_assign_inputs(x, centroids, valid, cvalid, block_l)
    if x.shape[0] * x.shape[1] == 0:  # nothing to tile: the (empty) result has no values
        return cosine_assign_reference(x, centroids, valid, cvalid)
    if impl == "xla":
        n, l, _ = x.shape
        return _assign_xla(x, centroids, valid, cvalid, int(block_l or _common.xla_block_l(n, l, centroids.shape[1])))
    if impl == "pallas_tpu":
        from kernels_pallas.cosine_kmeans.pallas_tpu import cosine_assign_tpu

        return cosine_assign_tpu(
            x, centroids, valid, cvalid, block_l=int(block_l or _common.TPU_BLOCK_L), interpret=interpret
        )
    from kernels_pallas.cosine_kmeans.pallas_gpu import cosine_assign_gpu

    return cosine_assign_gpu(
        x, centroids, valid, cvalid, block_l=int(block_l or _common.GPU_BLOCK_L), interpret=interpret
    )


def _assign_xla(x, centroids, valid, cvalid, block_l: int):
    """The reference assignment, ``block_l`` rows at a time (``lax.map``): its ``[N, L, C]`` similarity block
    becomes ``[N, block_l, C]``, so memory is linear in ``L`` even when ``C`` grows with ``L`` (ClusterKV's
    ``C0 = L / 80``). Each row's labels are those of :func:`cosine_assign_reference`."""
    n, l, d = x.shape
    if l <= block_l:
        return cosine_assign_reference(x, centroids, valid, cvalid)
    nb = -(-l // block_l)
    rows = (
        lambda a: jnp.moveaxis(
            jnp.pad(a, ((0, 0), (0, nb * block_l - l)) + ((0, 0),) * (a.ndim - 2)).reshape(  # noqa: E731
                n, nb, block_l, *a.shape[2:]
            ),
            1,
            0,
        )
    )
    valid = jnp.ones((n, l), bool) if valid is None else valid
    out = jax.lax.map(lambda xv: cosine_assign_reference(xv[0], centroids, xv[1], cvalid), (rows(x), rows(valid)))
    return jnp.moveaxis(out, 0, 1).reshape(n, nb * block_l)[:, :l]


def centroid_update(
    x, labels, num_clusters: int, *, impl: str | None = None, interpret: bool = False, block_l: int | None = None
):
    """``(sums [N, C, D] float32, counts [N, C] int32)``; see the module docstring."""
    impl = _check_impl(impl)
    check_update_inputs(x, labels, num_clusters, block_l)
    num_clusters = int(num_clusters)
    if x.shape[0] * x.shape[1] == 0:  # no rows: zero sums and counts
        return centroid_update_reference(x, labels, num_clusters)
    if impl == "xla":
        if not _common.accelerated():  # the CPU: a segment sum, O(N L D)
            return centroid_update_reference(x, labels, num_clusters)
        n, l, _ = x.shape
        return centroid_update_onehot(x, labels, num_clusters, int(block_l or _common.xla_block_l(n, l, num_clusters)))
    if impl == "pallas_tpu":
        from kernels_pallas.cosine_kmeans.pallas_tpu import centroid_update_tpu

        return centroid_update_tpu(
            x, labels, num_clusters, block_l=int(block_l or _common.TPU_BLOCK_L), interpret=interpret
        )
    from kernels_pallas.cosine_kmeans.pallas_gpu import centroid_update_gpu

    return centroid_update_gpu(
        x, labels, num_clusters, block_l=int(block_l or _common.GPU_BLOCK_L), interpret=interpret
    )


def lloyd_step(
    x,
    centroids,
    valid=None,
    cvalid=None,
    *,
    impl: str | None = None,
    interpret: bool = False,
    block_l: int | None = None,
):
    """One Lloyd iteration: ``(new_centroids [N, C, D] float32, labels [N, L] int32)``; labels are the assignment
    against the old ``centroids``, an empty or invalid cluster keeps its old centroid (method note §2.3)."""
    labels = cosine_assign(x, centroids, valid, cvalid, impl=impl, interpret=interpret, block_l=block_l)
    sums, counts = centroid_update(x, labels, centroids.shape[1], impl=impl, interpret=interpret, block_l=block_l)
    return new_centroids(centroids, sums, counts), labels


__all__ = [
    "IMPLS",
    "ROW_ALIGN",
    "centroid_update",
    "centroid_update_onehot",
    "centroid_update_reference",
    "cosine_assign",
    "cosine_assign_reference",
    "default_impl",
    "lloyd_step",
    "new_centroids",
    "normalise_centroids",
]
