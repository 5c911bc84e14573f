"""Pallas TPU kernel: per chunk, the best B match and cosine score of every A token (Chelsea §5.2).

Grid ``(B*H, P)``: one chunk per step, a ``[c/2, 2D]`` key tile (A in lanes ``[0, D)``, B in ``[D, 2D)``), one
``(c/2) x (c/2)`` MXU matmul, a masked column max and an iota-min argmax. No in-kernel gathers. See
``_common`` for the layout and the ``pallas_call`` (shared with the GPU kernel) and ``reference`` for the contract.
"""

from __future__ import annotations

import functools

import jax

from kernels_pallas.chunked_similarity import _common


@functools.partial(jax.jit, static_argnames=("chunk", "interpret"))
def chunk_best_match_tpu(k, valid, chunk: int, interpret: bool = False):
    return _common.chunk_best_match_call(k, valid, chunk, name="chunk_best_match_tpu", interpret=interpret)
