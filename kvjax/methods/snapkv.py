"""``snapkv`` (Li et al., 2024) and ``pyramidkv`` (Cai et al., 2024): one-shot prompt compression.

SnapKV (§4.2, Alg. 1): a scorer (default ``scorer="snapkv"``: the last ``window`` prompt queries vote, softmax in
float32 summed over the window, mean over each KV group's query heads, pooled with a 1-D kernel: ``pool`` ``"avg"``
or ``"max"``, ``kernel=1`` disables it; or ``scorer="h2o"``, see :mod:`kvjax.methods.core.scorers`) ranks the prompt;
each KV head keeps its top ``P - w`` prefix tokens plus the last ``w`` tokens, with ``P = budget_tokens(budget,
n)`` of each sequence's own prompt ``n`` and ``w = min(window, P)`` (a budget below the window keeps the most
recent ``P`` tokens). A sequence with ``n <= P`` is kept whole.

PyramidKV: the same scores with per-layer budgets from each sequence's own ``n``, the KVCache-Factory harness's
integer schedule (``pyramidkv_utils.py``, ``update_kv``) for total ``P`` and window ``w``: ``n < P``: keep every
token; ``n < 2 (P - w)``: SnapKV with ``P`` at every layer; else ``min = (P - w) // beta``, ``max = 2 (P - w) -
min`` (if ``max >= n - w``: ``max = n - w``, ``min = 2 (P - w) - max``), ``step = (max - min) // (L - 1)``, layer
``l`` keeps ``max - l step`` prefix tokens plus the window. Because of the integer ``step`` the layers' mean can
exceed ``P`` by up to ``(L - 1) / 2`` tokens (the harness's rounding, kept for parity).
Decode tokens are appended after the compressed prompt, never evicted.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.checks import check_int
from kvjax.methods.base import (
    Recompressible,
    Capacity,
    LayerContext,
    MIN_TOKENS,
    SlotCache,
    SlotMethod,
    budget_tokens,
    check_budget,
    empty_slots,
    slot_bytes,
    store_prompt,
)
from kvjax.methods.core.scorers import Scorer, check_scorer, make_scorer
from kvjax.methods.core.select import kept_window, topk_with_window


@dataclasses.dataclass(frozen=True, eq=False)
class SnapKV(SlotMethod, Recompressible):
    name: ClassVar[str] = "snapkv"
    traced_layer: ClassVar[bool] = True  # scan over layers (base.Method.traced_layer)
    budget: float | int = 0.2
    window: int = 8
    kernel: int = 5
    pool: str = "avg"
    scorer: str | Scorer = "snapkv"

    def __post_init__(self):
        check_budget(self.budget)
        check_int("window", self.window, "SnapKV's observation window, e.g. 8")
        check_scorer(self.scorer)
        self.score_fn  # validates kernel / pool

    @property
    def score_fn(self) -> Scorer:
        return make_scorer(self.scorer, self.window, self.kernel, self.pool)

    def layer_budgets(self, lengths, layer: int, num_layers: int):
        """Per-sequence token budgets ``[B]`` (or an int for an int ``lengths``) at this layer, window included."""
        return budget_tokens(self.budget, lengths)

    def prompt_slots(self, prompt_len: int, layer: int, num_layers: int) -> int:
        """Static slots for the compressed prompt at this layer: the largest budget of any ``n <= bucket``."""
        return self.layer_budgets(prompt_len, layer, num_layers)

    def init(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> SlotCache:
        p = self.prompt_slots(capacity.prompt_len, layer, model_cfg.num_layers)
        return empty_slots(model_cfg, batch, p + capacity.max_new_tokens, dtype, prompt_slots=p)

    def prefill(self, state: SlotCache, layer: int, q, k, v, lengths, previous=None) -> SlotCache:
        total = budget_tokens(self.budget, lengths)
        budgets = jnp.minimum(self.layer_budgets(lengths, layer, state.num_layers), state.prompt_slots)
        windows = kept_window(total, self.window)
        scores = self.score_fn(q, k, lengths, lengths - windows)
        idx, ok = topk_with_window(scores, lengths, budgets, self.window, state.prompt_slots, windows)
        return store_prompt(state, k, v, idx, ok)

    def rescorer(self) -> Scorer:
        return self.score_fn

    def observation_window(self) -> int:
        return self.window

    def reselect(self, votes, lengths, budgets, slots: int):
        """Top ``budget - w`` slots before the last ``w`` held ones (scores pooled as at prefill) plus those ``w``
        (base.Method.reselect)."""
        windows = kept_window(budgets, self.window)
        scores = self.score_fn.finish(votes, lengths - windows)
        return topk_with_window(scores, lengths, budgets, self.window, slots, windows)

    def min_budget(self) -> tuple[int, str]:
        """The window plus one selected token (PyramidKV: the same total, which its layers share unevenly)."""
        return (
            max(MIN_TOKENS, self.window + 1),
            f"window={self.window} observation tokens + at least one selected token",
        )

    def held(self, n: int, steps: int, ctx: LayerContext = LayerContext()) -> int:
        return min(n, int(self.layer_budgets(n, ctx.layer, ctx.num_layers))) + steps


def pyramid_budget(total, n, layer: int, num_layers: int, window, beta: int):
    """PyramidKV's per-layer budget (window included) for a total of ``total`` tokens (window included) and a
    prompt of ``n`` tokens: the harness's three branches (module docstring). ``total``, ``n``, ``window``: ints or
    int arrays of one shape."""
    xp = jnp if any(isinstance(x, jax.Array) for x in (total, n, window)) else np
    base = total - window
    lo = base // beta
    hi = 2 * base - lo
    over = hi >= n - window
    hi2 = xp.where(over, n - window, hi)
    lo2 = 2 * base - hi2
    step = (hi2 - lo2) // max(num_layers - 1, 1)
    pyramid = hi2 - layer * step + window
    out = xp.where(n < total, n, xp.where(n < 2 * base, total, pyramid))
    if xp is jnp:
        return out.astype(jnp.int32)
    return int(out) if np.ndim(out) == 0 else out


@functools.lru_cache(maxsize=256, typed=True)  # typed: budget 1 (a token) and 1.0 (the prompt) are two keys
def _pyramid_slots(budget, window: int, beta: int, bucket: int, layer: int, num_layers: int) -> int:
    """Largest per-layer budget of any prompt length ``1..bucket`` (the static slot count)."""
    n = np.arange(1, bucket + 1, dtype=np.int64)
    total = budget_tokens(budget, n)
    w = np.minimum(window, total)
    return int(np.max(pyramid_budget(total, n, layer, num_layers, w, beta)))


@dataclasses.dataclass(frozen=True, eq=False)
class PyramidKV(SnapKV):
    name: ClassVar[str] = "pyramidkv"
    beta: int = 20
    #: Each layer's static slot count is rounded up to a multiple of this (None: an eighth of the budget at the
    #: bucket, at least 16), so runs of layers share one state shape and scan as one compiled body
    #: (``engine.scan_runs``: about 8-12 bodies instead of one per layer). It sizes the buffers only: what a layer
    #: keeps is its own budget. ``1``: one exact slot count per layer.
    slot_multiple: int | None = None

    def __post_init__(self):
        super().__post_init__()
        check_int("beta", self.beta, "the harness uses 20")
        check_int("slot_multiple", self.slot_multiple, "an eighth of the budget", none_ok=True)

    def _multiple(self, prompt_len: int) -> int:
        if self.slot_multiple is not None:
            return self.slot_multiple
        return max(16, -(-int(budget_tokens(self.budget, prompt_len)) // 8))

    def held_overhead_bytes(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> int:
        """The slot cache's (decode slots, one of rounding) plus the slot count's rounding to
        ``slot_multiple``."""
        extra = self._multiple(capacity.prompt_len) - 1
        return super().held_overhead_bytes(model_cfg, batch, capacity, layer, dtype) + extra * slot_bytes(
            model_cfg, batch, dtype
        )

    def layer_budgets(self, lengths, layer: int, num_layers: int):
        total = budget_tokens(self.budget, lengths)
        w = kept_window(total, self.window) if hasattr(total, "shape") else min(self.window, total)
        return pyramid_budget(total, lengths, layer, num_layers, w, self.beta)

    def decode_target(self, decode_budget: int, layer: int, num_layers: int) -> int:
        """The decode budget split over the layers by the harness schedule (:func:`pyramid_budget`) for a sequence
        far longer than the budget: layer ``l`` keeps ``max - l step`` plus the window, the layers' mean is the
        budget (up to the integer step)."""
        w = min(self.window, decode_budget)
        return int(pyramid_budget(decode_budget, 2**30, layer, num_layers, w, self.beta))

    def prompt_slots(self, prompt_len: int, layer: int, num_layers: int) -> int:
        exact = _pyramid_slots(self.budget, self.window, self.beta, prompt_len, layer, num_layers)
        r = self._multiple(prompt_len)
        return min(-(-exact // r) * r, prompt_len)  # a layer never keeps more than the bucket
