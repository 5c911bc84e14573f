"""``chelsea``: KV-cache clustering by Chunked Soft Matching (Hu et al., 2025, arXiv:2506.11418).

Algorithm 1 at fixed shapes: the prompt is merged to ``B_b`` slots per compressed KV head by rounds of chunked
soft matching (:mod:`kvjax.methods.csm`); decode appends with count 1, attends with the ``log N`` bias (Eq. 2)
and merges back to ``B_b`` every ``g`` steps; outlier heads (§5.4) keep their full cache. Resolutions of what the
paper leaves open follow ``docs/notes/chelsea.md`` (A-numbers).

Shapes (:class:`ChelseaState`, per layer): k, v ``[B, Hc, S, D]`` with ``S = min(B_max + g, bucket + Gamma)``;
n ``[B, Hc, S]`` float32 counts (0 = empty slot); target, seen, length ``[B]`` int32; ko, vo ``[B, O, n + Gamma,
D]`` for the layer's outlier heads (zero-size when none). GQA native: the query heads of a group share their KV
head's clusters (A10).

How each step follows the paper (budget, short prompts, prefill rounds, the decode-time merge without a copy,
outlier heads, int32 exactness): ``docs/methods/chelsea.md``, "From the paper to the code".
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from fractions import Fraction
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kernels_pallas.checks import check_int
from kernels_pallas.decode_attention import block_plan_bytes
from kvjax.model import attention
from kvjax.budget import as_fraction, floor_fraction, floor_mul
from kvjax.budget import warn_full_attention
from kvjax.methods.base import Capacity, check_budget, LayerContext, Method, rows_at, slot_axes, tree_bytes
from kvjax.methods.csm import Round, csm_round, merges_for, quantise_ratio

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


def load_outlier_file(path: str) -> dict:
    """Read a calibration JSON written by ``kvjax calibrate-chelsea``. The file is read on every call (it is
    small) and its parse cached by content, so a file edited or rewritten in place is used as it is now, even
    within the same second and at the same size (an mtime/size key could miss that)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"outlier_heads={path!r}: no such file; run `kvjax calibrate-chelsea --model ... "
            "--out PATH` first, or pass a tuple of (layer, kv_head) pairs"
        )
    return _parse_outlier_file(p.read_text(), path)


