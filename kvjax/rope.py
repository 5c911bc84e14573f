"""Rotary position embeddings in Hugging Face's ``rotate_half`` layout.

Post-RoPE keys therefore equal the keys of the PyTorch reference (``transformers``' Llama/Mistral/Qwen2), which
matters for every method that scores or clusters keys. Implements RoFormer eq. (34) with the frequency
schedules of ``transformers.modeling_rope_utils``: ``default``, ``linear`` and ``llama3``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from kvjax.config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies ``[head_dim // 2]`` (float32, computed as transformers does)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv = (np.float32(1.0) / (np.float32(rope.theta) ** exponents)).astype(np.float32)
    if rope.rope_type == "linear":
        inv = inv / np.float32(rope.factor)
    elif rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def cos_sin(rope: RopeConfig, head_dim: int, positions: jnp.ndarray, dtype) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos and sin tables ``[B, T, head_dim]`` for integer ``positions [B, T]``, cast to ``dtype``."""
    inv = jnp.asarray(inv_frequencies(rope, head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def rotate_half(x: jnp.ndarray) -> jnp.ndarray:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate ``x [B, H, T, D]`` with ``cos``/``sin`` ``[B, T, D]``."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin
