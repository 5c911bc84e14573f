"""A decode budget by composition: any scoring method's cache, re-compressed inside the decode loop.

SnapKV, PyramidKV and ChunkKV compress the prompt once and then append every generated token, so a long generation
grows their cache as ``full``'s grows. :class:`DecodeBudget` (``methods.get(name, ..., decode_budget=D, every=E)``)
wraps such a method (one that declares ``recompressible``) and bounds what it holds while decoding, as kvpress's
``DecodingPress(press, compression_interval=E, target_size=D)`` does:

- **Prefill.** The method compresses the prompt as it does alone. Where it keeps more than ``D_l`` tokens (``D_l``:
  layer ``l``'s share of ``D``, :meth:`~kvjax.methods.base.Method.decode_target`; ``D`` itself but for PyramidKV,
  which splits it over the layers by its schedule), the kept prompt is re-compressed to ``D_l`` at once, the same
  way as below (its last ``window`` queries vote).
- **Decode.** Each step appends the new token and attends, as the method alone does, and writes its query into a
  ring of the ``window`` most recent queries (the method's observation window). Every ``E`` steps (decode steps
  ``E, 2E, ...``, counted from the first), a sequence holding more than ``D_l`` tokens is re-compressed to ``D_l``
  with the method's own scorer and selection applied to the slots it holds: the ring's queries vote over the held
  keys they may see (:meth:`Scorer.observed`), the votes are finished as at prefill (SnapKV's pooling) over the held
  slots in position order, and the method's selection keeps its last ``window`` held slots plus the best others
  (SnapKV, PyramidKV: top tokens; ChunkKV: whole chunks of ``chunk_size`` consecutive held slots).
- **Bound.** A sequence never holds more than ``D_l + E`` tokens per KV head, and the state has exactly ``D_l + E``
  slots per layer whatever ``max_new_tokens`` is: held and allocated memory are flat over any generation length.

Everything is at fixed shapes: the re-compression runs when "a multiple of ``E`` steps and some sequence above
``D_l``" holds (a while loop of at most one trip, which :mod:`kvjax.engine.inplace` runs in place on a scanned layer);
the step that does not re-compress updates the cache in place (no copy of a buffer; tested on the compiled loop).
A step that re-compresses computes over every slot of the layer (``recompresses``).

``held(n, s)``: ``h0 = min(method.held(n, 0), D_l)`` after prefill; after ``s`` steps with ``k = s // E``:
``h0 + s`` while ``h0 + k E <= D_l`` (no re-compression has cut anything yet), else ``D_l + s - k E``. A decode
budget at or above ``method.held(n, steps)`` never re-compresses: the tokens are the unbounded method's exactly.

**Threshold** (``threshold=tau``, as kvpress's ``DMSPress(press, threshold)`` but freeing what it evicts): each
re-compression keeps, before the window, the held tokens whose score passes ``tau``, at most ``D_l`` tokens in all.
The score is the method's own (SnapKV: pooled) divided by the ring's queries: the mean attention weight a token gets
from the last ``window`` queries, kvpress's ``SnapKVPress`` score. The tokens passing set the re-compression's
budget (``window`` plus those passing, at most ``D_l``) and the method's selection spends it as it spends any budget
(SnapKV, PyramidKV: exactly the passing tokens; ChunkKV: that many tokens in whole chunks). With a threshold the
prompt is re-compressed at prefill and a sequence holding more than ``window`` tokens every ``E`` steps, so what is
held follows the content, always at most ``held(n, s)`` (an upper bound then, not the count); ``tau = 0`` keeps
the tokens of no threshold.

Index reuse (ChunkKV ``reuse > 1``) applies to the prompt's compression; decode re-compressions select per layer.
The scorer ``"h2o"`` votes with the ring's queries at decode (the accumulation over every query is not kept).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from kernels_pallas.checks import check_int
from kvjax.model import attention
from kvjax.methods.base import (
    Capacity,
    LayerContext,
    Method,
    SlotCache,
    attend_slots,
    empty_slots,
    slot_bytes,
    tree_bytes,
    write_token,
)
from kvjax.sharding import BATCH, KV_HEADS

#: Re-compress every this many decode steps unless ``every=`` says otherwise.
DEFAULT_EVERY = 128


@struct.dataclass
class BoundedState:
    """One layer's state under a decode budget.

    cache: the method's :class:`SlotCache` with ``D_l + every`` slots (``cache.prompt_slots``: the slots the method's
    own prefill needs at this bucket); q_obs ``[B, Hq, W, D]``: the last ``W`` queries (position ``p`` in ring slot
    ``p mod W``); q_pos ``[B, W]`` int32 their positions (-1: empty); steps ``[B]`` int32: decode steps taken."""

    cache: SlotCache
    q_obs: jnp.ndarray
    q_pos: jnp.ndarray
    steps: jnp.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class DecodeBudget(Method):
    """``inner`` (a method that declares ``recompressible``) holding at most ``decode_budget`` tokens per layer and
    KV head plus ``every`` while decoding (module docstring)."""

    inner: Method
    decode_budget: int
    every: int = DEFAULT_EVERY
    threshold: float | None = None

    recompresses: ClassVar[bool] = True

    # ---- the inner method's name, budget and capabilities ----
    name = property(lambda self: self.inner.name)
    budget = property(lambda self: self.inner.budget)
    traced_layer = property(lambda self: self.inner.traced_layer)
    reuses_previous_layer = property(lambda self: self.inner.reuses_previous_layer)
    holds_exactly = property(lambda self: self.inner.holds_exactly and self.threshold is None)
    step_kernels = property(lambda self: self.inner.step_kernels)

    def __post_init__(self):
        if not isinstance(self.inner, Method):
            raise ValueError(f"DecodeBudget(inner={self.inner!r}): inner must be a kvjax method")
        if not self.inner.recompressible:
            raise ValueError(
                f"decode_budget= composes over a method that scores and re-selects the tokens it holds (snapkv, "
                f"pyramidkv, chunkkv); {self.inner.name!r} does not declare recompressible. "
                + self.inner.why_no_decode_budget
            )
        for field, value in (("decode_budget", self.decode_budget), ("every", self.every)):
            check_int(field, value, "tokens; e.g. decode_budget=1024, every=128")
        t = self.threshold
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf")):
            raise ValueError(
                f"threshold={t!r} must be a finite number >= 0 (the mean attention weight a kept token gets from the "
                "window's queries, e.g. threshold=0.001), or None for a fixed decode budget"
            )
        w = self.inner.observation_window()
        if self.decode_budget <= w:
            raise ValueError(
                f"decode_budget={self.decode_budget} must exceed the observation window (window={w}) it always keeps; "
                f"use decode_budget >= {w + 1}"
            )

    # ---- static sizes ----
    def target(self, layer: int, num_layers: int) -> int:
        """``D_l``: the tokens layer ``layer`` keeps after a re-compression."""
        return int(self.inner.decode_target(self.decode_budget, layer, num_layers))

    def min_budget(self) -> tuple[int, str]:
        return self.inner.min_budget()

    def min_legal_budget(self) -> int:
        return self.inner.min_legal_budget()

    def kept_tokens(self, n: int, max_new_tokens: int = 0, model_cfg=None) -> int:
        return self.inner.kept_tokens(n, max_new_tokens, model_cfg)

    def starts_at(self, layer: int) -> bool:
        return self.inner.starts_at(layer)

    def init(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> BoundedState:
        probe = jax.eval_shape(
            lambda: self.inner.init(model_cfg, batch, Capacity(capacity.prompt_len, 0), layer, dtype)
        )
        if not isinstance(probe, SlotCache):
            raise ValueError(f"decode_budget=: {self.inner.name}'s state is not a SlotCache")
        target = self.target(layer, model_cfg.num_layers)
        reuses = self.inner.reuses_previous_layer and not all(
            self.inner.starts_at(l) for l in range(model_cfg.num_layers)
        )
        if reuses and probe.prompt_slots > target:
            raise ValueError(
                f"decode_budget={self.decode_budget}: {self.inner.name}'s layers reuse the previous layer's prompt "
                f"selection (index reuse; {probe.prompt_slots} slots at prompt_len={capacity.prompt_len}), which a "
                f"layer's decode budget of {target} would cut at prefill; raise decode_budget to "
                f">= {probe.prompt_slots}, lower budget, or use reuse=1"
            )
        w = self.inner.observation_window()
        return BoundedState(
            cache=empty_slots(model_cfg, batch, target + self.every, dtype, prompt_slots=probe.prompt_slots),
            q_obs=jnp.zeros((batch, model_cfg.num_heads, w, model_cfg.head_dim), dtype),
            q_pos=jnp.full((batch, w), -1, jnp.int32),
            steps=jnp.zeros((batch,), jnp.int32),
        )

    def _target_of(self, state: BoundedState) -> int:
        return state.cache.k.shape[2] - self.every

    # ---- prefill ----
    def prefill(self, state: BoundedState, layer: int, q, k, v, lengths, previous=None) -> BoundedState:
        b, hq, t, d = q.shape
        w = state.q_obs.shape[2]
        # the ring: position p in slot p mod W, the last W prompt positions [n - W, n)
        r = jnp.arange(w)
        first = lengths[:, None] - w  # [B, 1]
        qpos = first + jnp.mod(r[None, :] - first, w)  # [B, W]
        qpos = jnp.where(qpos >= 0, qpos, -1).astype(jnp.int32)
        q_obs = jnp.take_along_axis(q, jnp.clip(qpos, 0, t - 1)[:, None, :, None], axis=2).astype(state.q_obs.dtype)
        prev = None if previous is None else previous.cache
        cache, target, p = state.cache, self._target_of(state), state.cache.prompt_slots
        if p <= target:  # the kept prompt fits the decode budget: the method's own prefill, in place
            cache = self.inner.prefill(cache, layer, q, k, v, lengths, previous=prev)
            if self.threshold is not None:
                cache = recompress(self.inner, cache, cache, q_obs, qpos, target, cache.length > w, self.threshold)
        else:  # the method's prefill into a transient cache of its prompt slots, then re-compressed to D_l
            h = k.shape[1]
            tmp = SlotCache(
                k=jnp.zeros((b, h, p, d), cache.k.dtype),
                v=jnp.zeros((b, h, p, d), cache.v.dtype),
                pos=jnp.full((b, h, p), -1, jnp.int32),
                score=jnp.zeros((b, h, 0), jnp.float32),
                length=jnp.zeros((b,), jnp.int32),
                limit=jnp.zeros((b,), jnp.int32),
                prompt_slots=p,
                num_layers=cache.num_layers,
            )
            tmp = self.inner.prefill(tmp, layer, q, k, v, lengths, previous=prev)
            need = jnp.ones((b,), bool)
            cache = recompress(self.inner, tmp, cache, q_obs, qpos, target, need, self.threshold)
            cache = cache.replace(limit=tmp.limit)
        return BoundedState(cache=cache, q_obs=q_obs, q_pos=qpos, steps=jnp.zeros((b,), jnp.int32))

    # ---- decode ----
    def decode(self, state: BoundedState, layer: int, q, k, v, pos):
        """Append, attend (the method's appending step), remember the query; every ``every`` steps re-compress the
        sequences above ``D_l`` (module docstring)."""
        cache = state.cache
        b, h = k.shape[:2]
        slot = jnp.broadcast_to(cache.length[:, None], (b, h))
        cache = write_token(cache, slot, k, v, pos)
        part = attend_slots(cache, q)
        w = state.q_obs.shape[2]
        r = jnp.mod(pos, w)
        q_obs = jax.vmap(lambda ring, i, x: ring.at[:, i].set(x))(state.q_obs, r, q.astype(state.q_obs.dtype))
        q_pos = jax.vmap(lambda ring, i, x: ring.at[i].set(x))(state.q_pos, r, pos.astype(jnp.int32))
        steps = state.steps + 1
        target = self._target_of(state)
        floor = target if self.threshold is None else w  # with a threshold any sequence beyond its window
        need = (jnp.mod(steps, self.every) == 0) & (cache.length > floor)
        # At most one trip of a while loop, not a lax.cond (kvjax.engine.inplace): the loop carries the cache, so a
        # scanned layer's stack is re-compressed in place and a step that does not re-compress copies nothing. Its
        # predicate reads the attention's sum (l >= 0 always), which orders the writes after the attention's reads.
        go = jnp.any(need) & ~jnp.any(part[2] < 0)
        _, cache = jax.lax.while_loop(
            lambda c: c[0],
            lambda c: (
                jnp.zeros_like(c[0]),
                recompress(self.inner, c[1], c[1], q_obs, q_pos, target, need, self.threshold),
            ),
            (go, cache),
        )
        return attention.normalise(part), BoundedState(cache=cache, q_obs=q_obs, q_pos=q_pos, steps=steps)

    # ---- measures ----
    def tokens_held(self, state: BoundedState):
        return self.inner.tokens_held(state.cache)

    def memory_bytes(self, state: BoundedState) -> int:
        return tree_bytes(state)

    def bytes_read_per_step(self, state: BoundedState, num_heads: int) -> int:
        """The method's step over the held slots plus the query written into the ring; a re-compressing step (one
        in ``every``) also reads every slot's key, position and the ring (amortised here over ``every`` steps)."""
        cache = state.cache
        ring = state.q_obs[:, :, :1].size * state.q_obs.dtype.itemsize + 8 * cache.length.shape[0]
        rounds = (tree_bytes(cache) + state.q_obs.size * state.q_obs.dtype.itemsize) // self.every
        return self.inner.bytes_read_per_step(cache, num_heads) + ring + rounds

    def held_overhead_bytes(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> int:
        """``every`` slots, the ring of queries with their positions and the step count (beyond ``D_l``)."""
        w = self.inner.observation_window()
        ring = batch * (model_cfg.num_heads * w * model_cfg.head_dim * jnp.dtype(dtype).itemsize + 4 * w + 4)
        return (self.every + 1) * slot_bytes(model_cfg, batch, dtype) + ring

    def state_axes(self, state: BoundedState) -> Any:
        return BoundedState(
            cache=self.inner.state_axes(state.cache),
            q_obs=(BATCH, KV_HEADS),  # query heads, head-major like the KV heads they group under
            q_pos=(BATCH,),
            steps=(BATCH,),
        )

    def held(self, n: int, steps: int, ctx: LayerContext = LayerContext()) -> int:
        target = self.target(ctx.layer, ctx.num_layers)
        h0 = min(int(self.inner.held(n, 0, ctx)), target)
        k = steps // self.every
        if h0 + k * self.every <= target:
            return h0 + steps
        return target + steps - k * self.every


def recompress(
    inner: Method, src: SlotCache, dst: SlotCache, q_obs, q_pos, target: int, need, threshold: float | None = None
) -> SlotCache:
    """``dst`` holding ``inner``'s re-selection of ``src``'s held slots: sequences with ``need [B]`` keep
    ``target`` tokens per KV head (window included), the others every slot they hold (compacted); with a
    ``threshold``, the window plus the tokens before it whose score over the ring's queries passes it, at most
    ``target`` (module docstring). Per KV head the
    held slots are taken in slot order (which is position order: the prompt's kept tokens, then the appended ones),
    scored by ``inner.rescorer().observed`` from the ring ``q_obs [B, Hq, W, D]`` / ``q_pos [B, W]`` and selected by
    ``inner.reselect``; the kept rows are written into slots ``[0, target)`` of ``dst``, the rest emptied."""
    b, h, s, d = src.k.shape
    valid = src.pos >= 0
    votes = inner.rescorer().observed(q_obs, q_pos, src.k, src.pos)  # [B, H, S]
    order = jnp.argsort(~valid, axis=-1, stable=True)  # held slots first, in slot order
    count = jnp.sum(valid, axis=-1).astype(jnp.int32)  # [B, H]
    votes = inner.head_votes(jnp.take_along_axis(votes, order, axis=-1)).reshape(b * h, 1, s)
    budgets = jnp.broadcast_to(jnp.int32(target), (b, h))
    if threshold is not None:  # the window plus the held tokens before it whose mean vote passes the threshold
        w = inner.observation_window()
        scores = inner.rescorer().finish(votes, count.reshape(b * h) - w).reshape(b, h, s)
        queries = jnp.maximum(jnp.sum(q_pos >= 0, axis=-1), 1).astype(jnp.float32)  # [B]
        before = jnp.arange(s) < (count - w)[..., None]
        passing = jnp.sum(before & (scores >= threshold * queries[:, None, None]), axis=-1)
        budgets = jnp.minimum(budgets, w + passing.astype(jnp.int32))
    budgets = jnp.where(need[:, None], budgets, s + 1).astype(jnp.int32).reshape(b * h)
    idx, ok = inner.reselect(votes, count.reshape(b * h), budgets, target)  # [B*H, 1, target]
    idx, ok = idx.reshape(b, h, target), ok.reshape(b, h, target)
    slot = jnp.take_along_axis(order, jnp.clip(idx, 0, s - 1), axis=-1)  # [B, H, target]
    kk = jnp.take_along_axis(src.k, slot[..., None], axis=2).astype(dst.k.dtype)
    vv = jnp.take_along_axis(src.v, slot[..., None], axis=2).astype(dst.v.dtype)
    pos = jnp.where(ok, jnp.take_along_axis(src.pos, slot, axis=-1), -1).astype(jnp.int32)
    rest = jnp.full(dst.pos.shape[:2] + (dst.pos.shape[2] - target,), -1, jnp.int32)
    held = jnp.max(jnp.sum(ok, axis=-1), axis=1).astype(jnp.int32)  # [B]
    new_pos = jax.lax.dynamic_update_slice_in_dim(dst.pos, pos, 0, axis=2)
    return dst.replace(
        k=jax.lax.dynamic_update_slice_in_dim(dst.k, kk, 0, axis=2),
        v=jax.lax.dynamic_update_slice_in_dim(dst.v, vv, 0, axis=2),
        pos=jax.lax.dynamic_update_slice_in_dim(new_pos, rest, target, axis=2),
        length=held,
    )
