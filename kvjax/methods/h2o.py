"""``h2o`` (Zhang et al., 2023, Heavy-Hitter Oracle §3-4): accumulated attention picks heavy hitters.

Each KV head keeps ``budget`` tokens: the ``recent`` most recent ones and the heavy hitters with the largest
accumulated attention (softmax weights summed over every query so far; GQA: mean over the group's query
heads). At prefill the scores are the column sums of the causal attention of all prompt queries. During
decode the new token is stored, attended over with the rest (its weights are added to the scores), and then,
when the head holds more than ``budget`` tokens, the non-recent token with the lowest accumulated score is
evicted (H2O's greedy ``real_drop`` step). One spare slot makes this exact at a fixed shape.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax import attention
from kvjax.methods.base import (Capacity, SlotCache, check_budget, dynamic_budget, empty_slots, static_budget,
                                store_prompt, tree_bytes, write_token)
from kvjax.methods.select import accumulated_scores, topk_with_window


@dataclasses.dataclass(frozen=True)
class H2O:
    name: ClassVar[str] = "h2o"
    budget: float | int = 0.2
    recent: float | int = 0.5  # fraction of the budget, or a token count

    def __post_init__(self):
        check_budget(self.budget)
        if isinstance(self.recent, float) and not 0.0 <= self.recent < 1.0:
            raise ValueError(f"recent={self.recent} as a fraction of the budget must be in [0, 1)")
        if isinstance(self.recent, int) and self.recent < 0:
            raise ValueError(f"recent={self.recent} tokens must be >= 0")

    def _recent(self, budget):
        if isinstance(self.recent, float):
            return (budget * self.recent).astype(jnp.int32) if hasattr(budget, "shape") else int(budget * self.recent)
        return jnp.minimum(self.recent, budget - 1) if hasattr(budget, "shape") else min(self.recent, budget - 1)

    def init(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> SlotCache:
        # A token budget may cover generated tokens too (no eviction until it is reached).
        p = (static_budget(self.budget, capacity.prompt_len) if isinstance(self.budget, float)
             else min(self.budget, capacity.prompt_len + capacity.max_new_tokens))
        if isinstance(self.recent, int) and self.recent >= p and p < capacity.prompt_len:
            raise ValueError(f"recent={self.recent} leaves no heavy hitters within budget={self.budget} ({p} "
                             "tokens); lower recent or raise the budget")
        return empty_slots(model_cfg, batch, p + 1, dtype, prompt_slots=p, with_score=True)

    def prefill(self, state: SlotCache, layer: int, q, k, v, lengths) -> SlotCache:
        p = state.prompt_slots
        budgets = jnp.minimum(dynamic_budget(self.budget, lengths), p)
        score = accumulated_scores(q, k, lengths)
        # The recent window is a per-sequence count here, so select heavy hitters and the window in two parts:
        # heavy = top (budget - recent) of positions before the window.
        recent = self._recent(budgets)
        idx, ok = _heavy_plus_recent(score, lengths, budgets, recent, min(p, k.shape[2]))
        return store_prompt(state, k, v, idx, ok, score=score)

    def decode(self, state: SlotCache, layer: int, q, k, v, pos):
        part, state, _ = self.decode_partial(state, layer, q, k, v, pos)
        return attention.normalise(part), state

    def decode_partial(self, state: SlotCache, layer: int, q, k, v, pos):
        """``decode`` returning the attention partials ``(o, m, l)`` and the pair evicted this step
        ``(k [B,Hkv,D], v [B,Hkv,D], evicted [B,Hkv] bool)`` (attended this step, evicted after it), for LESS."""
        b, h = k.shape[:2]
        # The spare slot: an empty one always exists before the write (the cache holds <= budget tokens).
        slot = jnp.argmax(state.pos < 0, axis=-1).astype(jnp.int32)  # [B, Hkv]
        state = write_token(state, slot, k, v, pos)
        bi, hi = jnp.arange(b)[:, None], jnp.arange(h)[None, :]
        state = state.replace(score=state.score.at[bi, hi, slot].set(0.0))
        valid = state.pos >= 0
        part = attention.attend(q, state.k, state.v, valid)
        probs = attention.probabilities(q, state.k, valid).mean(axis=2)  # [B, Hkv, S]
        score = state.score + probs
        # Evict when over budget: lowest score among tokens outside the recent window.
        budgets = jnp.minimum(dynamic_budget(self.budget, _prompt_len_proxy(pos, state)), state.prompt_slots)
        recent = self._recent(budgets)
        cand = valid & (state.pos < (pos - recent + 1)[:, None, None])
        victim = jnp.argmin(jnp.where(cand, score, jnp.inf), axis=-1)  # [B, Hkv]
        over = (valid.sum(-1) > budgets[:, None]) & cand.any(-1)
        vpos = jnp.where(over, -1, jnp.take_along_axis(state.pos, victim[..., None], -1)[..., 0])
        vscore = jnp.where(over, 0.0, jnp.take_along_axis(score, victim[..., None], -1)[..., 0])
        state = state.replace(pos=state.pos.at[bi, hi, victim].set(vpos),
                              score=score.at[bi, hi, victim].set(vscore), cursor=state.cursor + 1)
        ek = jnp.take_along_axis(state.k, victim[..., None, None], axis=2)[:, :, 0]
        ev = jnp.take_along_axis(state.v, victim[..., None, None], axis=2)[:, :, 0]
        return part, state, (ek, ev, over)

    def memory_bytes(self, state: SlotCache) -> int:
        return tree_bytes(state)


def _prompt_len_proxy(pos, state: SlotCache):
    """The prompt length of each sequence: current position minus decode steps already taken."""
    steps = state.cursor - state.prompt_slots
    return pos - steps


def _heavy_plus_recent(score, lengths, budgets, recent, slots):
    """Top ``budget - recent`` tokens before the last ``recent`` ones, plus those ``recent`` tokens."""
    # topk_with_window keeps a fixed-size window; emulate a per-sequence window by scoring the recent
    # tokens +inf and asking for a window of 0.
    t = score.shape[-1]
    pos = jnp.arange(t)
    in_recent = (pos[None, :] >= (lengths - recent)[:, None]) & (pos[None, :] < lengths[:, None])
    boosted = jnp.where(in_recent[:, None, :], jnp.inf, score)
    return topk_with_window(boosted, lengths, budgets, 0, slots)
