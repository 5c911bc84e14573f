"""Which tokens a ClusterKV decode step recalls (Liu et al., DAC'25, §III-C selection at cluster granularity,
§IV-C indexing; spec §2.5-2.7, §7.4; method note ``docs/notes/clusterkv.md`` §7.4): the clusters ranked by the
query's score against their centroids, ``q · mu``, taken whole until ``bsel`` tokens, the last one cut; the step's
attended slots as runs ``(start, length)``: the sinks, the unclustered window, then the clusters.

Shapes: q ``[B, Hq, D]``; mu ``[B, Hkv, C, D]`` float32; csize, cstart ``[B, Hkv, C]`` int32 (0 rows: unused or
empty); bsel, sinks, clustered, t ``[B]`` int32; runs ``starts [B, Hkv, R]`` and ``lens [B, Hkv, R]`` (or ``[B,
Hkv, G, R]`` per query head) with ``R = C + 2``. ``gqa``: ``"group_mean"`` (one selection per KV head, from the
group's mean query) or ``"query"`` (one per query head). Einsum axes: b batch, h KV head, g query head of the
group, c cluster, d head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.model.attention import NEG_INF
from kvjax.methods.core import threshold as th


def take_by_rank(score, size, bsel):
    """Rows taken per cluster when clusters are taken whole in descending ``score`` order (ties: the lower index)
    until ``bsel`` rows, the last one cut: ``clip(bsel - (rows of the clusters ranked before), 0, size)`` ``[...,
    C]`` int32, in cluster order. ``score [..., C]`` float32, ``size [..., C]`` int (``>= 0``), ``bsel`` broadcastable
    to ``score.shape[:-1]``. No sort: ``tau``, the cut cluster's score, from a size-weighted bisection
    (:func:`~kvjax.methods.core.threshold.kth_key`); the clusters above it are taken whole (their rows sum to less than
    ``bsel``), those tied with it in index order, those below not at all."""
    keys = th.sortable(score)
    size = size.astype(jnp.int32)
    bsel = jnp.broadcast_to(jnp.asarray(bsel, jnp.int32), score.shape[:-1])
    tau, above = th.kth_key(keys, size, bsel)
    tied = jnp.where(keys == tau[..., None], size, 0)
    cut = jnp.clip((bsel - above)[..., None] - (jnp.cumsum(tied, axis=-1) - tied), 0, size)
    return jnp.where(keys > tau[..., None], size, jnp.where(keys == tau[..., None], cut, 0)).astype(jnp.int32)


def take_lengths(q, mu, csize, bsel, gqa: str):
    """Tokens each selecting head takes from each cluster, ``[B, Hkv, G', C]`` int32 in cluster-id order, ``G' =
    G`` for ``gqa="query"``, 1 for ``group_mean``. The clusters are ranked by ``q·mu`` (ties: the lower id), whole
    clusters taken until ``bsel`` tokens, the last one cut to its first (earliest-position) rows: cluster ``c`` at
    rank ``r`` gives ``clip(bsel - Σ_{r' < r} size, 0, size)`` rows, computed without a sort (:func:`take_by_rank`;
    XLA:CPU's sort of 8 x 409 scores took 0.4-0.5 ms a step at 32k)."""
    b, hq, d = q.shape
    h = mu.shape[1]
    qg = q.astype(jnp.float32).reshape(b, h, hq // h, d)
    if gqa == "group_mean":
        qg = qg.mean(axis=2, keepdims=True)
    s = jnp.einsum("bhgd,bhcd->bhgc", qg, mu, precision=jax.lax.Precision.HIGHEST)
    live = (csize > 0)[:, :, None, :]
    size = jnp.broadcast_to(csize[:, :, None], s.shape)
    return take_by_rank(jnp.where(live, s, NEG_INF), size, bsel[:, None, None])


def runs(take, cstart, sinks, clustered, t):
    """The runs of slots the step whose new token is at ``t [B]`` attends, from the clusters' ``take [B, Hkv, G',
    C]`` (:func:`take_lengths`): ``(starts [B, Hkv, R], lens [B, Hkv, R] or [B, Hkv, G, R])``: the sinks ``[0,
    sink_b)``, the unclustered window ``[clustered, t]``, then the clusters from ``cstart``. ``gqa="query"`` gives
    every query head its own lengths over the clusters any head of its group takes (read once per KV head, masked
    per query head)."""
    b, h, g = take.shape[:3]
    fixed = lambda x: jnp.broadcast_to(x.astype(jnp.int32)[:, None, None, None], (b, h, g, 1))  # noqa: E731
    lens = jnp.concatenate([fixed(sinks), fixed(t + 1 - clustered), take], axis=-1)
    starts = jnp.concatenate(
        [
            jnp.zeros((b, h, 1), jnp.int32),
            jnp.broadcast_to(clustered[:, None, None], (b, h, 1)).astype(jnp.int32),
            cstart.astype(jnp.int32),
        ],
        axis=-1,
    )
    return starts, (lens[:, :, 0] if g == 1 else lens)


def positions_of(pos, slots):
    """``[B, Hkv, G, S]`` bool by position: the slots ``slots [B, Hkv, G, S]`` (bool by slot) mapped to the positions
    they hold, ``pos [B, Hkv, S]`` (-1: empty)."""
    s = pos.shape[-1]
    p = jnp.where(pos >= 0, pos, s)  # [B, Hkv, S] the position each slot holds
    put = lambda pp, m: jnp.zeros((s + 1,), bool).at[pp].max(m)[:s]  # noqa: E731
    return jax.vmap(jax.vmap(jax.vmap(put, in_axes=(None, 0))))(p, slots)
