"""``h2o`` (Zhang et al., 2023, Heavy-Hitter Oracle §3-4): accumulated attention picks heavy hitters.

Each sequence holds at most ``P = budget_tokens(budget, n)`` tokens per KV head (a fraction: ``ceil(b n)`` of
its own prompt; a token count ``c``: ``c``, which generated tokens fill up): the ``recent`` most recent ones
(``floor(recent P)`` for a fraction, else ``min(recent, P - 1)``) and the heavy hitters with the largest
accumulated attention (softmax weights summed over every query so far; GQA: mean over the group's query heads).
At prefill the scores are the column sums of the causal attention of all prompt queries (computed in
``512 x 512`` tiles of queries and keys, memory linear in the prompt: ``select.accumulated_scores``). During decode the new
token is stored, attended over with the rest in one pass over K (its weights are added to the scores), and
then, when the sequence holds more than ``P`` tokens, the non-recent token with the lowest accumulated score is
evicted (H2O's greedy ``real_drop`` step). One spare slot makes this exact at a fixed shape; a sequence's live
slots are ``[0, P + 1)`` and decode reads only those.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax import attention
from kvjax.budget import as_fraction, floor_mul
from kvjax.methods.base import (Capacity, Method, SlotCache, check_budget, empty_slots, evicting_budget,
                                rows_at, slot_bytes_read, slot_tokens_held, store_prompt, write_token)
from kvjax.methods.select import accumulated_scores, topk_with_window


@dataclasses.dataclass(frozen=True)
class H2O(Method):
    name: ClassVar[str] = "h2o"
    traced_layer: ClassVar[bool] = True  # scan over layers (base.Method.traced_layer)
    has_decode_partial: ClassVar[bool] = True
    budget: float | int = 0.2
    recent: float | int = 0.5  # fraction of the budget, or a token count

    def __post_init__(self):
        check_budget(self.budget)
        if isinstance(self.recent, bool) or not isinstance(self.recent, (int, float)):
            raise ValueError(f"recent={self.recent!r} must be a fraction of the budget in [0, 1) or a token count")
        if isinstance(self.recent, float) and not 0.0 <= self.recent < 1.0:
            raise ValueError(f"recent={self.recent} as a fraction of the budget must be in [0, 1), e.g. 0.5")
        if isinstance(self.recent, int) and self.recent < 0:
            raise ValueError(f"recent={self.recent} tokens must be >= 0")

    def _recent(self, budget):
        """Recent-window size for a budget of ``budget`` tokens (int or array): exact ``floor(recent P)``, or
        ``min(recent, P - 1)`` (at least one heavy-hitter slot)."""
        if isinstance(self.recent, float):
            p, q = as_fraction(self.recent)
            return floor_mul(budget, p, q)
        if hasattr(budget, "shape"):
            return jnp.maximum(jnp.minimum(self.recent, budget - 1), 0)
        return max(min(self.recent, budget - 1), 0)

    def init(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> SlotCache:
        p = evicting_budget(self.budget, capacity.prompt_len, capacity.prompt_len + capacity.max_new_tokens)
        return empty_slots(model_cfg, batch, p + 1, dtype, prompt_slots=p, with_score=True)

    def prefill(self, state: SlotCache, layer: int, q, k, v, lengths, previous=None) -> SlotCache:
        p = state.prompt_slots
        limit = evicting_budget(self.budget, lengths, p)
        kept = jnp.minimum(limit, lengths)
        score = accumulated_scores(q, k, lengths)
        idx, ok = _heavy_plus_recent(score, lengths, kept, self._recent(limit), min(p, k.shape[2]))
        return store_prompt(state, k, v, idx, ok, score=score, limit=limit)

    def decode(self, state: SlotCache, layer: int, q, k, v, pos):
        part, state, _ = self.decode_partial(state, layer, q, k, v, pos)
        return attention.normalise(part), state

    def decode_partial(self, state: SlotCache, layer: int, q, k, v, pos):
        """``decode`` returning the attention partials ``(o, m, l)`` and the pair evicted this step
        ``(k [B,Hkv,D], v [B,Hkv,D], evicted [B,Hkv] bool)`` (attended this step, evicted after it), for LESS."""
        b, h = k.shape[:2]
        # The spare slot: an empty one always exists in [0, limit] before the write (<= limit tokens held).
        slot = jnp.argmax(state.pos < 0, axis=-1).astype(jnp.int32)  # [B, Hkv]
        state = write_token(state, slot, k, v, pos)
        state = state.replace(score=rows_at(state.score, slot, 0.0))
        valid = state.pos >= 0
        part, probs = attention.attend_with_weights(q, state.k, state.v, valid, state.length)
        score = state.score + probs.mean(axis=2)  # [B, Hkv, S]
        # Evict when over budget: lowest score among tokens outside the recent window.
        recent = self._recent(state.limit)
        cand = valid & (state.pos < (pos - recent + 1)[:, None, None])
        victim = jnp.argmin(jnp.where(cand, score, jnp.inf), axis=-1)  # [B, Hkv]
        over = (valid.sum(-1) > state.limit[:, None]) & cand.any(-1)
        vpos = jnp.where(over, -1, jnp.take_along_axis(state.pos, victim[..., None], -1)[..., 0])
        vscore = jnp.where(over, 0.0, jnp.take_along_axis(score, victim[..., None], -1)[..., 0])
        state = state.replace(pos=rows_at(state.pos, victim, vpos), score=rows_at(score, victim, vscore))
        ek = jnp.take_along_axis(state.k, victim[..., None, None], axis=2)[:, :, 0]
        ev = jnp.take_along_axis(state.v, victim[..., None, None], axis=2)[:, :, 0]
        return part, state, (ek, ev, over)

    def bytes_read_per_step(self, state: SlotCache, num_heads: int) -> int:
        """K/V and mask of the live slots (one pass: the weights come from the same scores), plus the float32
        accumulated scores of those slots, read and written."""
        return slot_bytes_read(state, num_heads, extra_per_slot=8)

    def tokens_held(self, state: SlotCache):
        return slot_tokens_held(state)

    def held(self, n: int, steps: int) -> int:
        return min(n + steps, evicting_budget(self.budget, n, n + steps))


def _heavy_plus_recent(score, lengths, budgets, recent, slots):
    """Top ``budget - recent`` tokens before the last ``recent`` ones, plus those ``recent`` tokens."""
    # Emulate a per-sequence window by scoring the recent tokens +inf and asking for a window of 0.
    t = score.shape[-1]
    pos = jnp.arange(t)
    in_recent = (pos[None, :] >= (lengths - recent)[:, None]) & (pos[None, :] < lengths[:, None])
    boosted = jnp.where(in_recent[:, None, :], jnp.inf, score)
    return topk_with_window(boosted, lengths, budgets, 0, slots)
