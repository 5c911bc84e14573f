"""``snapkv`` (Li et al., 2024) and ``pyramidkv`` (Cai et al., 2024): one-shot prompt compression.

SnapKV (§4.2, Alg. 1): the last ``window`` prompt queries vote (softmax attention in float32, summed over
the window, mean over each KV group's query heads); votes are pooled with a 1-D kernel (``pool``:
``"avg"`` or ``"max"``; ``kernel=1`` disables it); each KV head keeps its top ``budget - window`` prefix
tokens plus the window. PyramidKV uses the same scores with per-layer budgets that fall linearly from the
lower to the upper layers (the harness schedule with ``beta``, ``../shared/specs/chunkkv.md`` section 4); a
sequence within its total budget is kept whole (the harness's first branch; its middle branch, plain SnapKV
for ``len < 2 (L - w)``, is not reproduced).
Decode tokens are appended after the compressed prompt, never evicted.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.methods.base import (Capacity, SlotCache, append_decode, check_budget, dynamic_budget, empty_slots,
                                static_budget, store_prompt, tree_bytes)
from kvjax.methods.select import pool1d, topk_with_window, window_scores


@dataclasses.dataclass(frozen=True)
class SnapKV:
    name: ClassVar[str] = "snapkv"
    budget: float | int = 0.2
    window: int = 8
    kernel: int = 5
    pool: str = "avg"

    def __post_init__(self):
        check_budget(self.budget)
        if self.window < 1:
            raise ValueError(f"window={self.window} must be >= 1")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel={self.kernel} must be an odd number >= 1 (1 disables pooling)")
        if self.pool not in ("avg", "max"):
            raise ValueError(f"pool={self.pool!r} must be 'avg' or 'max'")

    def _check(self, slots: int, prompt_len: int) -> int:
        if slots <= self.window and slots < prompt_len:
            raise ValueError(f"budget={self.budget} gives {slots} tokens at prompt length {prompt_len}, not more "
                             f"than window={self.window}; raise the budget or shrink the window")
        return slots

    def prompt_slots(self, prompt_len: int, layer: int, num_layers: int) -> int:
        """Static slots for the compressed prompt at this layer (window included)."""
        return self._check(static_budget(self.budget, prompt_len), prompt_len)

    def layer_budgets(self, lengths, layer: int, num_layers: int):
        """Per-sequence token budgets ``[B]`` at this layer (window included)."""
        return dynamic_budget(self.budget, lengths)

    def init(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> SlotCache:
        p = self.prompt_slots(capacity.prompt_len, layer, model_cfg.num_layers)
        return empty_slots(model_cfg, batch, p + capacity.max_new_tokens, dtype, prompt_slots=p)

    def token_scores(self, q, k, lengths):
        """Pooled observation-window votes ``[B, Hkv, T]``."""
        s = window_scores(q, k, lengths, self.window)
        # Only prefix votes are pooled: window positions are always kept and must not leak into the prefix.
        t = s.shape[-1]
        s = jnp.where(jnp.arange(t) < (lengths - self.window)[:, None, None], s, 0.0)
        return pool1d(s, self.kernel, self.pool)

    def prefill(self, state: SlotCache, layer: int, q, k, v, lengths) -> SlotCache:
        budgets = jnp.minimum(self.layer_budgets(lengths, layer, state.num_layers), state.prompt_slots)
        idx, ok = topk_with_window(self.token_scores(q, k, lengths), lengths, budgets, self.window,
                                   state.prompt_slots)
        return store_prompt(state, k, v, idx, ok)

    def decode(self, state: SlotCache, layer: int, q, k, v, pos):
        return append_decode(state, q, k, v, pos)

    def memory_bytes(self, state: SlotCache) -> int:
        return tree_bytes(state)


def pyramid_budget(budget, prompt_len, layer: int, num_layers: int, window: int, beta: int):
    """PyramidKV's per-layer budget (window included) for total budget ``budget`` (tokens incl. window).

    Integer schedule of the harness: ``min = (L - w) // beta``, ``max = 2 (L - w) - min``; when ``max`` exceeds
    the prefix ``T - w``, ``max = T - w`` and ``min = 2 (L - w) - max``; ``step = (max - min) // (N - 1)``;
    layer ``l`` keeps ``max - l * step`` prefix tokens plus the window. Works on ints and on arrays.
    """
    base = budget - window
    lo = base // beta
    hi = 2 * base - lo
    over = hi >= prompt_len - window
    hi2 = jnp.where(over, prompt_len - window, hi) if hasattr(over, "shape") else (prompt_len - window if over else hi)
    lo2 = 2 * base - hi2
    step = (hi2 - lo2) // max(num_layers - 1, 1)
    return hi2 - layer * step + window


@dataclasses.dataclass(frozen=True)
class PyramidKV(SnapKV):
    name: ClassVar[str] = "pyramidkv"
    beta: int = 20

    def __post_init__(self):
        super().__post_init__()
        if self.beta < 1:
            raise ValueError(f"beta={self.beta} must be >= 1")

    def prompt_slots(self, prompt_len: int, layer: int, num_layers: int) -> int:
        """Static slots at this layer. With a token budget ``L``, a prompt of the bucket shorter than ``L`` is
        kept whole at every layer, so each layer reserves at least ``min(L, bucket)`` slots; fractional
        budgets give the pyramid-shaped allocation."""
        total = static_budget(self.budget, prompt_len)
        self._check(total, prompt_len)
        if total >= prompt_len:
            return prompt_len
        slots = min(prompt_len, max(self.window + 1,
                                    int(pyramid_budget(total, prompt_len, layer, num_layers, self.window, self.beta))))
        return slots if isinstance(self.budget, float) else max(slots, total)

    def layer_budgets(self, lengths, layer: int, num_layers: int):
        total = dynamic_budget(self.budget, lengths)
        per_layer = pyramid_budget(total, lengths, layer, num_layers, self.window, self.beta)
        return jnp.where(total >= lengths, lengths, jnp.maximum(per_layer, self.window + 1))
