"""The cache-method interface and the slot cache most methods share.

A method is a frozen, hashable config dataclass (static under ``jit``) with four pure functions
(DESIGN principle 4), written as methods of the config so ``cfg.prefill(...)`` is ``prefill(cfg, ...)``:

- ``init(model_cfg, batch, capacity, layer) -> State``: fixed shapes from ``Capacity`` (prompt bucket and
  ``max_new_tokens``); ``layer`` lets a method vary per layer (PyramidKV budgets, full first layers).
- ``prefill(state, layer, q [B,Hq,T,D], k [B,Hkv,T,D], v [B,Hkv,T,D], lengths [B]) -> State``.
- ``decode(state, layer, q [B,Hq,D], k [B,Hkv,D], v [B,Hkv,D], pos [B]) -> (out [B,Hq,D] f32, State)``:
  store the new token, attend, evict; all at fixed shapes.
- ``memory_bytes(state) -> int``: bytes the state really holds (every leaf, counts and positions included).

Budgets (``Budget``) are a fraction of each prompt (``0 < b <= 1``, float) or a token count (``int >= 1``).
A fractional budget gives each sequence ``ceil(b * length)`` tokens; the static slot count uses the bucket.
"""

from __future__ import annotations

import dataclasses
import math
import jax
import jax.numpy as jnp
from flax import struct

from kvjax import attention
from kvjax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Capacity:
    """Static sizes a cache is built for: the padded prompt length (bucket) and the decode steps."""

    prompt_len: int
    max_new_tokens: int


def check_budget(budget) -> float | int:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"budget={budget!r} must be a fraction in (0, 1] (float) or a token count >= 1 (int)")
    if isinstance(budget, float) and not 0.0 < budget <= 1.0:
        raise ValueError(f"budget={budget} as a fraction must be in (0, 1]; pass an int for a token count")
    if isinstance(budget, int) and budget < 1:
        raise ValueError(f"budget={budget} tokens must be >= 1")
    return budget


def static_budget(budget: float | int, prompt_len: int) -> int:
    """Slots reserved for the compressed prompt at bucket length ``prompt_len`` (never more than it)."""
    if isinstance(budget, float):
        return max(1, min(prompt_len, math.ceil(budget * prompt_len)))
    return min(int(budget), prompt_len)


def dynamic_budget(budget: float | int, lengths: jnp.ndarray) -> jnp.ndarray:
    """Per-sequence budget ``[B]`` int32: ``ceil(b * length)`` for fractions, the count otherwise."""
    if isinstance(budget, float):
        return jnp.maximum(1, jnp.ceil(budget * lengths.astype(jnp.float32)).astype(jnp.int32))
    return jnp.full_like(lengths, int(budget))


@struct.dataclass
class SlotCache:
    """Head-major slot buffers. ``pos`` is the original token position of each slot, -1 when empty.

    k, v: ``[B, Hkv, S, D]``; pos: ``[B, Hkv, S]`` int32; score: ``[B, Hkv, S]`` float32 accumulated
    attention (H2O) or ``[B, Hkv, 0]`` for methods that keep none; cursor: ``[]`` int32 next append slot;
    prompt_slots: static number of slots reserved for the (compressed) prompt, ``[0, prompt_slots)``;
    num_layers: static layer count of the model (layer-dependent methods such as PyramidKV use it).
    """

    k: jnp.ndarray
    v: jnp.ndarray
    pos: jnp.ndarray
    score: jnp.ndarray
    cursor: jnp.ndarray
    prompt_slots: int = struct.field(pytree_node=False, default=0)
    num_layers: int = struct.field(pytree_node=False, default=0)

    @property
    def valid(self) -> jnp.ndarray:
        return self.pos >= 0


def empty_slots(model_cfg: ModelConfig, batch: int, slots: int, dtype, prompt_slots: int,
                with_score: bool = False) -> SlotCache:
    """An empty cache of ``slots`` slots whose first ``prompt_slots`` hold the prompt; appends start after."""
    h, d = model_cfg.num_kv_heads, model_cfg.head_dim
    return SlotCache(
        k=jnp.zeros((batch, h, slots, d), dtype), v=jnp.zeros((batch, h, slots, d), dtype),
        pos=jnp.full((batch, h, slots), -1, jnp.int32),
        score=jnp.zeros((batch, h, slots if with_score else 0), jnp.float32),
        cursor=jnp.asarray(prompt_slots, jnp.int32), prompt_slots=prompt_slots,
        num_layers=model_cfg.num_layers)


def store_prompt(state: SlotCache, k, v, idx, ok, score=None) -> SlotCache:
    """Gather prompt tokens ``idx [B,Hkv,P]`` (``ok`` marks real ones) into slots ``[0, P)``."""
    p = idx.shape[-1]
    safe = jnp.clip(idx, 0, k.shape[2] - 1)
    kk = jnp.take_along_axis(k, safe[..., None], axis=2).astype(state.k.dtype)
    vv = jnp.take_along_axis(v, safe[..., None], axis=2).astype(state.v.dtype)
    pos = jnp.where(ok, idx, -1).astype(jnp.int32)
    new = state.replace(k=state.k.at[:, :, :p].set(kk), v=state.v.at[:, :, :p].set(vv),
                         pos=state.pos.at[:, :, :p].set(pos))
    if score is not None and state.score.shape[-1]:
        sc = jnp.where(ok, jnp.take_along_axis(score, safe, axis=2), 0.0)
        new = new.replace(score=new.score.at[:, :, :p].set(sc))
    return new


def write_token(state: SlotCache, slot: jnp.ndarray, k, v, pos) -> SlotCache:
    """Write the new token ``k, v [B,Hkv,D]`` at position ``pos [B]`` into ``slot [B,Hkv]`` (in place)."""
    b, h = slot.shape
    bi = jnp.arange(b)[:, None]
    hi = jnp.arange(h)[None, :]
    return state.replace(
        k=state.k.at[bi, hi, slot].set(k.astype(state.k.dtype)),
        v=state.v.at[bi, hi, slot].set(v.astype(state.v.dtype)),
        pos=state.pos.at[bi, hi, slot].set(jnp.broadcast_to(pos[:, None], (b, h)).astype(jnp.int32)))


def attend_slots(state: SlotCache, q) -> jnp.ndarray:
    """Normalised attention ``[B, Hq, D]`` float32 of ``q`` over the valid slots."""
    return attention.normalise(attention.attend(q, state.k, state.v, state.valid))


def tree_bytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def append_decode(state: SlotCache, q, k, v, pos):
    """Decode for methods that keep the compressed prompt and append every new token at ``cursor``."""
    b, h = k.shape[:2]
    slot = jnp.broadcast_to(state.cursor, (b, h))
    state = write_token(state, slot, k, v, pos).replace(cursor=state.cursor + 1)
    return attend_slots(state, q), state


def group_mean(x: jnp.ndarray, num_kv_heads: int) -> jnp.ndarray:
    """Mean over the query heads of each KV group: ``[B, Hq, ...]`` -> ``[B, Hkv, ...]``."""
    b, hq = x.shape[:2]
    return x.reshape(b, num_kv_heads, hq // num_kv_heads, *x.shape[2:]).mean(axis=2)
