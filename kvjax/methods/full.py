"""``full``: no compression. Every prompt token and every generated token keeps its own slot.

Holds ``n + steps`` tokens after ``steps`` decode steps; a decode step reads the ``n + steps`` live slots only
(never the bucket padding after a short prompt, never the unwritten decode slots).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.methods.base import Capacity, LayerContext, SlotCache, SlotMethod, empty_slots, store_prompt


@dataclasses.dataclass(frozen=True, eq=False)
class Full(SlotMethod):
    name: ClassVar[str] = "full"
    why_no_decode_budget: ClassVar[str] = (  # base.Method.why_no_decode_budget
        "full keeps every token by definition; use snapkv with budget=1.0 and a decode_budget."
    )
    traced_layer: ClassVar[bool] = True  # scan over layers (base.Method.traced_layer)

    def init(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> SlotCache:
        slots = capacity.prompt_len + capacity.max_new_tokens
        return empty_slots(model_cfg, batch, slots, dtype, prompt_slots=capacity.prompt_len)

    def prefill(self, state: SlotCache, layer: int, q, k, v, lengths, previous=None) -> SlotCache:
        b, h, t, _ = k.shape
        idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, h, t))
        return store_prompt(state, k, v, idx, idx < lengths[:, None, None])

    def selected_positions(self, state: SlotCache, layer: int, q) -> jnp.ndarray:
        """``[B, Hq, S]`` bool: every stored position (slot = position here), broadcast to the query heads. Not
        a recall method; the recall methods call it for their full layers (``n_full``)."""
        return jnp.repeat(state.valid, q.shape[1] // state.valid.shape[1], axis=1)

    def held(self, n: int, steps: int, ctx: LayerContext = LayerContext()) -> int:
        return n + steps
