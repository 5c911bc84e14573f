"""Token sampling as small frozen dataclasses (static under ``jit``): ``Greedy`` and ``Sample``.

``Sample(temperature, top_k, top_p)`` covers temperature, top-k (``top_k > 0``) and nucleus (``top_p < 1``)
sampling; it draws from ``jax.random.categorical`` with the key the engine splits per step (seeded).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Greedy:
    def __call__(self, logits: jnp.ndarray, key) -> jnp.ndarray:
        """``logits [B, V]`` -> token ids ``[B]`` int32."""
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Sample:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (use Greedy() for argmax decoding)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")

    def __call__(self, logits: jnp.ndarray, key) -> jnp.ndarray:
        x = logits.astype(jnp.float32) / self.temperature
        if self.top_k:
            kth = jax.lax.top_k(x, min(self.top_k, x.shape[-1]))[0][..., -1:]
            x = jnp.where(x < kth, -jnp.inf, x)
        if self.top_p < 1.0:
            order = jnp.argsort(-x, axis=-1)
            sorted_x = jnp.take_along_axis(x, order, axis=-1)
            probs = jax.nn.softmax(sorted_x, axis=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop_sorted = (jnp.cumsum(probs, axis=-1) - probs) >= self.top_p
            drop = jnp.zeros_like(drop_sorted).at[jnp.arange(x.shape[0])[:, None], order].set(drop_sorted)
            x = jnp.where(drop, -jnp.inf, x)
        return jax.random.categorical(key, x, axis=-1).astype(jnp.int32)


def get(name: str = "greedy", **options):
    if name == "greedy":
        if options:
            raise ValueError(f"greedy sampling takes no options, got {sorted(options)}")
        return Greedy()
    if name == "sample":
        return Sample(**options)
    raise ValueError(f"sampling={name!r} must be 'greedy' or 'sample'")
