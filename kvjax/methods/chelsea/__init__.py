"""``chelsea``: KV-cache clustering by Chunked Soft Matching (Hu et al., 2025, arXiv:2506.11418).

Algorithm 1 at fixed shapes: the prompt is merged to ``B_b`` slots per compressed KV head by rounds of chunked
soft matching (:mod:`kvjax.methods.chelsea.csm`); decode appends with count 1, attends with the ``log N`` bias (Eq. 2)
and merges back to ``B_b`` every ``g`` steps; outlier heads (§5.4) keep their full cache. Resolutions of what the
paper leaves open follow ``docs/notes/chelsea.md`` (A-numbers).

The method's parts, each a module of pure functions: :mod:`~kvjax.methods.chelsea.budget` (``B_b``, the windows a
short prompt leaves, the slots held), :mod:`~kvjax.methods.chelsea.schedule` (the ratio schedule and the host
plans of the rounds), :mod:`~kvjax.methods.chelsea.merge` (one Chelsea call: the rounds at fixed shapes),
:mod:`~kvjax.methods.chelsea.outliers` (which heads keep their full cache) and
:mod:`~kvjax.methods.chelsea.attend` (a decode step's attention and what it reads). This module holds the state
and the :class:`Chelsea` method that ties them together.

Shapes (:class:`ChelseaState`, per layer): k, v ``[B, Hc, S, D]`` with ``S = min(B_max + g, bucket + Gamma)``;
n ``[B, Hc, S]`` float32 counts (0 = empty slot); target, seen, length ``[B]`` int32; ko, vo ``[B, O, n + Gamma,
D]`` for the layer's outlier heads (zero-size when none). GQA native: the query heads of a group share their KV
head's clusters (A10).

How each step follows the paper (budget, short prompts, prefill rounds, the decode-time merge without a copy,
outlier heads, int32 exactness): ``docs/methods/chelsea.md``, "From the paper to the code".
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from flax import struct

from kernels_pallas.checks import check_int
from kvjax.budget import warn_full_attention
from kvjax.methods.chelsea import (
    attend as chelsea_attend,
    budget as chelsea_budget,
    merge as chelsea_merge,
    outliers as chelsea_outliers,
    schedule as chelsea_schedule,
)
from kvjax.methods.base import Capacity, check_budget, LayerContext, Method, slot_axes, tree_bytes
from kvjax.methods.chelsea.outliers import load_outlier_file, select_heads
from kvjax.methods.chelsea.schedule import PRESETS
from kvjax.methods.chelsea.csm import Round

#: The public names, some re-exported from the parts.
__all__ = ["Chelsea", "ChelseaState", "PRESETS", "load_outlier_file"]


@struct.dataclass
class ChelseaState:
    k: jnp.ndarray  # [B, Hc, S, D] compressed heads
    v: jnp.ndarray
    n: jnp.ndarray  # [B, Hc, S] float32 cluster counts, 0 = empty
    length: jnp.ndarray  # [B] int32 occupied slots of the compressed heads
    ko: jnp.ndarray  # [B, O, F, D] outlier heads, full cache (F = n + Gamma); O may be 0
    vo: jnp.ndarray
    target: jnp.ndarray  # [B] int32 B_b: slots per compressed head after a Chelsea call (trigger B_b + g)
    seen: jnp.ndarray  # [B] int32 tokens seen (prompt + decoded), what each outlier head holds
    rule: tuple = struct.field(pytree_node=False, default=())  # Chelsea.rule: how B_b follows from n
    gamma: int = struct.field(pytree_node=False, default=0)  # max_new_tokens
    budget_max: int = struct.field(pytree_node=False, default=0)  # largest B_b in this bucket
    prefill_rounds: tuple = struct.field(pytree_node=False, default=())
    decode_rounds: tuple = struct.field(pytree_node=False, default=())
    per_seq_windows: bool = struct.field(pytree_node=False, default=False)
    comp_heads: tuple = struct.field(pytree_node=False, default=())
    out_heads: tuple = struct.field(pytree_node=False, default=())


@dataclasses.dataclass(frozen=True, eq=False)
class Chelsea(Method):
    """Chelsea config (static). ``schedule``: a ``PRESETS`` name or ``(r_init, alpha, m)``."""

    name: ClassVar[str] = "chelsea"
    why_no_decode_budget: ClassVar[str] = (  # base.Method.why_no_decode_budget
        "chelsea already bounds decode: it re-compresses to its budget every `interval` steps."
    )
    step_kernels: ClassVar[tuple[str, ...]] = ("chunk_best_match", "decode_attention")  # base.Method.step_kernels
    traced_layer: ClassVar[bool] = True  # scan over layers (base.Method.traced_layer)
    recompresses: ClassVar[bool] = True  # a merge round every `interval` steps (base.Method.recompresses)
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
            check_int(name, getattr(self, name), at_least=0)
        check_int("interval", self.interval, "g")
        chelsea_schedule.check_schedule(self.schedule, self.r_floor)
        if self.impl not in (None, "xla", "pallas_tpu", "pallas_gpu"):
            raise ValueError(f"impl={self.impl!r} must be 'xla', 'pallas_tpu', 'pallas_gpu' or None")
        if not isinstance(self.outlier_heads, (str, tuple)):
            raise ValueError(
                f"outlier_heads={self.outlier_heads!r} must be a JSON path (str) or a tuple of (layer, kv_head) pairs"
            )
        if isinstance(self.outlier_heads, str) and self.outlier_heads:
            load_outlier_file(self.outlier_heads)  # a missing or foreign file fails here, not at the first prefill

    # ---- static planning (host side: chelsea_budget, chelsea_schedule, chelsea_outliers) -------------------

    def ratio(self, i: int) -> float:
        """Ratio of CSM round ``i`` of a call (App. C.2): ``max(r_init - alpha min(m, i), r_floor)``."""
        return chelsea_schedule.ratio(self.schedule, self.r_floor, i)

    def outliers(self, model_cfg) -> frozenset:
        """The ``(layer, kv_head)`` pairs that keep their full cache, checked against the model
        (:func:`~kvjax.methods.chelsea.outliers.outlier_pairs`)."""
        return chelsea_outliers.outlier_pairs(self.outlier_heads, model_cfg)

    def rule(self, model_cfg=None) -> tuple:
        """The static per-head budget rule of the compressed heads (:func:`~kvjax.methods.chelsea.budget.rule`):
        ``("frac", p, q)``, ``("count", c, H, O)`` or ``("all",)``; with outlier heads and ``reallocate`` the
        others pay for them (A12)."""
        if model_cfg is None:  # the rule needs the model only to count and reallocate outlier heads
            if self.outlier_heads:
                raise ValueError(
                    "a Chelsea with outlier heads needs model_cfg= (the reallocated budget depends on "
                    "the model's head counts)"
                )
            total_heads, n_out = 1, 0
        else:
            total_heads = model_cfg.num_layers * model_cfg.num_kv_heads
            n_out = len(self.outliers(model_cfg)) if self.reallocate else 0
        return chelsea_budget.rule(self.budget, total_heads, n_out)

    def target(self, rule: tuple, n, gamma: int):
        """``B_b``: slots per compressed KV head (sinks and recent included) of a sequence with an ``n``-token
        prompt (Python int, numpy or traced int32 array ``[B]``), at least 1
        (:func:`~kvjax.methods.chelsea.budget.target`)."""
        return chelsea_budget.target(rule, n, gamma)

    def windows(self, target):
        """Sinks and recent window ``(n_sink_b, n_recent_b)`` under a budget ``target``
        (:func:`~kvjax.methods.chelsea.budget.windows`). Ints, numpy or jnp arrays."""
        return chelsea_budget.windows(self.n_sink, self.n_recent, target)

    def needs_per_seq_windows(self, rule: tuple, gamma: int) -> bool:
        """Does some compressing prompt length have a budget of at most ``n_sink + n_recent``
        (:func:`~kvjax.methods.chelsea.budget.needs_per_seq_windows`)?"""
        return chelsea_budget.needs_per_seq_windows(rule, gamma, self.n_sink, self.n_recent, self.interval)

    def ratio_table(self) -> tuple[int, ...]:
        """Quantised ratios of rounds ``0..m`` (round ``i`` uses entry ``min(i, m)``)."""
        return chelsea_schedule.ratio_table(self.schedule, self.r_floor)

    def budget_tokens(self, model_cfg, capacity: Capacity, n: int | None = None) -> int:
        """``B`` of an ``n``-token prompt (default: a bucket-length one, ``B_max`` for a fraction)."""
        n = capacity.prompt_len if n is None else n
        return self.target(self.rule(model_cfg), n, capacity.max_new_tokens)

    def sizes(self, model_cfg, capacity: Capacity):
        """Static ``(B_max, slots S, prefill rounds, decode rounds, per_seq_windows)`` for this capacity.

        ``B_max`` is the largest budget of any prompt length in the bucket; ``S = min(B_max + g, bucket +
        Gamma)``. The round plans are worst cases over every prompt length ``0..bucket``
        (:func:`~kvjax.methods.chelsea.schedule.round_plans`). The scan path only takes ``max_merges`` from them
        (its ``while_loop`` stops when every sequence is at its budget); ``unroll_rounds=True`` runs them as
        listed. ``per_seq_windows``: some compressing prompt may need sinks/recent shrunk
        (:meth:`needs_per_seq_windows`)."""
        rule = self.rule(model_cfg)
        gamma, g = capacity.max_new_tokens, self.interval
        ns_all = np.arange(capacity.prompt_len + 1, dtype=np.int64)
        tgt = self.target(rule, ns_all, gamma)
        b_max = int(tgt.max())
        slots = min(b_max + g, capacity.prompt_len + gamma)
        if rule[0] == "all":
            return b_max, slots, (), (), False
        sink, recent = self.windows(tgt)
        pre, dec = chelsea_schedule.round_plans(ns_all, tgt, sink, recent, self.ratio_table(), g, gamma, slots)
        return b_max, slots, pre, dec, self.needs_per_seq_windows(rule, gamma)

    # ---- the method interface --------------------------------------------------------------------------

    def attends_everything(self, model_cfg, capacity: Capacity, layer: int = 0) -> bool:
        """No merge round runs for any prompt of the bucket, at prefill or while decoding (base.Method)."""
        _, _, pre, dec, _ = self.sizes(model_cfg, capacity)
        return not pre and not dec

    def init(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> ChelseaState:
        b_max, slots, pre, dec, per_seq = self.sizes(model_cfg, capacity)
        warn_full_attention(self, model_cfg, capacity, [layer])
        comp, out = chelsea_outliers.layer_heads(self.outliers(model_cfg), layer, model_cfg.num_kv_heads)
        d = model_cfg.head_dim
        full = capacity.prompt_len + capacity.max_new_tokens
        return ChelseaState(
            k=jnp.zeros((batch, len(comp), slots, d), dtype),
            v=jnp.zeros((batch, len(comp), slots, d), dtype),
            n=jnp.zeros((batch, len(comp), slots), jnp.float32),
            length=jnp.zeros((batch,), jnp.int32),
            ko=jnp.zeros((batch, len(out), full if out else 0, d), dtype),
            vo=jnp.zeros((batch, len(out), full if out else 0, d), dtype),
            target=jnp.zeros((batch,), jnp.int32),
            seen=jnp.zeros((batch,), jnp.int32),
            rule=self.rule(model_cfg),
            gamma=capacity.max_new_tokens,
            budget_max=b_max,
            prefill_rounds=pre,
            decode_rounds=dec,
            per_seq_windows=per_seq,
            comp_heads=tuple(comp),
            out_heads=tuple(out),
        )

    def _compress(self, state: ChelseaState, k, v, n, length, rounds: tuple[Round, ...], active):
        """One Chelsea call (§5.1) for the elements with ``active [B]``: CSM rounds until every active element
        holds at most its budget ``state.target`` (:func:`~kvjax.methods.chelsea.merge.compress`; sinks and
        recent per sequence when ``state.per_seq_windows``)."""
        target = state.target
        if state.per_seq_windows:
            ns, nr = self.windows(target)
        else:
            ns, nr = self.n_sink, self.n_recent
        opts = dict(ns=ns, nr=nr, chunk=self.chunk, impl=self.impl, unroll=self.unroll_rounds)
        table = None if self.unroll_rounds else self.ratio_table()
        return chelsea_merge.compress(k, v, n, length, target, active, rounds, table=table, **opts)

    def prefill(self, state: ChelseaState, layer: int, q, k, v, lengths, previous=None) -> ChelseaState:
        """Store the prompt ``k, v [B, Hkv, T, D]`` (``lengths [B]``) and compress every sequence with
        ``n >= B_b + g`` to its ``B_b`` (Alg. 1)."""
        b, _, t, _ = k.shape
        comp, out = state.comp_heads, state.out_heads
        kc, vc = select_heads(k, comp), select_heads(v, comp)
        n = jnp.broadcast_to((jnp.arange(t)[None, :] < lengths[:, None])[:, None, :], (b, len(comp), t))
        n = n.astype(jnp.float32)
        kc, vc = kc.astype(state.k.dtype), vc.astype(state.v.dtype)
        length = lengths.astype(jnp.int32)
        target = self.target(state.rule, length, state.gamma)
        state = state.replace(target=target, seen=length)
        if comp and state.prefill_rounds:
            kc, vc, n, length = self._compress(
                state, kc, vc, n, length, state.prefill_rounds, length >= target + self.interval
            )
        slots = state.k.shape[2]
        have = kc.shape[2]
        if have < slots:
            pad = ((0, 0), (0, 0), (0, slots - have))
            kc, vc, n = jnp.pad(kc, pad + ((0, 0),)), jnp.pad(vc, pad + ((0, 0),)), jnp.pad(n, pad)
        else:  # occupancy <= slots (every compressed sequence holds B_b <= B_max, the others n < B_b + g)
            kc, vc, n = kc[:, :, :slots], vc[:, :, :slots], n[:, :, :slots]
        new = state.replace(k=kc, v=vc, n=n, length=length)
        if out:
            new = new.replace(
                ko=state.ko.at[:, :, :t].set(select_heads(k, out).astype(state.ko.dtype)),
                vo=state.vo.at[:, :, :t].set(select_heads(v, out).astype(state.vo.dtype)),
            )
        return new

    def decode(self, state: ChelseaState, layer: int, q, k, v, pos):
        """Append ``k, v [B, Hkv, D]``, attend over the live slots with the ``log N`` bias (Eq. 2), compress a
        sequence back to ``B_b`` when it reaches ``B_b + g`` (:mod:`~kvjax.methods.chelsea.attend`,
        :mod:`~kvjax.methods.chelsea.merge`). q ``[B, Hq, D]``, pos ``[B]``."""
        b, hq, d = q.shape
        hkv = k.shape[1]
        comp, out = state.comp_heads, state.out_heads
        q4 = q.reshape(b, hkv, hq // hkv, d)
        kk, vv, n, length = chelsea_attend.append(state.k, state.v, state.n, state.length, k, v, comp)
        o, part = chelsea_attend.attend_merged(q4, kk, vv, n, length, comp)
        new = state.replace(seen=(pos + 1).astype(jnp.int32))
        if out:
            o_o, ko, vo = chelsea_attend.attend_outliers(q4, state.ko, state.vo, k, v, pos, out)
            o = chelsea_attend.join_heads(o, o_o, comp, out)
            new = new.replace(ko=ko, vo=vo)
        if state.decode_rounds and comp:
            need = length >= state.target + self.interval
            length = chelsea_merge.after(length, part)
            kk, vv, n, length = self._compress(state, kk, vv, n, length, state.decode_rounds, need)
        return o.reshape(b, hq, d), new.replace(k=kk, v=vv, n=n, length=length)

    def state_axes(self, state: ChelseaState):
        """Batch- and head-major; the slot buffer (base.Method.state_axes): the compressed heads' merged slots (K, V,
        counts); the outlier heads' full caches count as fixed."""
        return slot_axes(state, "k", "v", "n")

    def memory_bytes(self, state: ChelseaState) -> int:
        """Every leaf: compressed K/V, counts, lengths, budgets, and the full-size outlier buffers."""
        return tree_bytes(state)

    def held_overhead_bytes(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> int:
        """Beyond the budget, the compressed heads hold the merge interval's ``g`` slots (a call runs when the cache
        reaches ``B_b + g``), the decode slots and one of rounding, each with its float32 count; the outlier heads
        keep their full cache."""
        out = chelsea_outliers.in_layer(self.outliers(model_cfg), layer)
        row = 2 * model_cfg.head_dim * jnp.dtype(dtype).itemsize
        comp = batch * (model_cfg.num_kv_heads - out) * (row + 4)
        return (self.interval + capacity.max_new_tokens + 1) * comp + batch * out * (
            capacity.prompt_len + capacity.max_new_tokens
        ) * row

    def bytes_read_per_step(self, state: ChelseaState, num_heads: int) -> int:
        """Bytes one decode step of this layer reads under the decode-attention kernel's block plan: the live
        compressed slots (K, V and the ``log N`` mask) and the outlier heads' live prefix, plus queries and outputs
        (:func:`~kvjax.methods.chelsea.attend.read_bytes`). ``num_heads``: the model's query heads."""
        return chelsea_attend.read_bytes(state.k, state.length, state.ko, state.seen, num_heads)

    def tokens_held(self, state: ChelseaState):
        """``[B]`` occupied slots (merged clusters count once), mean over all KV heads of the layer: compressed
        heads hold their occupied slots, outlier heads every token seen (``n + steps``)."""
        hc, ho = state.k.shape[1], state.ko.shape[1]
        comp = jnp.sum(jnp.sum(state.n > 0, axis=-1), axis=-1).astype(jnp.float32)
        return ((comp + ho * state.seen.astype(jnp.float32)) / (hc + ho)).astype(jnp.float32)

    def min_budget(self) -> tuple[int, str]:
        return (
            self.n_sink + self.n_recent + 1,
            f"n_sink={self.n_sink} + n_recent={self.n_recent} + at least one merged middle slot",
        )

    def kept_tokens(self, n: int, max_new_tokens: int = 0, model_cfg=None) -> int:
        """``B``: slots per compressed KV head, ``floor(R (n + max_new_tokens))`` (:meth:`target`)."""
        if self.outlier_heads and model_cfg is None:
            return super().kept_tokens(n, max_new_tokens)
        return int(self.target(self.rule(model_cfg), int(n), max_new_tokens))

    def held(self, n: int, steps: int, ctx: LayerContext = LayerContext()) -> int:
        """Slots a compressed KV head of a sequence with an ``n``-token prompt holds after ``steps`` decode
        steps (exact host simulation of Alg. 1, :func:`~kvjax.methods.chelsea.budget.held_slots`), ``B =
        floor(R (n + Gamma))`` with ``Gamma = ctx.capacity.max_new_tokens`` (no capacity: ``steps``). Outlier
        heads need ``ctx.model_cfg`` (their reallocated budget depends on the head counts); the result is then the
        mean over the KV heads of ``ctx.layer`` (outlier heads hold ``n + steps``), like :meth:`tokens_held`."""
        gamma = steps if ctx.capacity is None else ctx.capacity.max_new_tokens
        model_cfg = ctx.model_cfg
        rule = self.rule(model_cfg)
        comp = chelsea_budget.held_slots(rule, self.target(rule, n, gamma), n, steps, self.interval)
        if model_cfg is None:
            return int(comp)
        out = chelsea_outliers.in_layer(self.outliers(model_cfg), ctx.layer)
        return chelsea_budget.mean_held(comp, n + steps, out, model_cfg.num_kv_heads)
