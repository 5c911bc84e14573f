"""``chelsea``: KV-cache clustering by Chunked Soft Matching (Hu et al., 2025, arXiv:2506.11418).

Algorithm 1 at fixed shapes; method details and the resolutions of what the paper leaves open follow
``../shared/specs/chelsea.md`` (section numbers below refer to the paper, A-numbers to the note).

- Budget (§5.1, A12, A13): ``B = floor(R (n + Gamma))`` slots per compressed KV head, sinks and recent
  included, with ``n`` the prompt *bucket* and ``Gamma = max_new_tokens`` (a fraction ``budget=R``), or
  ``B = budget`` (an int). With outlier heads and ``reallocate=True`` the compressed heads get
  ``(B H - O (n + Gamma)) / (H - O)`` so the total equals ``B`` per head (App. C.2 fairness).
- Prefill (Alg. 1): prefill attention is full (the engine's); then, for every sequence with
  ``length >= B + g``, one Chelsea call: CSM rounds (:mod:`kvjax.methods.csm`) with the ratio schedule
  ``r_i = max(r_init - alpha min(m, i), r_floor)`` (App. C.2; presets ``PRESETS``) and merges
  ``min(floor(r_i M_i), s_i - B)`` until the cache holds exactly ``B``. The round count and every round's
  static size come from the bucket (:func:`kvjax.methods.csm.plan`). The rounds of a call run as one
  ``lax.scan`` at the input size (one compiled round body); ``unroll_rounds=True`` unrolls them at shrinking
  sizes instead (less work per round, one compile per round; identical results).
- Decode (Alg. 1): the new token is appended with count 1, attention is
  ``softmax(q K^T / sqrt(d) + log N) V`` (Eq. 2, through ``attention.attend``'s bias), and when the cache
  reaches ``B + g`` slots a Chelsea call (``lax.cond``, same shapes) merges it back to ``B``.
- Outlier heads (§5.4, App. B): KV heads listed by ``outlier_heads`` (a JSON from ``kvjax calibrate-chelsea``
  or a tuple of ``(layer, kv_head)``) keep their full cache in a separate ``[B, O, n + Gamma, D]`` buffer,
  allocated only in layers that have outlier heads; their query heads attend there.

State per layer (:class:`ChelseaState`): k, v ``[B, Hc, S, D]`` with ``S = min(B + g, n + Gamma)``;
n ``[B, Hc, S]`` float32 counts (0 = empty slot); length ``[B]`` int32 occupied slots (at the front);
ko, vo ``[B, O, n + Gamma, D]`` (``O = 0``: zero-size). GQA native: clustering, counts and the outlier decision
are per KV head; the query heads of a group share them (A10).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax import attention
from kvjax.methods.base import Capacity, Method, check_budget, tree_bytes
from kvjax.methods.csm import Round, csm_round, merges_for, plan

#: Ratio schedules ``(r_init, alpha, m)`` of App. C.2 (and D.1 for the needle test: constant 0.25).
PRESETS = {"llama2": (0.45, 0.05, 3), "llama3": (0.35, 0.1, 2), "qwen2": (0.2, 0.1, 2), "niah": (0.25, 0.0, 0)}


@struct.dataclass
class ChelseaState:
    k: jnp.ndarray  # [B, Hc, S, D] compressed heads
    v: jnp.ndarray
    n: jnp.ndarray  # [B, Hc, S] float32 cluster counts, 0 = empty
    length: jnp.ndarray  # [B] int32 occupied slots of the compressed heads
    ko: jnp.ndarray  # [B, O, F, D] outlier heads, full cache (F = n + Gamma); O may be 0
    vo: jnp.ndarray
    budget: int = struct.field(pytree_node=False, default=0)
    trigger: int = struct.field(pytree_node=False, default=0)  # B + g: compress when length reaches it
    prefill_rounds: tuple = struct.field(pytree_node=False, default=())
    decode_rounds: tuple = struct.field(pytree_node=False, default=())
    comp_heads: tuple = struct.field(pytree_node=False, default=())
    out_heads: tuple = struct.field(pytree_node=False, default=())


@functools.lru_cache(maxsize=32)
def load_outlier_file(path: str) -> dict:
    """Read a calibration JSON written by ``kvjax calibrate-chelsea``."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"outlier_heads={path!r}: no such file; run `kvjax calibrate-chelsea --model ... "
                                "--out PATH` first, or pass a tuple of (layer, kv_head) pairs")
    data = json.loads(p.read_text())
    if "outlier_heads" not in data:
        raise ValueError(f"outlier_heads={path!r} has no 'outlier_heads' entry; it is not a calibration file")
    return data


