"""Knorm (kvpress's KnormPress): keep the prompt tokens whose keys have the smallest L2 norm, per KV head.

A method written from docs/interface.md alone, in one file: ``kvjax generate --plugin docs/examples/knorm.py
--method knorm --budget 0.2 --prompt ...``, or ``kvjax.methods.load_plugin("docs/examples/knorm.py")`` in Python.
Low-norm keys tend to draw high attention (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for
KV Cache Compression"), so the score of a prompt token is ``-||k||``; every decoded token is appended.
"""

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.budget import budget_tokens, check_budget
from kvjax.methods import register
from kvjax.methods.base import Capacity, LayerContext, SlotCache, SlotMethod, empty_slots, store_prompt
from kvjax.methods.select import topk_with_window


@register
@dataclasses.dataclass(frozen=True)
class Knorm(SlotMethod):
    """Keep the P = budget_tokens(budget, n) prompt tokens of lowest key norm; append every decode token."""

    name: ClassVar[str] = "knorm"
    traced_layer: ClassVar[bool] = True  # nothing branches on the layer: the engine may scan the layers
    budget: float | int = 0.2

    def __post_init__(self):
        check_budget(self.budget)  # a ValueError naming the option

    def init(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> SlotCache:
        p = budget_tokens(self.budget, capacity.prompt_len)  # most prompt tokens any n <= bucket keeps
        return empty_slots(model_cfg, batch, p + capacity.max_new_tokens, dtype, prompt_slots=p)

    def prefill(self, state: SlotCache, layer: int, q, k, v, lengths, previous=None) -> SlotCache:
        scores = -jnp.linalg.norm(k.astype(jnp.float32), axis=-1)  # [B, Hkv, T]: low norm first
        keep = jnp.minimum(budget_tokens(self.budget, lengths), state.prompt_slots)  # [B]
        idx, ok = topk_with_window(scores, lengths, keep, 0, state.prompt_slots)  # positions ascending, -1 pads
        return store_prompt(state, k, v, idx, ok)

    def held(self, n: int, steps: int, ctx: LayerContext = LayerContext()) -> int:
        return min(n, budget_tokens(self.budget, n)) + steps
