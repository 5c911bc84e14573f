"""Rotary position embeddings in Hugging Face's ``rotate_half`` layout.

Post-RoPE keys therefore equal the keys of the PyTorch reference (``transformers``' Llama/Mistral/Qwen2), which
matters for every method that scores or clusters keys. Implements RoFormer eq. (34) with the frequency
schedules of ``transformers.modeling_rope_utils``: ``default``, ``linear``, ``llama3`` and static ``yarn`` (whose
``attention_factor`` scales cos and sin, so q·k by its square).
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
    elif rope.rope_type == "yarn":
        inv = _yarn(rope, head_dim)
    return inv


def _yarn(rope: RopeConfig, dim: int) -> np.ndarray:
    """YaRN's blended inverse frequencies (Peng et al. 2023, eq. 18-20; ``_compute_yarn_parameters``)."""

    def correction_dim(rotations):
        return (
            dim
            * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(rope.theta))
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    pos = (np.float32(rope.theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))).astype(np.float32)
    extrapolation = np.float32(1.0) / pos
    interpolation = np.float32(1.0) / (np.float32(rope.factor) * pos)
    keep = (np.float32(1.0) - ramp).astype(np.float32)  # 1: extrapolate (high frequencies)
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def cos_sin(rope: RopeConfig, head_dim: int, positions: jnp.ndarray, dtype) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos and sin tables ``[B, T, head_dim]`` for integer ``positions [B, T]``, cast to ``dtype``."""
    inv = jnp.asarray(inv_frequencies(rope, head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if rope.attention_factor != 1.0:
        cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
    return cos.astype(dtype), sin.astype(dtype)


def rotate_half(x: jnp.ndarray) -> jnp.ndarray:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate ``x [B, H, T, D]`` with ``cos``/``sin`` ``[B, T, D]``."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin
