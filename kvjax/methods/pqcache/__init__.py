"""``pqcache`` (Zhang et al., 2024, *PQCache*): product-quantized keys, top-k retrieval by PQ lookup.

A recall method: the full KV stays resident (it shrinks what each decode step *reads*, not what is stored).
Method note ``docs/notes/pqcache.md`` (§2.2-2.6, §8); paper §3.1 (PQ construction, decode retrieval,
new tokens), §3.3 (K-means at prefill).

Shapes (per layer): k, v ``[B, Hkv, S, D]`` (``S`` = prompt bucket + max_new_tokens, slot = position); codes
``[B, Hkv, m, S_c]`` uint8, sub-space-major: the layout the PQ-lookup kernels read (no per-step repack), with
``S_c`` = ``S`` rounded up to 32 (one bit word) on the XLA path, to ``CODE_ALIGN`` when a Pallas kernel does
the lookup; centroids ``[B, Hkv, m, 2^bits, D/m]`` float32; hist ``[B, Hkv, (2^bits)^m]`` int32 (``[B, Hkv,
0]`` without the table) counting the candidates ``[sink, hist_end)``; lengths (prompt), filled and hist_end
``[B]`` int32. Axes in einsums: b batch, h KV head, g query head in group, i sub-space, c centroid, d
sub-vector dim, s slot, u code tuple.

How each step follows the paper, the budget split, what a step reads and what is not reproduced:
``docs/methods/pqcache.md``, "From the paper to the code".
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kernels_pallas.checks import check_int
from kernels_pallas.decode_attention import block_plan_bytes
from kernels_pallas.pq_lookup import CODE_ALIGN, default_impl, pq_lookup
from kvjax.model import attention
from kvjax import sharding
from kvjax.budget import as_fraction, check_budget, floor_fraction, floor_mul, warn_full_attention
from kvjax.methods.pqcache import attend as pq_attend, index as pq_index, retrieval as pq_retrieval
from kvjax.methods.base import (
    Recalls,
    RECALL_NO_DECODE_BUDGET,
    attends_all_steps,
    slot_axes,
    Capacity,
    full_bytes,
    LayerContext,
    Method,
    rows_at,
    tree_bytes,
)
from kvjax.methods.core.offload import device_sharding, host_sharding
from kvjax.methods.pqcache.retrieval import WORD as _WORD

#: Largest denominator ``floor_mul`` takes exactly on int32 (``(n % q) p < q^2 < 2^31``).
_EXACT_Q = 46340
#: Tuple tables up to this many entries are used by default (m = 2 with bits <= 6, m = 1); ``score_table=True``
#: accepts up to ``_TABLE_MAX``.
_TABLE_AUTO = 1 << 13
_TABLE_MAX = 1 << 16


@struct.dataclass
class PQState:
    """Full KV plus the PQ index of one layer. ``window``/``topk``/``sink`` are the static maxima."""

    k: jnp.ndarray  # [B, Hkv, S, D]
    v: jnp.ndarray  # [B, Hkv, S, D]
    codes: jnp.ndarray  # [B, Hkv, m, S_c] uint8 (sub-space-major, S_c >= S, a multiple of 32)
    centroids: jnp.ndarray  # [B, Hkv, m, K, D/m] float32
    lengths: jnp.ndarray  # [B] int32 prompt lengths (0 before prefill)
    filled: jnp.ndarray  # [B] int32 slots written: prompt + decoded tokens
    hist: jnp.ndarray  # [B, Hkv, K^m] int32 candidates per code tuple ([B, Hkv, 0] without the table)
    hist_end: jnp.ndarray  # [B] int32: hist counts the candidates [sink, hist_end)
    sink: int = struct.field(pytree_node=False, default=0)
    window: int = struct.field(pytree_node=False, default=0)
    topk: int = struct.field(pytree_node=False, default=0)


def _int32_fraction(f: Fraction) -> tuple[int, int]:
    """``(p, q)`` of ``f`` in ``[0, 1]``, exact when ``q^2 < 2^31``, else rounded down to ``1/MAX_DENOMINATOR``."""
    return floor_fraction(f, _EXACT_Q)


@dataclasses.dataclass(frozen=True, eq=False)
class PQCache(Method, Recalls):
    name: ClassVar[str] = "pqcache"
    why_no_decode_budget: ClassVar[str] = RECALL_NO_DECODE_BUDGET  # base.Method.why_no_decode_budget
    step_kernels: ClassVar[tuple[str, ...]] = ("decode_attention", "pq_lookup")  # base.Method.step_kernels
    traced_layer: ClassVar[bool] = True  # scan over layers (base.Method.traced_layer)
    budget: float | int = 0.2  # r: fraction of the non-sink prompt tokens (local + retrieved), or a count
    m: int = 2  # sub-spaces
    bits: int = 6  # bits per code: 2^bits centroids per sub-space
    sink: int = 32  # initial tokens always attended
    local_ratio: float = 0.5  # share of the budget that is the local window
    iters: int = 10  # K-means (Lloyd) iterations
    seed: int = 4321  # init-row sampling seed (the authors' [code-HEAD] value)
    impl: str | None = None  # pq_lookup implementation (None: by backend)
    offload: bool = False  # keep the full KV in pinned_host memory (accelerators only)
    dense_short: bool = True  # the authors' fallback: full attention for prompts with L - sink <= 2^bits
    score_table: bool | None = None  # score per code tuple (module doc); None: where the lookup is XLA's

    @property
    def offloads(self) -> bool:  # base.Method.offloads
        return self.offload

    def __post_init__(self):
        check_budget(self.budget)
        check_int("m", self.m, "sub-spaces")
        if not isinstance(self.bits, int) or not 1 <= self.bits <= 8:
            raise ValueError(f"bits={self.bits!r} must be an int in [1, 8]: codes are stored as uint8; use bits <= 8")
        check_int("sink", self.sink, at_least=0)
        if (
            isinstance(self.local_ratio, bool)
            or not isinstance(self.local_ratio, (int, float))
            or not 0.0 <= self.local_ratio <= 1.0
        ):
            raise ValueError(f"local_ratio={self.local_ratio} must be in [0, 1]")
        check_int("iters", self.iters, at_least=0)
        if self.impl not in (None, "xla", "pallas_tpu", "pallas_gpu"):
            raise ValueError(f"impl={self.impl!r} must be None, 'xla', 'pallas_tpu' or 'pallas_gpu'")
        if self.score_table not in (None, True, False):
            raise ValueError(f"score_table={self.score_table!r} must be None (automatic), True or False")
        if self.score_table and self.num_tuples > _TABLE_MAX:
            raise ValueError(
                f"score_table=True needs (2^bits)^m <= {_TABLE_MAX} code tuples, got "
                f"(2^{self.bits})^{self.m} = {self.num_tuples}; use score_table=None or False"
            )

    @property
    def num_centroids(self) -> int:
        return 2**self.bits

    @property
    def num_tuples(self) -> int:
        """Distinct code tuples ``(2^bits)^m``."""
        return self.num_centroids**self.m

    def uses_table(self) -> bool:
        """Whether a step scores per code tuple (see the module doc) or per slot."""
        if self.score_table is None:
            return (self.impl or default_impl()) == "xla" and self.num_tuples <= _TABLE_AUTO
        return self.score_table

    # ---- budget split (authors' code: W = int((L-S) r lr), k = int((L-S) r (1-lr)), in exact integers) ----

    def split_fractions(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """``((pW, qW), (pk, qk))``: ``r lr`` and ``r (1 - lr)`` as fractions (float budget), or ``lr`` twice
        for an int budget (only ``W = floor(budget lr)`` uses it). See :func:`_int32_fraction`."""
        lr = Fraction(*as_fraction(self.local_ratio)) if self.local_ratio else Fraction(0)
        if isinstance(self.budget, float):
            r = Fraction(*as_fraction(self.budget))
            return _int32_fraction(r * lr), _int32_fraction(r * (1 - lr))
        return _int32_fraction(lr), _int32_fraction(lr)

    def split(self, prompt_len: int) -> tuple[int, int]:
        """``(W, k)`` for a prompt of ``prompt_len`` tokens (Python ints; the bucket's are the static maxima)."""
        (pw, qw), (pk, qk) = self.split_fractions()
        if isinstance(self.budget, float):
            n = max(int(prompt_len) - self.sink, 0)
            return floor_mul(n, pw, qw), floor_mul(n, pk, qk)
        w = floor_mul(self.budget, pw, qw)
        return w, self.budget - w

    def split_dynamic(self, lengths: jnp.ndarray):
        """Per-sequence ``(W [B], k [B])`` int32 from the prompt lengths, exactly :meth:`split` of each."""
        lengths = jnp.asarray(lengths, jnp.int32)
        if isinstance(self.budget, float):
            (pw, qw), (pk, qk) = self.split_fractions()
            n = jnp.maximum(lengths - self.sink, 0)
            return floor_mul(n, pw, qw).astype(jnp.int32), floor_mul(n, pk, qk).astype(jnp.int32)
        w, k = self.split(0)
        return jnp.full_like(lengths, w), jnp.full_like(lengths, k)

    def is_short(self, n: int) -> bool:
        """The authors' dense fallback applies to an ``n``-token prompt."""
        return self.dense_short and n - self.sink <= self.num_centroids

    def attended(self, n: int, steps: int, ctx: LayerContext = LayerContext()) -> int:
        """Tokens (per KV head) the decode step whose new token is at position ``n + steps`` attends to: sinks +
        local window + retrieved + the new token (``sink + W + k + 1`` once the prompt is long enough), or every
        token for a ``dense_short`` prompt. PQCache saves bandwidth, not memory: compare with :meth:`held`."""
        t = n + steps
        if self.is_short(n):
            return t + 1
        w, k = self.split(n)
        sink = min(self.sink, t)
        win = max(min(w, t - self.sink), 0)
        cand = max(t - w - self.sink, 0)
        return sink + win + min(k, cand) + 1

    # ---- the method interface ----

    def _code_slots(self, slots: int) -> int:
        align = _WORD if (self.impl or default_impl()) == "xla" else CODE_ALIGN
        return -(-slots // align) * align

    def attends_everything(self, model_cfg, capacity: Capacity, layer: int = 0) -> bool:
        """Every decode step of a bucket-filling prompt attends every token (:meth:`attended`; base.Method)."""
        return attends_all_steps(self, model_cfg, capacity, layer)

    def init(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> PQState:
        h, d = model_cfg.num_kv_heads, model_cfg.head_dim
        if d % self.m:
            raise ValueError(f"m={self.m} does not divide head_dim={d}; choose m among the divisors of {d}")
        slots = capacity.prompt_len + capacity.max_new_tokens
        sink = min(self.sink, slots)
        warn_full_attention(self, model_cfg, capacity, [layer])
        w, k = self.split(capacity.prompt_len)  # per-sequence values are at most the bucket's
        state = PQState(
            k=jnp.zeros((batch, h, slots, d), dtype),
            v=jnp.zeros((batch, h, slots, d), dtype),
            codes=jnp.zeros((batch, h, self.m, self._code_slots(slots)), jnp.uint8),
            centroids=jnp.zeros((batch, h, self.m, self.num_centroids, d // self.m), jnp.float32),
            lengths=jnp.zeros((batch,), jnp.int32),
            filled=jnp.zeros((batch,), jnp.int32),
            hist=jnp.zeros((batch, h, self.num_tuples if self.uses_table() else 0), jnp.int32),
            hist_end=jnp.full((batch,), sink, jnp.int32),
            sink=sink,
            window=min(w, slots - sink),
            topk=min(k, slots - sink),
        )
        if self.offload:
            host = host_sharding()
            state = state.replace(k=jax.device_put(state.k, host), v=jax.device_put(state.v, host))
        return state

    def prefill(self, state: PQState, layer: int, q, k, v, lengths, previous=None) -> PQState:
        """Store the prompt KV and build the PQ index (paper §3.1; note §2.3 with A3 resolved: fit on
        ``[sink, L)``). k, v ``[B, Hkv, T, D]``; lengths ``[B]``."""
        t = k.shape[2]
        cent, labels = pq_index.fit(  # labels [B, Hkv, m, T]
            k, lengths, sink=self.sink, m=self.m, kc=self.num_centroids, seed=self.seed, iters=self.iters
        )
        new_k = state.k.at[:, :, :t].set(k.astype(state.k.dtype))
        new_v = state.v.at[:, :, :t].set(v.astype(state.v.dtype))
        lengths = jnp.asarray(lengths, jnp.int32)
        codes = state.codes.at[..., :t].set(labels.astype(jnp.uint8))
        state = state.replace(
            k=self._place(new_k), v=self._place(new_v), codes=codes, centroids=cent, lengths=lengths, filled=lengths
        )
        end = self._cand_end(state, lengths)  # the first step's candidate end (new token at t = L)
        hist = state.hist
        if self.uses_table():  # the first step's counts: [sink, end)
            hist = pq_index.histogram(codes, hist, state.k.shape[2], state.sink, end, self.num_centroids)
        return state.replace(hist=hist, hist_end=end)

    def _place(self, x):
        return jax.device_put(x, host_sharding()) if self.offload else x

    def scores(self, state: PQState, q, lengths=None) -> jnp.ndarray:
        """Approximate logits ``q · k_hat`` ``[B, Hkv, G, S]`` float32 from the codes (unscaled); slots
        ``>= lengths[b]`` (default: ``filled``) are ``NEG_INF`` and their code blocks are not read."""
        s = state.k.shape[2]
        lengths = state.filled if lengths is None else lengths
        lookup = lambda t, c, n: pq_lookup(t, c, n, impl=self.impl)  # noqa: E731  (per device on a mesh)
        return sharding.per_head(lookup, pq_retrieval.lut(state.centroids, q), state.codes, lengths)[..., :s]

    # ---- retrieval ----

    def _cand_end(self, state: PQState, t) -> jnp.ndarray:
        """``[B]`` int32: the candidates of the step whose new token is at ``t`` are ``[sink, end)``, ``end =
        t - W_b`` (never past the written slots or the buffer, never below the sinks)."""
        w, _ = self.split_dynamic(state.lengths)
        end = jnp.minimum(jnp.asarray(t, jnp.int32) - w, state.filled)
        return jnp.clip(end, state.sink, state.k.shape[2]).astype(jnp.int32)

    def _retrieve(self, state: PQState, q, end, hist):
        """Retrieved slots ``[B, Hkv, topk]`` int32 and ``ok`` bool for candidates ``[sink, end)`` (``hist``
        counted over them on the table path)."""
        _, kk = self.split_dynamic(state.lengths)
        opts = dict(sink=state.sink, topk=state.topk, d=q.shape[-1], table=self.uses_table(), impl=self.impl)
        run = lambda lut, codes, hst, e, k: pq_retrieval.retrieve(  # noqa: E731
            lut, codes, hst, e, k, **opts, kc=self.num_centroids
        )
        idx, ok = sharding.per_head(run, pq_retrieval.lut(state.centroids, q), state.codes, hist, end, kk)
        return jnp.minimum(idx, state.k.shape[2] - 1), ok  # unset entries point into the buffer

    def select(self, state: PQState, q, t):
        """Retrieved slots ``idx [B, Hkv, k_max]`` int32 (ascending) and ``ok`` bool (``k_b`` set, fewer when
        there are fewer candidates) for the step whose new token is at ``t [B]`` (note §8.7). Candidates
        ``[sink, t - W_b)``; the same set the step's ``decode`` retrieves."""
        end = self._cand_end(state, t)
        if self.uses_table():  # the counts the step's decode would have: [sink, end)
            hist = pq_index.advance(state.codes, state.hist, state.hist_end, end, self.num_centroids)
        else:
            hist = state.hist
        return self._retrieve(state, q, end, hist)

    def decode(self, state: PQState, layer: int, q, k, v, pos):
        """Encode + store the new token, retrieve, attend (note §2.4-2.5, §8.5-8.8). q ``[B, Hq, D]``; k, v
        ``[B, Hkv, D]``; pos ``[B]`` -> (out ``[B, Hq, D]`` float32, state)."""
        b, h, d = k.shape
        t = pos.astype(jnp.int32)
        ti = jnp.broadcast_to(t[:, None], (b, h))
        code = pq_index.encode(state.centroids, k)  # [B, Hkv, m]
        rewrite = jnp.any((t >= state.sink) & (t < state.hist_end))  # a counted slot rewritten: never in a plain decode
        codes = pq_index.write_codes(state.codes, t, code)  # [B, Hkv, m, S_c]
        state = state.replace(
            k=self._place(rows_at(state.k, ti, k)),
            v=self._place(rows_at(state.v, ti, v)),
            codes=codes,
            filled=jnp.maximum(state.filled, t + 1),
        )
        end = self._cand_end(state, t)
        hist = state.hist
        kc = self.num_centroids
        if self.uses_table():  # one count per step; a rewritten counted slot (a rewind) recounts them all
            hist = jax.lax.cond(
                rewrite,
                lambda: pq_index.histogram(codes, state.hist, state.k.shape[2], state.sink, end, kc),
                lambda: pq_index.advance(codes, state.hist, state.hist_end, end, kc),
            )
        state = state.replace(hist=hist, hist_end=end)
        w, _ = self.split_dynamic(state.lengths)
        if state.topk:
            idx, ok = self._retrieve(state, q, end, hist)
        else:
            idx, ok = jnp.zeros((b, h, 0), jnp.int32), jnp.zeros((b, h, 0), bool)

        def sparse(_):
            # Reads the sinks, the window [t - W_b, t) and the retrieved rows (pq_attend.parts); the new token is the
            # input.
            kc, vc = state.k, state.v
            if self.offload:
                kc, vc = (jax.device_put(x, device_sharding()) for x in (kc, vc))
            return pq_attend.sparse_attend(
                q, k, v, kc, vc, t, w, idx, ok, sink=state.sink, window=state.window, topk=state.topk
            )

        if not self.dense_short:
            return attention.normalise(sparse(None)), state
        short = self._short(state)  # [B]

        def dense(_):
            # Authors' fallback (note A11): a short prompt's row attends to every cached token; the other
            # rows of the batch keep exactly their sparse set, as a mask; only the live slots are read.
            s = state.k.shape[2]
            rows, oks = self._attended_rows(state, t, idx, ok)
            rows = jnp.concatenate([rows, jnp.broadcast_to(t[:, None, None], (b, h, 1))], axis=-1)
            oks = jnp.concatenate([oks, jnp.ones((b, h, 1), bool)], axis=-1)
            every = jnp.arange(s)[None, None, :] <= t[:, None, None]
            return attention.attend(
                q,
                state.k,
                state.v,
                jnp.where(short[:, None, None], every, pq_attend.rows_mask(rows, oks, s)),
                lengths=state.filled,
            )

        return attention.normalise(jax.lax.cond(jnp.any(short), dense, sparse, None)), state

    def selected_positions(self, state: PQState, layer: int, q) -> jnp.ndarray:
        """``[B, Hq, S]`` bool: the positions the next :meth:`decode` (new token at ``t = filled``) attends for
        ``q [B, Hq, D]``, the new token excluded: the sinks ``[0, min(sink, t))``, the local window
        ``[max(t - W_b, sink), t)`` and the ``k_b`` tokens :meth:`select` retrieves (the same per KV head, so
        every query head of a group gets its KV head's set); every stored position ``[0, t)`` for a
        ``dense_short`` row. :meth:`select` on this state equals the one ``decode`` runs after writing the new
        token: the candidates end at ``t - W_b <= t``, so neither the new code nor the fill count changes it."""
        hq = q.shape[1]
        h, s = state.k.shape[1], state.k.shape[2]
        t = state.filled  # [B]
        sel = pq_attend.rows_mask(*self._attended_rows(state, t, *self.select(state, q, t)), s)
        if self.dense_short:
            every = (jnp.arange(s)[None, :] < t[:, None])[:, None, :]
            sel = jnp.where(self._short(state)[:, None, None], every, sel)
        return jnp.repeat(sel, hq // h, axis=1)

    def _short(self, state: PQState) -> jnp.ndarray:
        """``[B]`` bool: the row's prompt is short enough for the authors' dense fallback (note A11)."""
        return (state.lengths - state.sink) <= self.num_centroids

    def _attended_rows(self, state: PQState, t, idx, ok):
        """Slots ``[B, Hkv, sink + window + topk]`` int32 (clipped into the buffer) and ``ok`` bool the step whose
        new token is at ``t [B]`` attends besides it: the sinks ``[0, min(sink, t))``, the local window
        ``[max(t - W_b, sink), t)`` and the retrieved ``idx``/``ok`` (:meth:`select`)."""
        b, h = idx.shape[:2]
        w, _ = self.split_dynamic(state.lengths)
        parts, oks = [], []
        if state.sink:
            sp = jnp.broadcast_to(jnp.arange(state.sink), (b, h, state.sink))
            parts.append(sp)
            oks.append(sp < t[:, None, None])
        if state.window:
            wp = (t[:, None] - state.window + jnp.arange(state.window)[None, :])[:, None, :]  # [B, 1, W]
            wok = (wp >= (t - w)[:, None, None]) & (wp >= state.sink) & (wp >= 0)
            parts.append(jnp.broadcast_to(wp, (b, h, state.window)))
            oks.append(jnp.broadcast_to(wok, (b, h, state.window)))
        parts.append(idx)
        oks.append(ok)
        rows = jnp.clip(jnp.concatenate(parts, axis=-1), 0, state.k.shape[2] - 1)
        return rows, jnp.concatenate(oks, axis=-1)

    def state_axes(self, state: PQState):
        """Batch- and head-major; the slot buffer (base.Method.state_axes): the K/V rows; the PQ codes and centroids are
        the index (``index_bytes``)."""
        return slot_axes(state, "k", "v")

    def memory_bytes(self, state: PQState) -> int:
        """Stored bytes: full KV + codes + centroids + tuple counts + lengths, fill counts and ends (the KV is not
        shrunk; see :meth:`bytes_read_per_step`)."""
        return tree_bytes(state)

    def tokens_held(self, state: PQState):
        """``[B]`` float32 tokens stored: the full KV stays resident (prompt + decoded so far = ``filled``)."""
        return jnp.asarray(state.filled, jnp.float32)

    def index_bytes(self, state, n=None, steps=None):
        """The ``m`` one-byte codes of every token a sequence holds (base.Method.index_bytes); the codebooks and the
        tuple counts are per sequence whatever its length."""
        filled = np.asarray(state.filled) if n is None else np.asarray(n) + steps
        b, h, m, _ = state.codes.shape
        item = np.dtype(state.codes.dtype).itemsize
        return int(np.prod(state.codes.shape)) * item, filled.astype(np.int64) * h * m * item

    def held(self, n: int, steps: int, ctx: LayerContext = LayerContext()) -> int:
        """Every token is stored: ``n + steps``. (Tokens attended per step: :meth:`attended`.)"""
        return n + steps

    def bytes_read_breakdown(self, state: PQState, num_heads: int | None = None) -> dict[str, int]:
        """Bytes the next decode step of this layer reads (new token at ``t = filled``), by part; concrete
        state only (call outside ``jit``). ``num_heads`` query heads (default the KV heads). Each buffer is
        counted once per pass that streams it (the bisection's 32 counts re-read a table that stays in cache:
        counted once).

        - ``codes``: ``m`` bytes per slot the code pass visits (:func:`kvjax.model.attention.live_pass`: every slot
          where at least half are candidates, else whole chunks of ``pq_retrieval.SCAN_CHUNK`` slots up to the largest
          candidate end of the batch) on the table path; on the per-slot path the lookup's reads (the
          Pallas kernels stop at the candidate end, the XLA reference reads all ``S_c`` slots);
        - ``centroids`` (read for the LUT) and ``lut`` (float32, written then read);
        - ``table`` (table path): per ``(b, h)`` the tuple counts, the per-query-head tuple scores and the tuple
          keys, ``4 (2 + G) K^m`` bytes; ``scores`` (per-slot path): the lookup's ``[Hq, S_c]`` float32 output
          written and read by the group softmax, and the ``[Hkv, S_c]`` keys;
        - ``words``: the two bit words per 32 visited slots (written, then read by the compaction);
          ``indices``: the ``topk`` retrieved slots and their flags;
        - ``kv``: K and V rows read: all ``sink`` rows, the window's chunks (whole chunks of ``min(chunk_rows,
          W_max)`` slots of every row, from the batch's earliest window start to its latest end) and the retrieved rows
          gathered in chunks (padding rows of the last chunk included); the new token's K/V are the step's input;
        - ``attention``: per attention call (new token, sinks, each chunk) the query and the partial outputs,
          plus one mask byte per row.

        A step of a batch with a ``dense_short`` row reads, instead of ``kv`` and ``attention``, the block plan
        over the live slots ``[0, t + 1)`` of the full cache (with its mask). ``full_kv`` (not in ``total``) is
        what full attention over the same live slots would read, for comparison."""
        b, h, s, _ = state.k.shape
        hq = num_heads or h
        t = np.asarray(state.filled, np.int64)  # the next step's new token position
        w, kk = (np.asarray(x, np.int64) for x in self.split_dynamic(state.lengths))
        end = np.clip(t - w, state.sink, s)  # the step writes slot t first: filled = t + 1 > t - W_b
        live = jnp.asarray(np.minimum(t + 1, s), jnp.int32)
        out = dict.fromkeys(("codes", "centroids", "lut", "table", "scores", "words", "indices", "kv", "attention"), 0)
        if state.topk:  # no retrieval, no lookup
            pallas = (self.impl or default_impl()) != "xla"
            table = self.uses_table()
            opts = dict(hq=hq, topk=state.topk, table=table, pallas=pallas, kc=self.num_centroids)
            out.update(pq_retrieval.read_bytes(state.centroids, state.codes, end, **opts))
        short = np.asarray(state.lengths) - state.sink <= self.num_centroids
        if self.dense_short and short.any():
            out["attention"] = block_plan_bytes(state.k, live, num_heads=hq, with_mask=True)
        else:
            opts = dict(hq=hq, sink=state.sink, window=state.window, topk=state.topk)
            out.update(pq_attend.read_bytes(state.k, t, w, kk, end, **opts))
        out["total"] = sum(out.values())
        out["full_kv"] = block_plan_bytes(state.k, live, num_heads=hq, with_mask=False)
        return out

    def held_overhead_bytes(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> int:
        """A recall method keeps everything: full's K/V, plus the index: ``m`` uint8 codes per slot (rows padded
        to the lookup's alignment), ``m`` codebooks of float32 centroids, the score table's histogram when it is
        used, and the per-sequence counters."""
        slots = capacity.prompt_len + capacity.max_new_tokens
        d, h = model_cfg.head_dim, model_cfg.num_kv_heads
        index = (
            self.m * self._code_slots(slots)
            + self.num_centroids * d * 4
            + (4 * self.num_tuples if self.uses_table() else 0)
        )
        return full_bytes(model_cfg, batch, capacity, dtype) + batch * h * index + 12 * batch

    def bytes_read_per_step(self, state: PQState, num_heads: int | None = None) -> int:
        """Total of :meth:`bytes_read_breakdown`: codes visited, centroids, LUT, the tuple table (or per-slot
        scores), bit words, indices, the attended K/V rows and the attention calls' queries, outputs and masks."""
        return self.bytes_read_breakdown(state, num_heads)["total"]
