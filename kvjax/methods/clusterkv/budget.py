"""ClusterKV's budget split (Liu et al., DAC'25, §III-B/C, §V-A; method note ``docs/notes/clusterkv.md`` §6 #1-2,
§7.1): a budget of ``B`` tokens a step attends from the prompt side, sinks included, split into ``sink_b`` sinks
and ``bsel_b`` tokens taken from clusters; the prompt's ``C0`` clusters; and the tokens a decode step attends.

A token-count budget can cover the generated tokens too (``min(count, n + max_new_tokens)``), a fraction is
``ceil(b n)`` (:func:`kvjax.methods.base.evicting_budget`). Host functions take Python ints; :func:`split_dynamic`
computes the same per sequence, ``[B]`` int32, traced.
"""

from __future__ import annotations

import jax.numpy as jnp

from kvjax.methods.base import evicting_budget


def split(budget: float | int, sink: int, n: int, max_new_tokens: int = 0) -> tuple[int, int]:
    """``(sink_b, bsel_b)`` for an ``n``-token prompt: sinks and tokens taken from clusters."""
    b = int(evicting_budget(budget, int(n), int(n) + max_new_tokens)) if n else 0
    s = min(sink, b, n)
    return s, b - s


def clusters_for(sink: int, tokens_per_cluster: int, num_clusters: int | None, n: int) -> int:
    """Prompt clusters ``C0`` of an ``n``-token prompt (0 when nothing is clustered): ``num_clusters``, or one per
    ``tokens_per_cluster`` clustered tokens (the paper's ``L/80``), at most one per clustered token."""
    lc = n - min(sink, n)
    if lc <= 0:
        return 0
    c0 = num_clusters if num_clusters is not None else max(1, lc // tokens_per_cluster)
    return min(c0, lc)


def split_dynamic(budget: float | int, sink: int, tokens_per_cluster: int, num_clusters: int | None, lengths, new: int):
    """Per-sequence ``(sink_b, bsel_b, c0_b)`` ``[B]`` int32 of prompts of ``lengths [B]`` tokens and ``new`` decode
    steps (exactly :func:`split`, :func:`clusters_for`)."""
    n = jnp.asarray(lengths, jnp.int32)
    b = jnp.where(n > 0, evicting_budget(budget, n, n + new), 0).astype(jnp.int32)
    s = jnp.minimum(jnp.minimum(sink, b), n)
    lc = n - s
    c0 = jnp.full_like(n, num_clusters) if num_clusters is not None else jnp.maximum(1, lc // tokens_per_cluster)
    return s, b - s, jnp.where(lc > 0, jnp.minimum(c0, lc), 0)


def attended(sink_b: int, bsel: int, n: int, steps: int, window: int) -> int:
    """Tokens (per query head) the decode step writing position ``n + steps`` attends: the ``sink_b`` sinks, the
    ``bsel`` selected (at most the clustered tokens), the unclustered window (``steps % window`` tokens) and the new
    token."""
    unclustered = steps % window
    return sink_b + min(bsel, n - sink_b + steps - unclustered) + unclustered + 1
