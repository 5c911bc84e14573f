"""Pure JAX (the specification, and the XLA path on a GPU/TPU, ``impl="xla"``): the prompt's causal attention and
H2O's accumulated scores in a few large operations.

H2O (Zhang et al. 2023, §3-4) scores each prompt token by its accumulated attention: the column sums of the causal
softmax over every real query, for a KV head averaged over the ``G`` query heads of its group (GQA). With every
query row's full key range in one tile, a row's max and sum are final in the tile itself: one ``q·k``, one ``exp``,
then the output ``P v / l`` and the column sums ``Σ_rows P / l`` from the same tile.

Shapes (axes: b batch, h KV head, g query head of the group, r query row, c key, d head dim):
  q ``[B, Hq, T, D]``, k, v ``[B, Hkv, T, D]`` (``Hq = G Hkv``), lengths ``[B]`` int (real tokens ``[0, n)``) ->
  out ``[B, Hq, T, D]`` in q's dtype (rows of padded queries are 0) and scores ``[B, Hkv, T]`` float32.

Tiling (:func:`band_plan`): the queries are cut into ``bands`` equal bands; band ``j`` (queries ``[q0, q1)``)
needs only the keys ``[0, q1)`` (causality), so the bands skip most of the upper triangle (8 bands compute 56% of
the square). Inside a band, ``rows`` query rows at a time against all of the band's keys: a ``[B, Hkv, G, rows,
q1]`` float32 tile of at most ``tile_bytes`` (default :data:`TILE_BYTES`, ``$KVJAX_PROMPT_TILE_BYTES``). A band of
one block is straight-line code; a band of several is one ``fori_loop`` whose trip count stops at the longest
prompt's last block. So the pass is at most ``bands`` while loops and :func:`loop_trips` trips (582 at 32k tokens,
batch 8, 32 query heads, 1 GiB), each trip a handful of fused operations over a ``tile_bytes`` tile. Padding (past
each length) is zeroed before use, so NaN or inf there is never read; padded queries vote for nothing.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

NEG_INF = -1e30
#: Largest float32 score tile ``[B, Hq, rows, keys]`` of one loop trip (bytes). XLA keeps about three such
#: buffers alive in a trip (the scores, their ``exp`` and its cast for ``P v``).
TILE_BYTES = 1 << 30
ENV_TILE_BYTES = "KVJAX_PROMPT_TILE_BYTES"
#: Query bands (the causal triangle is covered by ``bands`` key ranges: work ``(bands + 1) / (2 bands)`` of the
#: square).
BANDS = 8
#: Fewest queries per band: shorter prompts get fewer bands.
MIN_BAND = 128


def tile_bytes_default() -> int:
    """``$KVJAX_PROMPT_TILE_BYTES`` if set (bytes), else :data:`TILE_BYTES`. Read at trace time."""
    env = os.environ.get(ENV_TILE_BYTES)
    if not env:
        return TILE_BYTES
    try:
        n = int(env)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV_TILE_BYTES}={env!r} must be a positive number of bytes, e.g. {TILE_BYTES}")
    return n


def band_plan(
    t: int, heads: int, tile_bytes: int | None = None, rows: int | None = None, bands: int | None = None
) -> tuple[tuple[int, int, int, int], ...]:
    """Static tiling of a ``t``-token prompt: per band ``(q0, q1, rows, blocks)``: queries ``[q0, q1)`` against
    keys ``[0, q1)``, ``rows`` query rows per block, ``blocks = ceil((q1 - q0) / rows)`` blocks (the last block may
    run past ``q1``; those rows are masked). heads: ``B * Hq`` (the tile's rows per query position); rows: a fixed
    block height (tests), else the most that keep ``heads * rows * q1 * 4 <= tile_bytes``; bands: the number of
    bands (default :data:`BANDS`, fewer for prompts under ``BANDS * MIN_BAND`` tokens)."""
    if t <= 0:
        return ()
    budget = tile_bytes or tile_bytes_default()
    nb = max(1, min(bands, t) if bands else min(BANDS, -(-t // MIN_BAND)))
    p = -(-t // nb)
    plan = []
    for j in range(nb):
        q0, q1 = j * p, min((j + 1) * p, t)
        if q0 >= q1:
            break
        r = rows or max(1, budget // (4 * heads * q1))
        r = min(r, q1 - q0)
        plan.append((q0, q1, r, -(-(q1 - q0) // r)))
    return tuple(plan)


def loop_trips(plan) -> int:
    """Loop trips of a plan at full length: every band of more than one block loops over its blocks."""
    return sum(n for *_, n in plan if n > 1)


def accumulated_attention_reference(
    q, k, v, lengths, *, tile_bytes: int | None = None, rows: int | None = None, bands: int | None = None
):
    """``(out, scores)`` (module docstring); ``v=None``: ``(None, scores)`` (no ``P v``)."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    lengths = jnp.asarray(lengths, jnp.int32)
    plan = band_plan(t, b * hq, tile_bytes, rows, bands)
    tq = max([q0 + r * n for q0, _, r, n in plan] + [t])  # queries padded so every block's slice is in range
    real = (jnp.arange(t)[None, :] < lengths[:, None])[:, None, :, None]  # [B, 1, T, 1]
    qg = jnp.pad(jnp.where(real, q, 0), ((0, 0), (0, 0), (0, tq - t), (0, 0))).reshape(b, hkv, g, tq, d)
    k = jnp.where(real, k, 0)
    v = None if v is None else jnp.where(real, v, 0)
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    acc = jnp.zeros((b, hkv, t), jnp.float32)
    out = None if v is None else jnp.zeros((b, hkv, g, tq, d), q.dtype)
    longest = jnp.max(lengths) if b else 0

    for q0, q1, r, n in plan:
        kb = k[:, :, :q1]  # [B, Hkv, C, D]
        vb = None if v is None else v[:, :, :q1]
        kpos = jnp.arange(q1)

        def block(start, carry, q1=q1, r=r, kb=kb, vb=vb, kpos=kpos):
            acc, out = carry
            qi = jax.lax.dynamic_slice_in_dim(qg, start, r, axis=3)  # [B, Hkv, G, R, D]
            qpos = start + jnp.arange(r)
            s = jnp.einsum("bhgrd,bhcd->bhgrc", qi, kb, preferred_element_type=jnp.float32) * scale
            s = jnp.where(kpos[None, :] <= qpos[:, None], s, NEG_INF)  # causal; every row sees key 0
            m = jnp.max(s, axis=-1, keepdims=True)
            p = jnp.exp(s - m)  # exactly 0 where masked
            l = jnp.sum(p, axis=-1)  # [B, Hkv, G, R]
            mine = (qpos[None, :] < lengths[:, None]) & (qpos < q1)[None, :]  # [B, R]: real rows of this band
            f = jnp.where(mine[:, None, None, :], 1.0 / l, 0.0)
            col = jnp.sum(p * f[..., None], axis=(2, 3))  # [B, Hkv, C]: float32 on every backend
            acc = jax.lax.dynamic_update_slice_in_dim(acc, acc[:, :, :q1] + col, 0, axis=2)
            if vb is not None:
                o = jnp.einsum("bhgrc,bhcd->bhgrd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
                # rows past q1 are rewritten by the next band (later in program order)
                out = jax.lax.dynamic_update_slice_in_dim(out, (o * f[..., None]).astype(out.dtype), start, axis=3)
            return acc, out

        if n == 1:
            acc, out = block(q0, (acc, out))
        else:
            live = jnp.clip((longest - q0 + r - 1) // r, 0, n)  # blocks holding a real query
            acc, out = jax.lax.fori_loop(0, live, lambda i, c: block(q0 + i * r, c), (acc, out))
    acc = acc / g
    if v is None:
        return None, acc
    return out[:, :, :, :t].reshape(b, hq, t, d), acc
