"""Knorm (kvpress's KnormPress): keep the prompt tokens whose keys have the smallest L2 norm, per KV head.

A method written from docs/interface.md alone, in one file: ``kvjax generate --plugin docs/examples/knorm.py
--method knorm --budget 0.2 --prompt ...``, or ``kvjax.methods.load_plugin("docs/examples/knorm.py")`` in Python.
Low-norm keys tend to draw high attention (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for
KV Cache Compression"), so the score of a prompt token is ``-||k||``; every decoded token is appended.
"""

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.methods import ScoringMethod, register


@register
@dataclasses.dataclass(frozen=True)
class Knorm(ScoringMethod):
    """Keep the P = budget_tokens(budget, n) prompt tokens of lowest key norm; append every decode token."""

    name: ClassVar[str] = "knorm"

    def score(self, q, k, lengths):
        return -jnp.linalg.norm(k.astype(jnp.float32), axis=-1)  # [B, Hkv, T]: low norm first
