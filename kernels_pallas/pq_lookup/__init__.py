"""``pq_lookup``: approximate attention logits from PQ codes and a lookup table (PQCache §3.1).

>>> scores = pq_lookup(lut, codes)                    # impl chosen by backend
>>> scores = pq_lookup(lut, codes, lengths)           # only slots [0, lengths[b]) are read and scored
>>> scores = pq_lookup(lut, codes, impl="xla")        # the pure-JAX reference

lut ``[B, Hkv, G, m, K]`` float32 (per query head, ``lut[..., i, c] = q_i · C_{i,c}``), codes
``[B, Hkv, m, S]`` integer (uint8, values in ``[0, K)``; **sub-space-major**, the layout the kernels read, so
no per-call repack), lengths ``[B]`` int32 or None -> scores ``[B, Hkv, G, S]`` float32,
``scores[b,h,g,s] = sum_i lut[b,h,g,i,codes[b,h,i,s]]`` (= ``q · k_hat`` with ``k_hat`` the PQ reconstruction)
for ``s < lengths[b]`` and ``NEG_INF`` (-1e30) beyond. The Pallas kernels read and compute no token block that
starts at or past ``lengths[b]``. Allocate ``S`` as a multiple of ``CODE_ALIGN`` (512) to avoid a padding copy.

impl: ``"xla"`` (reference), ``"pallas_tpu"`` (one-hot MXU matmul), ``"pallas_gpu"`` (Triton), or None:
``$KVJAX_PQ_LOOKUP_IMPL`` if set, else ``pallas_tpu`` on TPU, ``pallas_gpu`` on GPU where verified on the
hardware (``kernels_pallas/verified.py``), else ``xla``. A Pallas failure is raised, never replaced by the
reference silently. ``interpret=True`` runs a Pallas kernel in interpret mode (tests on CPU);
``block_t`` is the token tile (default 512 on TPU, 128 on GPU).
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.checks import check_int
from kernels_pallas.impl_choice import choose
from kernels_pallas.pq_lookup._common import CODE_ALIGN, NEG_INF
from kernels_pallas.pq_lookup.reference import pq_lookup_reference

IMPLS = ("xla", "pallas_tpu", "pallas_gpu")
ENV_IMPL = "KVJAX_PQ_LOOKUP_IMPL"


def default_impl() -> str:
    """``$KVJAX_PQ_LOOKUP_IMPL`` if set, else the backend's kernel (tpu -> pallas_tpu, gpu ->
    pallas_gpu) where it has been verified (:mod:`kernels_pallas.impl_choice`), else xla."""
    return choose("pq_lookup", IMPLS, "xla")


def check_inputs(lut, codes, block_t, lengths=None):
    if lut.ndim != 5:
        raise ValueError(f"lut has shape {lut.shape}; expected [B, Hkv, G, m, K]")
    if codes.ndim != 4:
        raise ValueError(f"codes has shape {codes.shape}; expected [B, Hkv, m, S] (sub-space-major)")
    b, h, _, m, _ = lut.shape
    if codes.shape[:3] != (b, h, m):
        raise ValueError(
            f"codes has shape {codes.shape}, inconsistent with lut {lut.shape}; expected "
            f"[{b}, {h}, {m}, S] (sub-space-major)"
        )
    if lengths is not None and jnp.shape(lengths) != (b,):
        raise ValueError(f"lengths has shape {jnp.shape(lengths)}; expected [{b}]")
    if not jnp.issubdtype(codes.dtype, jnp.integer):
        raise ValueError(f"codes has dtype {codes.dtype}; expected an integer dtype (uint8)")
    check_int("block_t", block_t, "TPU: a multiple of 128", none_ok=True)


def pq_lookup(lut, codes, lengths=None, impl: str | None = None, interpret: bool = False, block_t: int | None = None):
    """See the module docstring. Returns scores ``[B, Hkv, G, S]`` float32."""
    check_inputs(lut, codes, block_t, lengths)
    impl = impl or default_impl()
    if impl == "xla":
        return pq_lookup_reference(lut, codes, lengths)
    if impl == "pallas_tpu":
        from kernels_pallas.pq_lookup.pallas_tpu import pq_lookup_tpu

        return pq_lookup_tpu(lut, codes, lengths, block_t=block_t or 512, interpret=interpret)
    if impl == "pallas_gpu":
        from kernels_pallas.pq_lookup.pallas_gpu import pq_lookup_gpu

        return pq_lookup_gpu(lut, codes, lengths, block_t=block_t or 128, interpret=interpret)
    raise ValueError(f"impl={impl!r} must be one of {IMPLS} or None (chosen by backend)")


__all__ = ["CODE_ALIGN", "IMPLS", "NEG_INF", "default_impl", "pq_lookup", "pq_lookup_reference"]