@functools.lru_cache(maxsize=32)
def _parse_outlier_file(text: str, path: str) -> dict:
    data = json.loads(text)
    if "outlier_heads" not in data:
        raise ValueError(f"outlier_heads={path!r} has no 'outlier_heads' entry; it is not a calibration file")
    return data


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
        if isinstance(self.schedule, str) and self.schedule not in PRESETS:
            raise ValueError(
                f"schedule={self.schedule!r} is not a preset; choose one of {sorted(PRESETS)} or pass "
                "(r_init, alpha, m)"
            )
        if not isinstance(self.schedule, str):
            if not (isinstance(self.schedule, tuple) and len(self.schedule) == 3):
                raise ValueError(f"schedule={self.schedule!r} must be a preset name or a tuple (r_init, alpha, m)")
            r_init, alpha, m = self.schedule
            if not 0.0 < r_init <= 0.5:
                raise ValueError(
                    f"schedule r_init={r_init} must be in (0, 0.5]: one CSM round removes at most "
                    "half of the middle (§5.1)"
                )
            if alpha < 0 or not isinstance(m, int) or m < 0:
                raise ValueError(f"schedule alpha={alpha}, m={m!r} must be alpha >= 0 and an integer m >= 0")
        if not 0.0 < self.r_floor <= 0.5:
            raise ValueError(f"r_floor={self.r_floor} must be in (0, 0.5] (the ratio must stay > 0, App. C.2)")
        if self.impl not in (None, "xla", "pallas_tpu", "pallas_gpu"):
            raise ValueError(f"impl={self.impl!r} must be 'xla', 'pallas_tpu', 'pallas_gpu' or None")
        if not isinstance(self.outlier_heads, (str, tuple)):
            raise ValueError(
                f"outlier_heads={self.outlier_heads!r} must be a JSON path (str) or a tuple of (layer, kv_head) pairs"
            )
        if isinstance(self.outlier_heads, str) and self.outlier_heads:
            load_outlier_file(self.outlier_heads)  # a missing or foreign file fails here, not at the first prefill

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
                    raise ValueError(
                        f"outlier_heads={self.outlier_heads!r} was calibrated for {key}={data[key]} "
                        f"but the model has {want}; recalibrate for this model"
                    )
            pairs = data["outlier_heads"]
        else:
            pairs = self.outlier_heads
        out = set()
        for pair in pairs:
            layer, head = (int(x) for x in pair)
            if not (0 <= layer < model_cfg.num_layers and 0 <= head < model_cfg.num_kv_heads):
                raise ValueError(
                    f"outlier head {tuple(pair)} is outside the model ({model_cfg.num_layers} layers, "
                    f"{model_cfg.num_kv_heads} KV heads)"
                )
            out.add((layer, head))
        return frozenset(out)

    def rule(self, model_cfg=None) -> tuple:
        """The static per-head budget rule of the compressed heads (host side, exact integers):

        - ``("frac", p, q)``: ``B = floor(p (n + Gamma) / q)``; ``p/q`` is ``R`` (:func:`kvjax.budget.as_fraction`)
          or, with outlier heads and ``reallocate``, ``R_c = (R H - O) / (H - O)`` (A12). ``R_c`` is used exactly
          when its denominator is at most ``MAX_DENOMINATOR`` (10000), else rounded *down* to the 1/10000 grid so
          that ``floor_mul`` stays inside int32 and the budget stays a ceiling;
        - ``("count", c, H, O)``: ``B = c`` (no outliers) or ``floor((c H - O (n + Gamma)) / (H - O))``;
        - ``("all",)``: every KV head is an outlier head: nothing is compressed.
        """
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
        if n_out >= total_heads:
            return ("all",)
        if isinstance(self.budget, float):
            p, q = as_fraction(self.budget)
            if n_out:
                rc = Fraction(p * total_heads - q * n_out, q * (total_heads - n_out))
                if rc <= 0:
                    raise ValueError(
                        f"budget={self.budget} cannot pay for {n_out} full-cache outlier heads of "
                        f"{total_heads} (reallocated fraction {float(rc):.4f} <= 0); raise the budget, "
                        "drop outlier heads or set reallocate=False"
                    )
                p, q = floor_fraction(rc)
                if p <= 0:
                    raise ValueError(
                        f"budget={self.budget}: the reallocated fraction for {n_out} outlier heads "
                        "rounds to 0; raise the budget or set reallocate=False"
                    )
            return ("frac", p, q)
        return ("count", int(self.budget), total_heads, n_out)

    def target(self, rule: tuple, n, gamma: int):
        """``B_b``: slots per compressed KV head (sinks and recent included) of a sequence with an ``n``-token
        prompt (Python int, numpy or traced int32 array ``[B]``), at least 1 (see the module docstring)."""
        full = n + gamma
        if rule[0] == "all":
            t = full
        elif rule[0] == "frac":
            t = floor_mul(full, rule[1], rule[2])
        else:
            c, h, o = rule[1:]
            if o:  # B falls as n grows and is < 1 (clamped to 1) from n + Gamma > c h / o on: clip there first,
                # so that o (n + Gamma) <= c h + o stays inside int32 when traced (c h is a host constant)
                mn = min if isinstance(full, int) else (np.minimum if isinstance(full, np.ndarray) else jnp.minimum)
                full = mn(full, c * h // o + 1)
            t = c if not o else (c * h - o * full) // (h - o)
        if isinstance(n, int):
            return max(t, 1)
        if isinstance(n, np.ndarray):
            return np.broadcast_to(np.maximum(t, 1), n.shape).astype(np.int64)
        return jnp.broadcast_to(jnp.maximum(t, 1), jnp.shape(n)).astype(jnp.int32)

    def windows(self, target):
        """Sinks and recent window ``(n_sink_b, n_recent_b)`` under a budget ``target``: the configured ones when
        ``target > n_sink + n_recent``, else shrunk to fit ``target - 1`` slots, the recent window first (the
        middle keeps at least one slot, so every round can merge). Ints, numpy or jnp arrays."""
        mn = np.minimum if isinstance(target, np.ndarray) else (min if isinstance(target, int) else jnp.minimum)
        nr = mn(self.n_recent, target - 1)
        ns = mn(self.n_sink, target - 1 - nr)
        return ns, nr

    def needs_per_seq_windows(self, rule: tuple, gamma: int) -> bool:
        """Does any prompt length (of any bucket) that compresses, in prefill or decode, have a budget of at most
        ``n_sink + n_recent``? Decided from the config and ``Gamma`` only, never from the bucket, so that the same
        prompt takes the same code path (and gives bit-identical merges) in every bucket."""
        k, g = self.n_sink + self.n_recent, self.interval
        if rule[0] == "all":
            return False
        if rule[0] == "count":
            return rule[3] > 0 or rule[1] <= k  # with outliers B_b falls as n grows: assume it may
        n_star = -(-(k + 1) * rule[2] // rule[1])  # B(n) > k for every n >= n_star (B is non-decreasing in n)
        ns = np.arange(n_star + 1, dtype=np.int64)
        tgt = self.target(rule, ns, gamma)
        active = (ns >= tgt + g) | (tgt + g <= ns + gamma - 1)
        return bool(np.any(active & (tgt <= k)))

    def ratio_table(self) -> tuple[int, ...]:
        """Quantised ratios of rounds ``0..m`` (round ``i`` uses entry ``min(i, m)``)."""
        m = (PRESETS[self.schedule] if isinstance(self.schedule, str) else self.schedule)[2]
        return tuple(quantise_ratio(self.ratio(i)) for i in range(m + 1))

    def budget_tokens(self, model_cfg, capacity: Capacity, n: int | None = None) -> int:
        """``B`` of an ``n``-token prompt (default: a bucket-length one, ``B_max`` for a fraction)."""
        n = capacity.prompt_len if n is None else n
        return self.target(self.rule(model_cfg), n, capacity.max_new_tokens)

    def sizes(self, model_cfg, capacity: Capacity):
        """Static ``(B_max, slots S, prefill rounds, decode rounds, per_seq_windows)`` for this capacity.

        ``B_max`` is the largest budget of any prompt length in the bucket; ``S = min(B_max + g, bucket +
        Gamma)``. The round plans are worst cases over every prompt length ``0..bucket`` (host simulation of the
        exact traced arithmetic): round ``i``'s largest merge count and (prefill) the largest occupancy any
        sequence has after it. The scan path only takes ``max_merges`` from them (its ``while_loop`` stops when
        every sequence is at its budget); ``unroll_rounds=True`` runs them as listed. ``per_seq_windows``: some
        compressing prompt may need sinks/recent shrunk (:meth:`needs_per_seq_windows`)."""
        rule = self.rule(model_cfg)
        gamma, g = capacity.max_new_tokens, self.interval
        ns_all = np.arange(capacity.prompt_len + 1, dtype=np.int64)
        tgt = self.target(rule, ns_all, gamma)
        b_max = int(tgt.max())
        slots = min(b_max + g, capacity.prompt_len + gamma)
        if rule[0] == "all":
            return b_max, slots, (), (), False
        sink, recent = self.windows(tgt)
        table = self.ratio_table()
        pre_active = ns_all >= tgt + g
        dec_active = tgt + g <= ns_all + gamma - 1  # reaches its trigger during decode (over-approximation)
        per_seq = self.needs_per_seq_windows(rule, gamma)
        pre = _simulate(ns_all, tgt, sink, recent, pre_active, table, idle=ns_all)
        dec = _simulate(tgt + g, tgt, sink, recent, dec_active, table, idle=0 * ns_all)
        dec = tuple(dataclasses.replace(r, out_slots=slots) for r in dec)
        return b_max, slots, pre, dec, per_seq

    # ---- the method interface --------------------------------------------------------------------------

    def attends_everything(self, model_cfg, capacity: Capacity, layer: int = 0) -> bool:
        """No merge round runs for any prompt of the bucket, at prefill or while decoding (base.Method)."""
        _, _, pre, dec, _ = self.sizes(model_cfg, capacity)
        return not pre and not dec

    def init(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> ChelseaState:
        b_max, slots, pre, dec, per_seq = self.sizes(model_cfg, capacity)
        warn_full_attention(self, model_cfg, capacity, [layer])
        out = sorted(h for (l, h) in self.outliers(model_cfg) if l == layer)
        comp = [h for h in range(model_cfg.num_kv_heads) if h not in out]
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
        holds at most its budget ``state.target``.

        Default (``unroll_rounds=False``): the rounds run as ``lax.while_loop``s over *levels* of shrinking size
        (:func:`_levels`): each level is one compiled round body at a static size that bounds every element's
        occupancy there (from the host plan ``rounds``), and runs its rounds until no active element is above
        its budget (round ``i`` uses the quantised ratio ``table[min(i, m)]``); the buffers are then cut to the
        next level's size. So a round costs what the cache holds at that point (a prefill call from ``n`` slots
        costs about ``2 n`` slot-rounds instead of ``rounds x n``), with a handful of compiles; the last level
        runs until every element is done (a shorter prompt has a smaller budget and may need more rounds). A
        decode call is one level at the cache size. ``unroll_rounds=True`` runs the static worst-case plan at
        shrinking sizes instead: the same merges (top-k is sorted and stable, so the first m of a larger top-k
        are the top m; surplus rounds merge nothing), one compile per round.
        """
        target = state.target
        if state.per_seq_windows:
            ns, nr = self.windows(target)
        else:
            ns, nr = self.n_sink, self.n_recent
        if self.unroll_rounds:
            for rnd in rounds:
                m = jnp.where(active, merges_for(length, target, ns, nr, rnd.r_q), 0)
                k, v, n = csm_round(
                    k,
                    v,
                    n,
                    length,
                    m,
                    n_sink=ns,
                    n_recent=nr,
                    chunk=self.chunk,
                    max_merges=rnd.max_merges,
                    out_slots=rnd.out_slots,
                    impl=self.impl,
                )
                length = length - m
            return k, v, n, length
        table = self.ratio_table()
        r_tab = jnp.asarray(table, jnp.int32)
        length = length.astype(jnp.int32)
        size_in = k.shape[2]
        levels = _levels(rounds, size_in)
        i = jnp.int32(0)
        for li, (first, end, size, kmax) in enumerate(levels):
            last = li == len(levels) - 1
            if size < k.shape[2]:  # every element holds at most `size` slots here (host plan bound)
                k, v, n = k[:, :, :size], v[:, :, :size], n[:, :, :size]

            def cond(carry, end=end, last=last):
                more = jnp.any(active & (carry[4] > target))
                return more if last else more & (carry[0] < end)

            def body(carry, kmax=kmax):
                i, k, v, n, length = carry
                r_q = r_tab[jnp.minimum(i, len(table) - 1)]
                m = jnp.where(active, merges_for(length, target, ns, nr, r_q), 0)
                k, v, n = csm_round(
                    k,
                    v,
                    n,
                    length,
                    m,
                    n_sink=ns,
                    n_recent=nr,
                    chunk=self.chunk,
                    max_merges=kmax,
                    out_slots=k.shape[2],
                    impl=self.impl,
                )
                return i + 1, k, v, n, (length - m).astype(jnp.int32)

            i, k, v, n, length = jax.lax.while_loop(cond, body, (i, k, v, n, length))
        return k, v, n, length

    def prefill(self, state: ChelseaState, layer: int, q, k, v, lengths, previous=None) -> ChelseaState:
        """Store the prompt ``k, v [B, Hkv, T, D]`` (``lengths [B]``) and compress every sequence with
        ``n >= B_b + g`` to its ``B_b`` (Alg. 1)."""
        b, _, t, _ = k.shape
        comp, out = state.comp_heads, state.out_heads
        kc, vc = _heads(k, comp), _heads(v, comp)
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
                ko=state.ko.at[:, :, :t].set(_heads(k, out).astype(state.ko.dtype)),
                vo=state.vo.at[:, :, :t].set(_heads(v, out).astype(state.vo.dtype)),
            )
        return new

    def decode(self, state: ChelseaState, layer: int, q, k, v, pos):
        """Append ``k, v [B, Hkv, D]``, attend over the live slots with the ``log N`` bias (Eq. 2), compress a
        sequence back to ``B_b`` when it reaches ``B_b + g``."""
        b, hq, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        comp, out = state.comp_heads, state.out_heads
        q4 = q.reshape(b, hkv, g, d)
        slot = jnp.broadcast_to(state.length[:, None], (b, len(comp)))
        kk = rows_at(state.k, slot, _heads(k, comp))
        vv = rows_at(state.v, slot, _heads(v, comp))
        n = rows_at(state.n, slot, 1.0)
        length = state.length + 1
        valid = n > 0
        bias = jnp.log(jnp.where(valid, n, 1.0))
        qc = _heads(q4, comp).reshape(b, len(comp) * g, d)
        if comp:
            part = attention.attend(qc, kk, vv, valid, bias=bias, lengths=length)
            o_c = attention.normalise(part, sinks=_head_sinks(comp, g)).reshape(b, len(comp), g, d)
        else:  # every KV head of this layer is an outlier head
            o_c = jnp.zeros((b, 0, g, d), jnp.float32)
        new = state.replace(seen=(pos + 1).astype(jnp.int32))
        if out:
            p = jnp.broadcast_to(pos[:, None], (b, len(out)))
            ko = rows_at(state.ko, p, _heads(k, out))
            vo = rows_at(state.vo, p, _heads(v, out))
            ovalid = jnp.broadcast_to(jnp.arange(ko.shape[2])[None, None, :] <= pos[:, None, None], ko.shape[:3])
            qo = _heads(q4, out).reshape(b, len(out) * g, d)
            o_o = attention.attend(qo, ko, vo, ovalid, lengths=(pos + 1).astype(jnp.int32))
            o_o = attention.normalise(o_o, sinks=_head_sinks(out, g))
            o_o = o_o.reshape(b, len(out), g, d)
            inv = np.argsort(np.asarray(comp + out))
            o = jnp.concatenate([o_c, o_o], axis=1)[:, inv]
            new = new.replace(ko=ko, vo=vo)
        else:
            o = o_c
        if state.decode_rounds and comp:
            need = length >= state.target + self.interval
            length = _after(length, part)
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
        out = sum(1 for (l, _) in self.outliers(model_cfg) if l == layer)
        row = 2 * model_cfg.head_dim * jnp.dtype(dtype).itemsize
        comp = batch * (model_cfg.num_kv_heads - out) * (row + 4)
        return (self.interval + capacity.max_new_tokens + 1) * comp + batch * out * (
            capacity.prompt_len + capacity.max_new_tokens
        ) * row

    def bytes_read_per_step(self, state: ChelseaState, num_heads: int) -> int:
        """Bytes one decode step of this layer reads under the decode-attention kernel's block plan: the live
        compressed slots ``[0, length)`` (K, V and the float32 additive mask carrying ``log N``) and the live
        prefix ``[0, seen)`` of the outlier heads (K, V, mask), plus queries and outputs. ``num_heads``: the
        model's query heads (split between the compressed and the outlier KV heads by GQA group)."""
        hc, ho = state.k.shape[1], state.ko.shape[1]
        g = num_heads // (hc + ho)
        total = 0
        if hc:
            total += block_plan_bytes(state.k, state.length, num_heads=hc * g, with_mask=True)
        if ho:
            total += block_plan_bytes(state.ko, state.seen, num_heads=ho * g, with_mask=True)
        return int(total)

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
        steps (exact host simulation of Alg. 1): ``n + steps`` while it has not reached its trigger ``B + g``,
        ``B`` right after every Chelsea call, ``B + (steps since the call)`` in between (always ``< B + g``).
        ``B = floor(R (n + Gamma))`` with ``Gamma = ctx.capacity.max_new_tokens`` (no capacity: ``steps``).
        Outlier heads need ``ctx.model_cfg`` (their reallocated budget depends on the head counts); the result is
        then the mean over the KV heads of ``ctx.layer`` (outlier heads hold ``n + steps``), like
        :meth:`tokens_held`."""
        gamma = steps if ctx.capacity is None else ctx.capacity.max_new_tokens
        model_cfg, layer = ctx.model_cfg, ctx.layer
        rule = self.rule(model_cfg)
        b = self.target(rule, n, gamma)
        trig, g = b + self.interval, self.interval
        total = n + steps
        if rule[0] == "all":
            comp = total
        elif n >= trig:
            comp = b + steps % g
        elif total < trig:
            comp = total
        else:
            comp = b + (total - trig) % g
        if model_cfg is None:
            return int(comp)
        out = sum(1 for (l, _) in self.outliers(model_cfg) if l == layer)
        h = model_cfg.num_kv_heads
        return int(math.floor((comp * (h - out) + total * out) / h))


def _simulate(start, target, sink, recent, active, table, idle) -> tuple[Round, ...]:
    """Host simulation (``merges_for`` on numpy int64) of one Chelsea call for every prompt length at once:
    ``Round(r_q, largest merge count, largest occupancy after the round)``; inactive elements keep their
    occupancy ``idle`` (so it bounds them too)."""
    s = np.where(active, start, idle).astype(np.int64)
    rounds, i = [], 0
    while np.any(active & (s > target)):
        r_q = table[min(i, len(table) - 1)]
        m = np.where(active, merges_for(s, target, sink, recent, r_q), 0)
        s = s - m
        rounds.append(Round(int(r_q), int(m.max()), int(s.max())))
        i += 1
    return tuple(rounds)


def _after(x, partial):
    """``x`` (an int32 array), unchanged, but computed from the attention ``partial``'s sum ``l``: a data dependency
    that orders the in-place compression after every read of the attention (``l`` is a sum of exponentials, never
    ``< 0``, so ``x + (l < 0)`` is ``x`` for every input, NaN included; XLA cannot prove it, so it keeps the order).
    Without it the attention's reads and the compression's writes are unordered and XLA copies the cache buffers
    on every step (:func:`Chelsea.decode`)."""
    flag = jnp.any(partial[2] < 0).astype(x.dtype)
    return x + flag


#: A new level of the round loop starts once the plan's occupancy bound has fallen to this fraction of the
#: current level's size (smaller: fewer compiles, more work per round).
LEVEL_SHRINK = 0.7


def _levels(rounds: tuple[Round, ...], size_in: int) -> list[tuple[int, int, int, int]]:
    """Group the host plan's rounds into levels ``(first round, end round, slots, max merges)``: a level's slots
    bound every element's occupancy when it starts (``size_in`` or the previous round's ``out_slots``); a new
    level starts when that bound has fallen to ``LEVEL_SHRINK`` of the current level's slots. The last level
    also covers any rounds past the plan (its loop runs until every element is done)."""
    levels, first, size = [], 0, size_in
    for i in range(1, len(rounds)):
        bound = rounds[i - 1].out_slots
        if bound <= LEVEL_SHRINK * size:
            levels.append((first, i, size, max(r.max_merges for r in rounds[first:i])))
            first, size = i, bound
    levels.append((first, max(len(rounds), first + 1), size, max((r.max_merges for r in rounds[first:]), default=0)))
    return levels


def _heads(x, heads: tuple) -> jnp.ndarray:
    """Select KV heads (axis 1) by a static index tuple; identity when it is all of them in order."""
    if tuple(heads) == tuple(range(x.shape[1])):
        return x
    return x[:, np.asarray(heads, np.int32)]


def _head_sinks(kv_heads, g: int):
    """The layer's attention sinks (:mod:`kvjax.model.sinks`) of the query heads of ``kv_heads`` (each KV head's ``g``
    query heads, in order), or None on a model without sinks."""
    from kvjax.model import sinks

    s = sinks.current()
    if s is None:
        return None
    return s[np.asarray([h * g + j for h in kv_heads for j in range(g)], np.int32)]
