"""Pallas GPU (Triton) kernel: per chunk, the best B match and cosine score of every A token (Chelsea §5.2).

The TPU kernel's ``pallas_call`` (``_common``) with Triton's compiler parameters: one program per (head, chunk),
a ``[c/2, 2D]`` tile, one ``tl.dot`` of ``(c/2) x D x (c/2)``, a masked column max and iota-min argmax. Triton
needs power-of-two block dims: ``c/2`` and ``D`` must be powers of two (checked).
"""

from __future__ import annotations

import functools

import jax

from kernels_pallas.checks import is_pow2
from kernels_pallas.chunked_similarity import _common


@functools.partial(jax.jit, static_argnames=("chunk", "interpret", "num_warps"))
def chunk_best_match_gpu(k, valid, chunk: int, interpret: bool = False, num_warps: int = 4):
    d = k.shape[-1]
    if not (is_pow2(chunk // 2) and is_pow2(d)):
        raise ValueError(
            f"pallas_gpu needs chunk/2 and head_dim to be powers of two, got chunk={chunk}, "
            f"head_dim={d}; use impl='xla' or a power-of-two chunk"
        )
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    return _common.chunk_best_match_call(
        k, valid, chunk, name="chunk_best_match_gpu", interpret=interpret, compiler_params=params
    )
