"""A method that is one ``score``: :class:`ScoringMethod` keeps each sequence's ``P = budget_tokens(budget, n)``
prompt tokens of highest score per KV head and appends every decoded token, as kvpress's ``ScorerPress`` keeps the
tokens its ``score`` ranks first. A subclass writes ``score``; the rest (``init``, ``prefill``, ``held``, the budget
option and its check, and through :class:`~kvjax.methods.base.SlotMethod` ``decode``, ``tokens_held`` and
``bytes_read_per_step``) is derived here. ``docs/examples/knorm.py`` is one (docs/interface.md, "Writing your own
method")."""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.budget import budget_tokens, check_budget
from kvjax.methods.base import Capacity, LayerContext, SlotCache, SlotMethod, empty_slots, store_prompt
from kvjax.methods.core.select import topk_with_window


@dataclasses.dataclass(frozen=True, eq=False)
class ScoringMethod(SlotMethod):
    """Keep the ``P = budget_tokens(budget, n)`` prompt tokens of highest :meth:`score` (per KV head, ties to the
    earlier position); append every decode token. Holds ``min(n, P) + steps`` tokens after ``steps`` decode steps."""

    traced_layer: ClassVar[bool] = True  # nothing branches on the layer: the engine may scan the layers
    budget: float | int = 0.2

    def __post_init__(self):
        check_budget(self.budget)  # a ValueError naming the option

    @abc.abstractmethod
    def score(self, q, k, lengths) -> jnp.ndarray:
        """Scores ``[B, Hkv, T]`` (larger is kept) of the prompt's tokens from ``q [B, Hq, T, D]``, ``k [B, Hkv, T,
        D]`` (post-RoPE) and the real lengths ``lengths [B]`` (positions ``>= lengths`` are padding, never kept)."""

    def init(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> SlotCache:
        p = budget_tokens(self.budget, capacity.prompt_len)  # most prompt tokens any n <= bucket keeps
        return empty_slots(model_cfg, batch, p + capacity.max_new_tokens, dtype, prompt_slots=p)

    def prefill(self, state: SlotCache, layer: int, q, k, v, lengths, previous=None) -> SlotCache:
        keep = jnp.minimum(budget_tokens(self.budget, lengths), state.prompt_slots)  # [B]
        idx, ok = topk_with_window(self.score(q, k, lengths), lengths, keep, 0, state.prompt_slots)  # ascending
        return store_prompt(state, k, v, idx, ok)

    def held(self, n: int, steps: int, ctx: LayerContext = LayerContext()) -> int:
        return min(n, budget_tokens(self.budget, n)) + steps
