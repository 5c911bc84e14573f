"""``streaming_llm`` (Xiao et al., 2024, StreamingLLM §3.2): attention sinks plus a rolling recent window.

The cache holds the first ``sinks`` tokens and the most recent ``S - sinks`` tokens, ``S`` the budget: a
fraction of the prompt bucket, or a token count (capped at prompt bucket + ``max_new_tokens``); during decode the oldest recent token is evicted for each
new one, so the cache never grows. The recent window is a ring: position ``p >= sinks`` lives in slot
``sinks + (p - sinks) mod (S - sinks)``. (Positions are the original ones: RoPE is applied before
caching, as in the papers' long-context harnesses, not re-indexed inside the cache.)
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax import attention
from kvjax.methods.base import (Capacity, SlotCache, check_budget, empty_slots, static_budget,
                                store_prompt, tree_bytes, write_token)


@dataclasses.dataclass(frozen=True)
class StreamingLLM:
    name: ClassVar[str] = "streaming_llm"
    budget: float | int = 0.2
    sinks: int = 4

    def __post_init__(self):
        check_budget(self.budget)
        if self.sinks < 0:
            raise ValueError(f"sinks={self.sinks} must be >= 0")

    def slots(self, capacity: Capacity) -> int:
        # A token budget may cover generated tokens too (no eviction until it is reached).
        s = (static_budget(self.budget, capacity.prompt_len) if isinstance(self.budget, float)
             else min(self.budget, capacity.prompt_len + capacity.max_new_tokens))
        if s <= self.sinks:
            raise ValueError(f"budget={self.budget} gives {s} slots at prompt length {capacity.prompt_len}, not "
                             f"more than sinks={self.sinks}; raise the budget or lower sinks")
        return s

    def init(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> SlotCache:
        s = self.slots(capacity)
        return empty_slots(model_cfg, batch, s, dtype, prompt_slots=s)

    def _ring(self, slots: int) -> int:
        return slots - self.sinks

    def prefill(self, state: SlotCache, layer: int, q, k, v, lengths) -> SlotCache:
        b, h, t, _ = k.shape
        s = state.k.shape[2]
        r = self._ring(s)
        slot = jnp.arange(s)
        # Latest position p < length living in each ring slot: j = p - sinks with j = slot - sinks (mod r).
        jmax = (lengths - self.sinks - 1)[:, None]  # [B, 1]
        j = jmax - jnp.mod(jmax - (slot[None, :] - self.sinks), r)
        idx = jnp.where(slot[None, :] < self.sinks, slot[None, :], self.sinks + j)  # [B, S]
        ok = (idx >= 0) & (idx < lengths[:, None]) & ((slot[None, :] < self.sinks) | (j >= 0))
        idx = jnp.broadcast_to(jnp.where(ok, idx, -1)[:, None], (b, h, s)).astype(jnp.int32)
        return store_prompt(state, k, v, idx, jnp.broadcast_to(ok[:, None], (b, h, s)))

    def decode(self, state: SlotCache, layer: int, q, k, v, pos):
        part, state, _ = self.decode_partial(state, layer, q, k, v, pos)
        return attention.normalise(part), state

    def decode_partial(self, state: SlotCache, layer: int, q, k, v, pos):
        """``decode`` returning the attention partials ``(o, m, l)`` and the pair the new token overwrote
        ``(k [B,Hkv,D], v [B,Hkv,D], evicted [B,Hkv] bool)`` (evicted before this step's attention), for LESS."""
        b, h = k.shape[:2]
        s = state.k.shape[2]
        slot = jnp.where(pos < self.sinks, pos, self.sinks + jnp.mod(pos - self.sinks, self._ring(s)))
        slot = jnp.broadcast_to(slot[:, None], (b, h)).astype(jnp.int32)
        ek = jnp.take_along_axis(state.k, slot[..., None, None], axis=2)[:, :, 0]
        ev = jnp.take_along_axis(state.v, slot[..., None, None], axis=2)[:, :, 0]
        gone = jnp.take_along_axis(state.pos, slot[..., None], axis=2)[..., 0] >= 0
        state = write_token(state, slot, k, v, pos)
        return attention.attend(q, state.k, state.v, state.valid), state, (ek, ev, gone)

    def memory_bytes(self, state: SlotCache) -> int:
        return tree_bytes(state)
