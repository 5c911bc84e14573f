"""``streaming_llm`` (Xiao et al., 2024, StreamingLLM §3.2): attention sinks plus a rolling recent window.

Each sequence holds ``S = budget_tokens(budget, n)`` tokens of its own ``n``-token prompt (a fraction: ``ceil(b
n)``; a token count ``c``: ``min(c, n + generated)``, so a count may cover generated tokens): the first ``s``
sinks and the most recent ``S - s`` tokens, with ``s = min(sinks, S - 1)`` (a budget too small for the sinks
keeps the most recent tokens first). During decode the oldest recent token is evicted for each new one, so a
sequence never holds more than ``S``. The recent window is a per-sequence ring: position ``p >= s`` lives in slot
``s + (p - s) mod (S - s)``; only slots ``[0, S)`` of a sequence are live and read. (Positions are the original
ones: RoPE is applied before caching, as in the papers' long-context harnesses, not re-indexed in the cache.)
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kernels_pallas.checks import check_int
from kvjax.model import attention
from kvjax.methods.base import (
    DecodePartial,
    Capacity,
    LayerContext,
    MIN_TOKENS,
    SlotCache,
    SlotMethod,
    check_budget,
    empty_slots,
    evicting_budget,
    store_prompt,
    write_token,
)


@dataclasses.dataclass(frozen=True, eq=False)
class StreamingLLM(SlotMethod, DecodePartial):
    name: ClassVar[str] = "streaming_llm"
    why_no_decode_budget: ClassVar[str] = (  # base.Method.why_no_decode_budget
        "streaming_llm already bounds decode: its window rolls (a token budget covers generated tokens)."
    )
    traced_layer: ClassVar[bool] = True  # scan over layers (base.Method.traced_layer)
    budget: float | int = 0.2
    sinks: int = 4

    def __post_init__(self):
        check_budget(self.budget)
        check_int("sinks", self.sinks, "StreamingLLM uses 4", at_least=0)

    def sinks_for(self, s):
        """Sinks kept under a budget of ``s`` tokens: ``min(sinks, s - 1)`` (at least one recent slot)."""
        return jnp.minimum(self.sinks, jnp.maximum(s - 1, 0)) if hasattr(s, "shape") else min(self.sinks, max(s - 1, 0))

    def slots(self, capacity: Capacity) -> int:
        return evicting_budget(self.budget, capacity.prompt_len, capacity.prompt_len + capacity.max_new_tokens)

    def init(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> SlotCache:
        s = self.slots(capacity)
        return empty_slots(model_cfg, batch, s, dtype, prompt_slots=s)

    def prefill(self, state: SlotCache, layer: int, q, k, v, lengths, previous=None) -> SlotCache:
        b, h, t, _ = k.shape
        slots = state.k.shape[2]
        # [B] tokens each sequence may hold: ceil(b n), or the count (generated tokens fill it up; slots beyond
        # bucket + max_new_tokens are never reached, so the ring never wraps there).
        s = evicting_budget(self.budget, lengths, slots)
        sk = self.sinks_for(s)[:, None]  # [B, 1]
        r = jnp.maximum(s[:, None] - sk, 1)
        slot = jnp.arange(slots)[None, :]
        # Latest position p < length living in each ring slot: j = p - sk with j = slot - sk (mod r).
        jmax = lengths[:, None] - sk - 1
        j = jmax - jnp.mod(jmax - (slot - sk), r)
        idx = jnp.where(slot < sk, slot, sk + j)  # [B, S]
        ok = (idx >= 0) & (idx < lengths[:, None]) & ((slot < sk) | (j >= 0)) & (slot < s[:, None])
        idx = jnp.broadcast_to(jnp.where(ok, idx, -1)[:, None], (b, h, slots)).astype(jnp.int32)
        state = store_prompt(state, k, v, idx, jnp.broadcast_to(ok[:, None], (b, h, slots)), limit=s)
        return state

    def decode(self, state: SlotCache, layer: int, q, k, v, pos):
        part, state, _ = self.decode_partial(state, layer, q, k, v, pos)
        return attention.normalise(part), state

    def decode_partial(self, state: SlotCache, layer: int, q, k, v, pos):
        """``decode`` returning the attention partials ``(o, m, l)`` and the pair the new token overwrote
        ``(k [B,Hkv,D], v [B,Hkv,D], evicted [B,Hkv] bool)`` (evicted before this step's attention), for LESS."""
        b, h = k.shape[:2]
        s = state.limit
        sk = self.sinks_for(s)
        slot = jnp.where(pos < sk, pos, sk + jnp.mod(pos - sk, jnp.maximum(s - sk, 1)))
        slot = jnp.broadcast_to(slot[:, None], (b, h)).astype(jnp.int32)
        ek = jnp.take_along_axis(state.k, slot[..., None, None], axis=2)[:, :, 0]
        ev = jnp.take_along_axis(state.v, slot[..., None, None], axis=2)[:, :, 0]
        gone = jnp.take_along_axis(state.pos, slot[..., None], axis=2)[..., 0] >= 0
        state = write_token(state, slot, k, v, pos)
        part = attention.attend(q, state.k, state.v, state.valid, lengths=state.length)
        return part, state, (ek, ev, gone)

    def min_budget(self) -> tuple[int, str]:
        return max(MIN_TOKENS, self.sinks + 1), f"sinks={self.sinks} + at least one recent token"

    def held(self, n: int, steps: int, ctx: LayerContext = LayerContext()) -> int:
        return min(n + steps, evicting_budget(self.budget, n, n + steps))
