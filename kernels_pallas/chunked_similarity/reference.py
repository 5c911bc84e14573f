"""Pure-JAX reference (the spec and the CPU path) of the chunked best match of Chelsea's CSM.

Chelsea §5.2 / App. B: the middle of a cache is cut into chunks of ``c`` tokens; inside each chunk the tokens at
even offsets form set A and those at odd offsets set B (Theorem 6.1's alternating partition); each A token is
connected to its most cosine-similar B token of the same chunk. This computes, per chunk, that best B match and
its cosine score for every A token. The similarity is only ever formed per chunk, ``(c/2) x (c/2)``, never
``n x n`` (Table 1: cost ``n c d / 4``).

Shapes (axes: b batch, h head, p chunk, i A row, j B row, d head dim):
  k ``[B, H, M, D]`` with ``M % c == 0``; valid ``[B, H, M]`` bool ->
  best ``[B, H, P, c/2]`` float32 (``-inf`` where the A token is invalid or has no valid B in its chunk),
  idx ``[B, H, P, c/2]`` int32, the B row ``j`` in the chunk (the token at chunk offset ``2 j + 1``); ties go
  to the lowest ``j``; 0 where ``best`` is ``-inf``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

EPS2 = 1e-24  # squared-norm floor: a zero key has cosine 0 with everything


def l2_normalise(x: jnp.ndarray) -> jnp.ndarray:
    """``x / ||x||`` over the last axis in float32 (zero vectors stay zero)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), EPS2))


def split_chunks(k: jnp.ndarray, valid: jnp.ndarray, chunk: int):
    """``[B,H,M,D]`` -> A, B keys ``[B,H,P,c/2,D]`` and validity ``[B,H,P,c/2]`` (A = even, B = odd offsets)."""
    b, h, m, d = k.shape
    p = m // chunk
    kc = k.reshape(b, h, p, chunk // 2, 2, d)
    vc = valid.reshape(b, h, p, chunk // 2, 2)
    return kc[..., 0, :], kc[..., 1, :], vc[..., 0], vc[..., 1]


def chunk_best_match_reference(k: jnp.ndarray, valid: jnp.ndarray, chunk: int):
    """Best in-chunk B match per A token: ``(best [B,H,P,c/2] f32, idx [B,H,P,c/2] int32)``."""
    ka, kb, va, vb = split_chunks(k, valid, chunk)
    s = jnp.einsum(
        "bhpid,bhpjd->bhpij",
        l2_normalise(ka),
        l2_normalise(kb),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    s = jnp.where(va[..., :, None] & vb[..., None, :], s, -jnp.inf)
    best = jnp.max(s, axis=-1)
    idx = jnp.argmax(s, axis=-1).astype(jnp.int32)  # first maximum: lowest j on ties
    return best, jnp.where(best > -jnp.inf, idx, 0)
