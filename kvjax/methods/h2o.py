"""``h2o`` (Zhang et al., 2023, Heavy-Hitter Oracle §3-4): accumulated attention picks heavy hitters.

Each sequence holds at most ``P = budget_tokens(budget, n)`` tokens per KV head (a fraction: ``ceil(b n)`` of
its own prompt; a token count ``c``: ``c``, which generated tokens fill up): the ``recent`` most recent ones
(``floor(recent P)`` for a fraction, else ``min(recent, P - 1)``) and the heavy hitters with the largest
accumulated attention (softmax weights summed over every query so far; GQA: mean over the group's query heads).
At prefill the scores are the column sums of the causal attention of all prompt queries
(``select.accumulated_scores``: one ``q·k`` per causal score, memory linear in the prompt); H2O declares
``attends_prompt``, so the engine's prefill takes the prompt's attention from the same pass
(``select.accumulated_attention`` via ``prefill_attend``) instead of attending twice (on the CPU in row blocks and
cache-sized key tiles; on a GPU/TPU as ``kernels_pallas.accumulated_attention``: a few large tiles, or its Pallas
kernels where verified; docs/kernels.md#accumulated_attention). During decode the
new token is attended with the rest, its weights added to the scores, and then, when the sequence holds more than
``P`` tokens, the non-recent token with the lowest accumulated score is evicted (H2O's greedy ``real_drop`` step).
One spare slot makes this exact at a fixed shape; a sequence's live slots are ``[0, P + 1)`` and decode reads only
those.

The step (``decode_partial``) reads K and V once: one loop over the live slots in cache-sized chunks
(:func:`kvjax.model.attention.attend_with_scores`) gives the attention partials, every slot's score ``q·k`` (kept in a
``[B, Hkv, G, S]`` float32 scratch), the held count and the first empty slot; the new token is attended as its
own partial. Two loops over the small per-slot arrays follow (:func:`_accumulate`): ``score += mean_g exp(s - m) /
l`` in place, then the victim search (lowest score outside the recent window, first slot on ties). One scatter per
buffer writes the new token and empties the victim's slot. Nothing spans the ``S`` slots but in-place updates and
the scratch's initialisation; per live slot and KV head the step reads ``2 D`` K/V elements plus about ``12 G + 24``
bytes (``bytes_read_per_step``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.model import attention
from kvjax.budget import as_fraction, floor_mul
from kvjax.methods.base import (
    AttendsPrompt,
    DecodePartial,
    MIN_TOKENS,
    Capacity,
    LayerContext,
    SlotCache,
    SlotMethod,
    budget_tokens,
    check_budget,
    empty_slots,
    evicting_budget,
    rows_at,
    slot_bytes_read,
    store_prompt,
)
from kvjax.methods.core.select import accumulated_attention, accumulated_scores, topk_with_window


@dataclasses.dataclass(frozen=True, eq=False)
class H2O(SlotMethod, AttendsPrompt, DecodePartial):
    name: ClassVar[str] = "h2o"
    why_no_decode_budget: ClassVar[str] = (  # base.Method.why_no_decode_budget
        "h2o already bounds decode: it evicts to its budget at every step (a token budget covers generated tokens)."
    )
    step_kernels: ClassVar[tuple[str, ...]] = ()  # base.Method.step_kernels
    traced_layer: ClassVar[bool] = True  # scan over layers (base.Method.traced_layer)
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

    def recent_tokens(self, budget):
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
        return self._keep(state, k, v, lengths, accumulated_scores(q, k, lengths))

    def prefill_attend(self, state: SlotCache, layer: int, q, k, v, lengths, previous=None):
        """The prompt's causal attention and the prefill from the same probabilities
        (``select.accumulated_attention``: one ``q·k`` and one ``P·v`` per causal score, where attention then
        :meth:`prefill` compute ``q·k`` twice)."""
        out, score = accumulated_attention(q, k, v, lengths)
        return out, self._keep(state, k, v, lengths, score)

    def _keep(self, state: SlotCache, k, v, lengths, score) -> SlotCache:
        """The prompt's heavy hitters by accumulated ``score [B, Hkv, T]`` plus the recent window, stored."""
        p = state.prompt_slots
        limit = evicting_budget(self.budget, lengths, p)
        kept = jnp.minimum(limit, lengths)
        idx, ok = _heavy_plus_recent(score, lengths, kept, self.recent_tokens(limit), min(p, k.shape[2]))
        return store_prompt(state, k, v, idx, ok, score=score, limit=limit)

    def decode(self, state: SlotCache, layer: int, q, k, v, pos):
        part, state, _ = self.decode_partial(state, layer, q, k, v, pos)
        return attention.normalise(part), state

    def decode_partial(self, state: SlotCache, layer: int, q, k, v, pos, *, chunk: int | None = None):
        """``decode`` returning the attention partials ``(o, m, l)`` and the pair evicted this step
        ``(k [B,Hkv,D], v [B,Hkv,D], evicted [B,Hkv] bool)`` (attended this step, evicted after it), for LESS.

        Two loops over live slots ``[0, length)`` (``chunk`` slots per step, :func:`kvjax.model.attention.live_chunk`):
        :func:`kvjax.model.attention.attend_with_scores` reads K, V and ``pos`` once (partials, each slot's score, the
        held count and the first empty slot); :func:`_accumulate` reads the scores, ``score`` and ``pos`` once, adds
        the weights into ``score`` in place and finds the victim. The new token is attended as its own partial
        (merged exactly) and written after."""
        b, h = k.shape[:2]
        g = q.shape[1] // h
        k, v = k.astype(state.k.dtype), v.astype(state.v.dtype)  # as stored
        mine = attention.token_partial(q, k, v)  # the new token's own partial, merged below
        s_new = mine[1].reshape(b, h, g)  # [B, Hkv, G]: its scaled scores
        part, sc, held, slot = attention.attend_with_scores(
            q, state.k, state.v, state.pos, state.length, start=mine, chunk=chunk
        )
        o, m, l = part
        mg, lg = m.reshape(b, h, g), l.reshape(b, h, g)
        # Tokens outside the recent window (pos - recent, pos] are candidates for eviction.
        threshold = pos - self.recent_tokens(state.limit) + 1  # [B]
        score, best, victim = _accumulate(state.score, state.pos, sc, mg, lg, state.length, threshold, chunk)
        w_new = (jnp.exp(s_new - mg) / jnp.where(lg > 0, lg, 1.0)).mean(axis=-1)  # [B, Hkv]
        new_cand = (pos < threshold)[:, None]  # the new token itself (recent window of 0)
        take_new = new_cand & ((w_new < best) | ((w_new == best) & (slot < victim)))
        victim = jnp.where(take_new, slot, victim)
        over = (held + 1 > state.limit[:, None]) & (jnp.isfinite(best) | new_cand)
        # One scatter per buffer, after the victim search (so XLA updates pos and score in place): the new token
        # into its slot, the victim's slot emptied; a new token evicted at once (no recent window) leaves its slot
        # empty.
        self_gone = over & (victim == slot)
        idx = jnp.stack([slot, jnp.where(over & ~self_gone, victim, state.pos.shape[2])], axis=-1)  # [B, Hkv, 2]
        new_pos = jnp.where(self_gone, -1, jnp.broadcast_to(pos[:, None], (b, h)))
        state = state.replace(
            k=rows_at(state.k, slot, k),
            v=rows_at(state.v, slot, v),
            pos=rows_at(state.pos, idx, jnp.stack([new_pos, jnp.full_like(new_pos, -1)], axis=-1)),
            score=rows_at(score, idx, jnp.stack([jnp.where(self_gone, 0.0, w_new), jnp.zeros_like(w_new)], axis=-1)),
            length=jnp.maximum(state.length, jnp.max(slot, axis=1) + 1).astype(jnp.int32),
        )
        ek = jnp.take_along_axis(state.k, victim[..., None, None], axis=2)[:, :, 0]
        ev = jnp.take_along_axis(state.v, victim[..., None, None], axis=2)[:, :, 0]
        return part, state, (ek, ev, over)

    def held_overhead_bytes(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> int:
        """The slot cache's (base) plus a float32 accumulated score per slot (the budget's and one new token's)."""
        slots = budget_tokens(self.budget, capacity.prompt_len + capacity.max_new_tokens) + 1
        return (
            super().held_overhead_bytes(model_cfg, batch, capacity, layer, dtype)
            + 4 * batch * model_cfg.num_kv_heads * slots
        )

    def bytes_read_per_step(self, state: SlotCache, num_heads: int) -> int:
        """Per live slot and KV head: its K and V and ``pos`` (the attention pass); the step's float32 scores of
        the ``G`` query heads, initialised, written and read back (``12 G``); ``score`` read and written, then
        read again with ``pos`` by the victim search (``8 + 4 + 4 + 4``)."""
        g = num_heads // state.k.shape[1]
        return slot_bytes_read(state, num_heads, extra_per_slot=12 * g + 20)

    def min_budget(self) -> tuple[int, str]:
        if isinstance(self.recent, int):
            return max(MIN_TOKENS, self.recent + 1), f"recent={self.recent} + at least one heavy hitter"
        return super().min_budget()

    def held(self, n: int, steps: int, ctx: LayerContext = LayerContext()) -> int:
        return min(n + steps, evicting_budget(self.budget, n, n + steps))


def _accumulate(score, pos, sc, m, l, lengths, threshold, chunk=None):
    """H2O's score update and victim search: two loops over the live slots ``[0, max lengths)``.

    score ``[B, Hkv, S]`` float32, updated in place: ``+= mean_g exp(sc - m) / l`` on every held slot below the
    length; pos ``[B, Hkv, S]`` int32 (held: ``>= 0``); sc ``[B, Hkv, G, S]`` the step's scaled scores; m, l
    ``[B, Hkv, G]`` the step's softmax max and sum; threshold ``[B]``: a held slot with ``pos < threshold`` may be
    evicted. Returns ``(score, best [B, Hkv], victim [B, Hkv])``: the lowest updated score of an evictable slot
    (``inf``: none) and its slot (the first one on ties, as ``argmin``; 0 when none). The search is its own
    read-only loop: fused with the update, XLA re-reads the chunk the in-place write overwrites and copies the
    whole score buffer every iteration."""
    b, h, s = score.shape
    c = attention.live_chunk(s, b, h, sc.shape[2] + 2, 4, chunk and 4 * chunk)
    den = jnp.where(l > 0, l, 1.0)
    trips = attention.live_trips(lengths, c)

    def held(i):
        start, rows, fresh = attention.live_rows(i, c, s, lengths)
        p = jax.lax.dynamic_slice_in_dim(pos, start, c, axis=2)
        return start, fresh[:, None, :] & (p >= 0), p  # [B, Hkv, C]

    def update(i, score):
        start, take, _ = held(i)
        w = (jnp.exp(jax.lax.dynamic_slice_in_dim(sc, start, c, axis=3) - m[..., None]) / den[..., None]).mean(axis=2)
        new = jax.lax.dynamic_slice_in_dim(score, start, c, axis=2) + jnp.where(take, w, 0.0)
        return jax.lax.dynamic_update_slice_in_dim(score, new, start, axis=2)

    def search(i, carry):
        best, victim = carry
        start, take, p = held(i)
        val = jnp.where(
            take & (p < threshold[:, None, None]), jax.lax.dynamic_slice_in_dim(score, start, c, axis=2), jnp.inf
        )
        low, j = jnp.min(val, axis=-1), jnp.argmin(val, axis=-1)
        better = low < best  # strict: an earlier chunk wins ties (argmin's first occurrence)
        return jnp.where(better, low, best), jnp.where(better, start + j, victim).astype(jnp.int32)

    score = attention.chunk_loop(trips, c, s, update, score)
    init = (jnp.full((b, h), jnp.inf, jnp.float32), jnp.zeros((b, h), jnp.int32))
    best, victim = attention.chunk_loop(trips, c, s, search, init)
    return score, best, victim


def _heavy_plus_recent(score, lengths, budgets, recent, slots):
    """Top ``budget - recent`` tokens before the last ``recent`` ones, plus those ``recent`` tokens."""
    # Emulate a per-sequence window by scoring the recent tokens +inf and asking for a window of 0.
    t = score.shape[-1]
    pos = jnp.arange(t)
    in_recent = (pos[None, :] >= (lengths - recent)[:, None]) & (pos[None, :] < lengths[:, None])
    boosted = jnp.where(in_recent[:, None, :], jnp.inf, score)
    return topk_with_window(boosted, lengths, budgets, 0, slots)
