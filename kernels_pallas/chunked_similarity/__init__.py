"""``chunk_best_match``: per chunk, the best B match and its cosine score for every A token (Chelsea §5.2).

>>> best, idx = chunk_best_match(k, valid, chunk=256)           # impl chosen by backend
>>> best, idx = chunk_best_match(k, valid, 256, impl="xla")     # the pure-JAX reference

k ``[B, H, M, D]`` (``M`` a multiple of ``chunk``), valid ``[B, H, M]`` bool -> best ``[B, H, M/c, c/2]``
float32 cosine (``-inf``: invalid A or no valid B in the chunk) and idx ``[B, H, M/c, c/2]`` int32, the B row of
the match (chunk offset ``2 idx + 1``), lowest on ties. A = even chunk offsets, B = odd (Theorem 6.1).

impl: ``"xla"`` (reference), ``"pallas_tpu"``, ``"pallas_gpu"``, or None: ``$KVJAX_CHUNKED_SIMILARITY_IMPL`` if
set, else ``pallas_tpu`` on TPU, ``pallas_gpu`` on GPU where verified on the hardware
(``kernels_pallas/verified.py``), else ``xla``. A Pallas failure is raised, never replaced by the reference silently.
``interpret=True`` runs a Pallas kernel in interpret mode (tests on CPU).
"""

from __future__ import annotations

from kernels_pallas.impl_choice import choose
from kernels_pallas.chunked_similarity.reference import chunk_best_match_reference

IMPLS = ("xla", "pallas_tpu", "pallas_gpu")
ENV_IMPL = "KVJAX_CHUNKED_SIMILARITY_IMPL"


def default_impl() -> str:
    """``$KVJAX_CHUNKED_SIMILARITY_IMPL`` if set, else the backend's kernel (tpu -> pallas_tpu, gpu ->
    pallas_gpu) where it has been verified (:mod:`kernels_pallas.impl_choice`), else xla."""
    return choose("chunked_similarity", IMPLS, "xla")


def check_inputs(k, valid, chunk: int):
    if not isinstance(chunk, int) or chunk < 2 or chunk % 2:
        raise ValueError(f"chunk={chunk!r} must be an even integer >= 2 (A/B alternate inside a chunk)")
    if k.ndim != 4:
        raise ValueError(f"k has shape {k.shape}; expected [B, H, M, D]")
    if k.shape[2] % chunk:
        raise ValueError(f"k has M={k.shape[2]} tokens, not a multiple of chunk={chunk}; pad with invalid tokens")
    if valid.shape != k.shape[:3]:
        raise ValueError(f"valid has shape {valid.shape}; expected {k.shape[:3]} (= k.shape[:3])")


def chunk_best_match(k, valid, chunk: int, impl: str | None = None, interpret: bool = False):
    """See the module docstring. Returns ``(best, idx)``."""
    check_inputs(k, valid, chunk)
    impl = impl or default_impl()
    if impl == "xla":
        return chunk_best_match_reference(k, valid, chunk)
    if impl == "pallas_tpu":
        from kernels_pallas.chunked_similarity.pallas_tpu import chunk_best_match_tpu

        return chunk_best_match_tpu(k, valid, chunk, interpret=interpret)
    if impl == "pallas_gpu":
        from kernels_pallas.chunked_similarity.pallas_gpu import chunk_best_match_gpu

        return chunk_best_match_gpu(k, valid, chunk, interpret=interpret)
    raise ValueError(f"impl={impl!r} must be one of {IMPLS} or None (chosen by backend)")


__all__ = ["IMPLS", "chunk_best_match", "chunk_best_match_reference", "default_impl"]
