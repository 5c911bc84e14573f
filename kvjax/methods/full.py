"""``full``: no compression. Every prompt token and every generated token keeps its own slot."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.methods.base import Capacity, SlotCache, append_decode, empty_slots, store_prompt, tree_bytes


@dataclasses.dataclass(frozen=True)
class Full:
    name: ClassVar[str] = "full"

    def init(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> SlotCache:
        slots = capacity.prompt_len + capacity.max_new_tokens
        return empty_slots(model_cfg, batch, slots, dtype, prompt_slots=capacity.prompt_len)

    def prefill(self, state: SlotCache, layer: int, q, k, v, lengths) -> SlotCache:
        b, h, t, _ = k.shape
        idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, h, t))
        return store_prompt(state, k, v, idx, idx < lengths[:, None, None])

    def decode(self, state: SlotCache, layer: int, q, k, v, pos):
        return append_decode(state, q, k, v, pos)

    def memory_bytes(self, state: SlotCache) -> int:
        return tree_bytes(state)