@dataclasses.dataclass(frozen=True)
class Chelsea(Method):
    """Chelsea config (static). ``schedule``: a ``PRESETS`` name or ``(r_init, alpha, m)``."""

    name: ClassVar[str] = "chelsea"
    budget: float | int = 0.2
    n_sink: int = 16
    n_recent: int = 64
    chunk: int = 256
    interval: int = 64
    schedule: str | tuple = "llama3"
    r_floor: float = 0.05
    outlier_heads: str | tuple = ()
    reallocate: bool = True
    impl: str | None = None
    unroll_rounds: bool = False

    def __post_init__(self):
        check_budget(self.budget)
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 2 or self.chunk % 2:
            raise ValueError(f"chunk={self.chunk!r} must be an even integer >= 2 (A/B tokens alternate in a chunk)")
        for name in ("n_sink", "n_recent"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be an integer >= 0")
        if not isinstance(self.interval, int) or self.interval < 1:
            raise ValueError(f"interval={self.interval!r} (g) must be an integer >= 1")
        if isinstance(self.schedule, str) and self.schedule not in PRESETS:
            raise ValueError(f"schedule={self.schedule!r} is not a preset; choose one of {sorted(PRESETS)} or pass "
                             "(r_init, alpha, m)")
        if not isinstance(self.schedule, str):
            if not (isinstance(self.schedule, tuple) and len(self.schedule) == 3):
                raise ValueError(f"schedule={self.schedule!r} must be a preset name or a tuple (r_init, alpha, m)")
            r_init, alpha, m = self.schedule
            if not 0.0 < r_init <= 0.5:
                raise ValueError(f"schedule r_init={r_init} must be in (0, 0.5]: one CSM round removes at most "
                                 "half of the middle (§5.1)")
            if alpha < 0 or not isinstance(m, int) or m < 0:
                raise ValueError(f"schedule alpha={alpha}, m={m!r} must be alpha >= 0 and an integer m >= 0")
        if not 0.0 < self.r_floor <= 0.5:
            raise ValueError(f"r_floor={self.r_floor} must be in (0, 0.5] (the ratio must stay > 0, App. C.2)")
        if self.impl not in (None, "xla", "pallas_tpu", "pallas_gpu"):
            raise ValueError(f"impl={self.impl!r} must be 'xla', 'pallas_tpu', 'pallas_gpu' or None")
        if not isinstance(self.outlier_heads, (str, tuple)):
            raise ValueError(f"outlier_heads={self.outlier_heads!r} must be a JSON path (str) or a tuple of "
                             "(layer, kv_head) pairs")

    # ---- static planning -------------------------------------------------------------------------------

    def ratio(self, i: int) -> float:
        """Ratio of CSM round ``i`` of a call (App. C.2): ``max(r_init - alpha min(m, i), r_floor)``."""
        r_init, alpha, m = PRESETS[self.schedule] if isinstance(self.schedule, str) else self.schedule
        return max(r_init - alpha * min(m, i), self.r_floor)

    def outliers(self, model_cfg) -> frozenset:
        """The ``(layer, kv_head)`` pairs that keep their full cache, checked against the model."""
        if isinstance(self.outlier_heads, str):
            data = load_outlier_file(self.outlier_heads)
            for key, want in (("num_layers", model_cfg.num_layers), ("num_kv_heads", model_cfg.num_kv_heads)):
                if key in data and data[key] != want:
                    raise ValueError(f"outlier_heads={self.outlier_heads!r} was calibrated for {key}={data[key]} "
                                     f"but the model has {want}; recalibrate for this model")
            pairs = data["outlier_heads"]
        else:
            pairs = self.outlier_heads
        out = set()
        for pair in pairs:
            layer, head = (int(x) for x in pair)
            if not (0 <= layer < model_cfg.num_layers and 0 <= head < model_cfg.num_kv_heads):
                raise ValueError(f"outlier head {tuple(pair)} is outside the model ({model_cfg.num_layers} layers, "
                                 f"{model_cfg.num_kv_heads} KV heads)")
            out.add((layer, head))
        return frozenset(out)

    def budget_tokens(self, model_cfg, capacity: Capacity) -> int:
        """``B``: slots per compressed KV head (sinks and recent included)."""
        full = capacity.prompt_len + capacity.max_new_tokens
        total_heads = model_cfg.num_layers * model_cfg.num_kv_heads
        n_out = len(self.outliers(model_cfg))
        per_head = self.budget * full if isinstance(self.budget, float) else float(self.budget)
        if n_out and self.reallocate:
            if n_out >= total_heads:
                return full
            per_head = (per_head * total_heads - n_out * full) / (total_heads - n_out)
            if per_head < 1:
                raise ValueError(f"budget={self.budget} cannot pay for {n_out} full-cache outlier heads of "
                                 f"{total_heads}; raise the budget, drop outlier heads or set reallocate=False")
        return int(math.floor(per_head + 1e-9))

    def sizes(self, model_cfg, capacity: Capacity):
        """Static ``(B, trigger = B + g, slots S, prefill rounds, decode rounds)`` for this capacity."""
        b = self.budget_tokens(model_cfg, capacity)
        full = capacity.prompt_len + capacity.max_new_tokens
        trigger = b + self.interval
        peak = capacity.prompt_len + capacity.max_new_tokens - 1  # most tokens a sequence ever holds
        if peak < trigger:  # never compresses: a plain full cache
            return b, trigger, full, (), ()
        if b <= self.n_sink + self.n_recent:
            raise ValueError(f"budget={self.budget} gives B={b} slots per head at prompt bucket {capacity.prompt_len}"
                             f" + {capacity.max_new_tokens} new tokens, not more than n_sink + n_recent = "
                             f"{self.n_sink + self.n_recent}; raise the budget or shrink n_sink/n_recent")
        slots = min(trigger, full)
        pre = ()
        if capacity.prompt_len >= trigger:
            pre = plan(capacity.prompt_len, b, self.n_sink, self.n_recent, self.ratio,
                       floor_slots=min(capacity.prompt_len, trigger - 1))
        dec = plan(trigger, b, self.n_sink, self.n_recent, self.ratio, floor_slots=slots)
        dec = tuple(dataclasses.replace(r, out_slots=slots) for r in dec)
        return b, trigger, slots, pre, dec

    # ---- the method interface --------------------------------------------------------------------------

    def init(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> ChelseaState:
        b, trigger, slots, pre, dec = self.sizes(model_cfg, capacity)
        out = sorted(h for (l, h) in self.outliers(model_cfg) if l == layer)
        comp = [h for h in range(model_cfg.num_kv_heads) if h not in out]
        d = model_cfg.head_dim
        full = capacity.prompt_len + capacity.max_new_tokens
        return ChelseaState(
            k=jnp.zeros((batch, len(comp), slots, d), dtype), v=jnp.zeros((batch, len(comp), slots, d), dtype),
            n=jnp.zeros((batch, len(comp), slots), jnp.float32), length=jnp.zeros((batch,), jnp.int32),
            ko=jnp.zeros((batch, len(out), full if out else 0, d), dtype),
            vo=jnp.zeros((batch, len(out), full if out else 0, d), dtype),
            budget=b, trigger=trigger, prefill_rounds=pre, decode_rounds=dec, comp_heads=tuple(comp),
            out_heads=tuple(out))

    def _compress(self, state: ChelseaState, k, v, n, length, rounds: tuple[Round, ...], active):
        """One Chelsea call (§5.1): the rounds of ``rounds`` for the elements with ``active [B]``.

        With ``unroll_rounds=False`` (default) several rounds run as one ``lax.scan`` at the input size (the
        masked fixed-capacity variant, spec §8.4b): the same merges (top-k is sorted and stable, so the first m
        of a larger top-k are the top m), one compiled round body instead of one per round (XLA compile time
        on CPU is ~seconds per round per layer), at the cost of every round working on the input size.
        """
        if len(rounds) > 1 and not self.unroll_rounds:
            kmax = max(r.max_merges for r in rounds)

            def body(carry, r_q):
                k, v, n, length = carry
                m = jnp.where(active, merges_for(length, state.budget, self.n_sink, self.n_recent, r_q), 0)
                k, v, n = csm_round(k, v, n, length, m, n_sink=self.n_sink, n_recent=self.n_recent,
                                    chunk=self.chunk, max_merges=kmax, out_slots=k.shape[2], impl=self.impl)
                return (k, v, n, length - m), None

            r_qs = jnp.asarray([r.r_q for r in rounds], jnp.int32)
            (k, v, n, length), _ = jax.lax.scan(body, (k, v, n, length), r_qs)
            out = rounds[-1].out_slots  # occupancy <= out after the last round (static plan)
            return k[:, :, :out], v[:, :, :out], n[:, :, :out], length
        for rnd in rounds:
            m = jnp.where(active, merges_for(length, state.budget, self.n_sink, self.n_recent, rnd.r_q), 0)
            k, v, n = csm_round(k, v, n, length, m, n_sink=self.n_sink, n_recent=self.n_recent, chunk=self.chunk,
                                max_merges=rnd.max_merges, out_slots=rnd.out_slots, impl=self.impl)
            length = length - m
        return k, v, n, length

    def prefill(self, state: ChelseaState, layer: int, q, k, v, lengths, previous=None) -> ChelseaState:
        """Store the prompt ``k, v [B, Hkv, T, D]`` (``lengths [B]``) and compress it to ``B`` (Alg. 1)."""
        b, _, t, _ = k.shape
        comp, out = state.comp_heads, state.out_heads
        kc, vc = _heads(k, comp), _heads(v, comp)
        n = jnp.broadcast_to((jnp.arange(t)[None, :] < lengths[:, None])[:, None, :], (b, len(comp), t))
        n = n.astype(jnp.float32)
        kc, vc = kc.astype(state.k.dtype), vc.astype(state.v.dtype)
        length = lengths.astype(jnp.int32)
        if comp:
            kc, vc, n, length = self._compress(state, kc, vc, n, length, state.prefill_rounds,
                                               lengths >= state.trigger)
        slots = state.k.shape[2]
        have = kc.shape[2]
        if have < slots:
            pad = ((0, 0), (0, 0), (0, slots - have))
            kc, vc, n = jnp.pad(kc, pad + ((0, 0),)), jnp.pad(vc, pad + ((0, 0),)), jnp.pad(n, pad)
        else:  # occupancy <= slots by the static plan; the tail is empty
            kc, vc, n = kc[:, :, :slots], vc[:, :, :slots], n[:, :, :slots]
        new = state.replace(k=kc, v=vc, n=n, length=length)
        if out:
            new = new.replace(ko=state.ko.at[:, :, :t].set(_heads(k, out).astype(state.ko.dtype)),
                              vo=state.vo.at[:, :, :t].set(_heads(v, out).astype(state.vo.dtype)))
        return new

    def decode(self, state: ChelseaState, layer: int, q, k, v, pos):
        """Append ``k, v [B, Hkv, D]``, attend with the ``log N`` bias (Eq. 2), compress at ``B + g``."""
        b, hq, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        comp, out = state.comp_heads, state.out_heads
        q4 = q.reshape(b, hkv, g, d)
        bi = jnp.arange(b)[:, None]
        hc = jnp.arange(len(comp))[None, :]
        slot = jnp.broadcast_to(state.length[:, None], (b, len(comp)))
        kk = state.k.at[bi, hc, slot].set(_heads(k, comp).astype(state.k.dtype))
        vv = state.v.at[bi, hc, slot].set(_heads(v, comp).astype(state.v.dtype))
        n = state.n.at[bi, hc, slot].set(1.0)
        length = state.length + 1
        valid = n > 0
        bias = jnp.log(jnp.where(valid, n, 1.0))
        qc = _heads(q4, comp).reshape(b, len(comp) * g, d)
        if comp:
            o_c = attention.normalise(attention.attend(qc, kk, vv, valid, bias=bias)).reshape(b, len(comp), g, d)
        else:  # every KV head of this layer is an outlier head
            o_c = jnp.zeros((b, 0, g, d), jnp.float32)
        new = state
        if out:
            ho = jnp.arange(len(out))[None, :]
            p = jnp.broadcast_to(pos[:, None], (b, len(out)))
            ko = state.ko.at[bi, ho, p].set(_heads(k, out).astype(state.ko.dtype))
            vo = state.vo.at[bi, ho, p].set(_heads(v, out).astype(state.vo.dtype))
            ovalid = jnp.broadcast_to(jnp.arange(ko.shape[2])[None, None, :] <= pos[:, None, None], ko.shape[:3])
            qo = _heads(q4, out).reshape(b, len(out) * g, d)
            o_o = attention.normalise(attention.attend(qo, ko, vo, ovalid)).reshape(b, len(out), g, d)
            inv = np.argsort(np.asarray(comp + out))
            o = jnp.concatenate([o_c, o_o], axis=1)[:, inv]
            new = new.replace(ko=ko, vo=vo)
        else:
            o = o_c
        if state.decode_rounds and comp:
            need = length >= state.trigger

            def compress(args):
                return self._compress(state, *args, state.decode_rounds, need)

            kk, vv, n, length = jax.lax.cond(jnp.any(need), compress, lambda args: args, (kk, vv, n, length))
        return o.reshape(b, hq, d), new.replace(k=kk, v=vv, n=n, length=length)

    def memory_bytes(self, state: ChelseaState) -> int:
        """Every leaf: compressed K/V, counts, lengths, and the full-size outlier buffers."""
        return tree_bytes(state)

    def bytes_read_per_step(self, state: ChelseaState, num_heads: int) -> int:
        return tree_bytes(state)  # TODO(helper): live-slot block plan

    def tokens_held(self, state: ChelseaState):
        """``[B]`` occupied slots (merged clusters count once), mean over all KV heads incl. outlier heads."""
        return jnp.sum(state.n > 0, axis=-1).mean(axis=-1).astype(jnp.float32)

    def held(self, n: int, steps: int, layer: int = 0, num_layers: int = 1) -> int:
        return n + steps  # TODO(helper): B = R (n + Gamma)


def _heads(x, heads: tuple) -> jnp.ndarray:
    """Select KV heads (axis 1) by a static index tuple; identity when it is all of them in order."""
    if tuple(heads) == tuple(range(x.shape[1])):
        return x
    return x[:, np.asarray(heads, np.int32)]
