"""``accumulated_attention``: a prompt's causal attention and H2O's accumulated scores in one pass.

>>> out, scores = accumulated_attention(q, k, v, lengths)              # impl chosen by backend
>>> _, scores = accumulated_attention(q, k, None, lengths, impl="xla")  # scores only, the pure-JAX path

q ``[B, Hq, T, D]``; k, v ``[B, Hkv, T, D]`` (GQA: ``Hq`` a multiple of ``Hkv``, KV never repeated); lengths ``[B]``
int (real tokens ``[0, n)``; padding may hold anything). Returns ``out [B, Hq, T, D]`` in q's dtype (the causal
softmax attention of every real query; rows of padded queries are 0; None when ``v`` is None) and ``scores [B,
Hkv, T]`` float32: per key the column sum over every real query of its causal softmax, averaged over the KV group's
query heads (H2O's accumulated attention at prefill; 0 past the length). bf16 or float32 inputs, float32
softmax, scores and accumulation.

impl: ``"xla"`` (:mod:`.reference`: query bands against their causal keys, tiles sized by a memory budget; the
spec and the GPU/TPU XLA path), ``"pallas_gpu"`` (Triton, FlashAttention-style: a causal forward giving the output
and each row's log-sum-exp, then a column-sum kernel per key block; :mod:`.pallas_gpu`), or None:
``$KVJAX_ACCUMULATED_ATTENTION_IMPL`` if set, else ``pallas_gpu`` on a GPU where verified on the hardware
(``kernels_pallas/verified.py``), else ``xla``. There is no TPU kernel: a TPU runs the XLA path. A Pallas failure
is raised, never replaced by the reference silently. ``interpret=True`` runs the Pallas kernels in interpret mode
(CPU tests).

The CPU's path (row blocks against cache-sized key tiles, one head group at a time) is
``kvjax.methods.core.select``'s; ``select.accumulated_attention`` chooses between it and this package by backend.
"""

from __future__ import annotations

from kernels_pallas.accumulated_attention.reference import (
    BANDS,
    TILE_BYTES,
    accumulated_attention_reference,
    band_plan,
    loop_trips,
)
from kernels_pallas.impl_choice import choose

IMPLS = ("xla", "pallas_gpu")
ENV_IMPL = "KVJAX_ACCUMULATED_ATTENTION_IMPL"


def default_impl() -> str:
    """``$KVJAX_ACCUMULATED_ATTENTION_IMPL`` if set, else ``pallas_gpu`` on a GPU where it has been verified
    (:mod:`kernels_pallas.impl_choice`), else xla."""
    return choose("accumulated_attention", IMPLS, "xla")


def pallas_gpu_supports(head_dim: int) -> bool:
    """Whether the GPU kernels tile this head_dim (Triton: a power of two, at least 16)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def check_inputs(q, k, v, lengths):
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"q {q.shape} and k {k.shape} must be [B, H, T, D]")
    b, hq, t, d = q.shape
    if k.shape[0] != b or k.shape[2:] != (t, d) or k.shape[1] < 1 or hq % k.shape[1]:
        raise ValueError(f"k has shape {k.shape}; expected [B={b}, Hkv, T={t}, D={d}] with Hkv dividing Hq={hq} (GQA)")
    if v is not None and v.shape != k.shape:
        raise ValueError(f"v has shape {v.shape}; expected k's {k.shape}")
    if getattr(lengths, "shape", None) != (b,):
        raise ValueError(f"lengths has shape {getattr(lengths, 'shape', None)}; expected ({b},)")


def accumulated_attention(q, k, v, lengths, impl: str | None = None, interpret: bool = False, **options):
    """See the module docstring. ``options``: ``tile_bytes``, ``rows``, ``bands`` for ``xla``
    (:func:`.reference.band_plan`); ``block_q``, ``block_k``, ``num_warps``, ``num_stages`` for ``pallas_gpu``."""
    check_inputs(q, k, v, lengths)
    impl = impl or default_impl()
    if impl == "xla":
        return accumulated_attention_reference(q, k, v, lengths, **options)
    if impl == "pallas_gpu":
        from kernels_pallas.accumulated_attention.pallas_gpu import accumulated_attention_gpu

        return accumulated_attention_gpu(q, k, v, lengths, interpret=interpret, **options)
    raise ValueError(f"impl={impl!r} must be one of {IMPLS} or None (chosen by backend)")


__all__ = [
    "BANDS",
    "IMPLS",
    "TILE_BYTES",
    "accumulated_attention",
    "accumulated_attention_reference",
    "band_plan",
    "default_impl",
    "loop_trips",
    "pallas_gpu_supports",
]
