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

from kernels_pallas.decode_attention import block_plan_bytes
from kernels_pallas.decode_attention import default_impl as attention_impl
from kernels_pallas.decode_attention.xla import chunk_rows
from kernels_pallas.pq_lookup import CODE_ALIGN, default_impl, pq_lookup
from kvjax import attention, sharding
from kvjax.budget import as_fraction, check_budget, floor_fraction, floor_mul, warn_full_attention
from kvjax.methods import kmeans as km
from kvjax.methods import threshold as th
from kvjax.methods.base import (
    RECALL_NO_DECODE_BUDGET,
    Capacity,
    LayerContext,
    Method,
    attends_all_steps,
    full_bytes,
    rows_at,
    sum_small_axis,
    tree_bytes,
)

from kvjax.attention import NEG_INF  # noqa: E402  (defined once)

#: Largest denominator ``floor_mul`` takes exactly on int32 (``(n % q) p < q^2 < 2^31``).
_EXACT_Q = 46340
#: Tuple tables up to this many entries are used by default (m = 2 with bits <= 6, m = 1); ``score_table=True``
#: accepts up to ``_TABLE_MAX``.
_TABLE_AUTO = 1 << 13
_TABLE_MAX = 1 << 16
#: Slots per chunk of the code pass on CPU (a multiple of the 32-slot bit word; :func:`_scan_chunk`).
_SCAN_CHUNK = 4096
#: Code buffers are allocated in whole bit words.
_WORD = 32


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


def _host_sharding():
    """The ``pinned_host`` sharding of the default device, or a ValueError where the backend has none."""
    backend = jax.default_backend()
    dev = jax.devices()[0]
    if backend == "cpu":
        raise ValueError(
            "offload=True is not supported on the CPU backend: the KV already lives in host memory "
            "and there is no separate device memory to offload from; use offload=False on CPU "
            "(offload needs a GPU/TPU backend with a 'pinned_host' memory kind)"
        )
    kinds = {m.kind for m in dev.addressable_memories()}
    if "pinned_host" not in kinds:
        raise ValueError(
            f"offload=True needs the 'pinned_host' memory kind, but device {dev} offers "
            f"{sorted(kinds)}; use offload=False"
        )
    return jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")


def _rows_mask(idx, ok, s: int) -> jnp.ndarray:
    """``[B, Hkv, S]`` bool: the slots ``idx [B, Hkv, N]`` whose ``ok`` is set."""
    b, h = idx.shape[:2]
    return rows_at(jnp.zeros((b, h, s), bool), idx, ok, "max")


def _int32_fraction(f: Fraction) -> tuple[int, int]:
    """``(p, q)`` of ``f`` in ``[0, 1]``, exact when ``q^2 < 2^31``, else rounded down to ``1/MAX_DENOMINATOR``."""
    return floor_fraction(f, _EXACT_Q)


def _write_codes(codes, t, code):
    """``codes [B, Hkv, m, S_c]`` with slot ``t [B]`` set to ``code [B, Hkv, m]`` (in place; out of range:
    dropped)."""
    one = lambda row, tb, cb: row.at[:, :, tb].set(cb, mode="drop")  # noqa: E731
    return jax.vmap(one)(codes, t, code.astype(codes.dtype))


def _empty_partial(q):
    b, hq, d = q.shape
    return (
        jnp.zeros((b, hq, d), jnp.float32),
        jnp.full((b, hq), NEG_INF, jnp.float32),
        jnp.zeros((b, hq), jnp.float32),
    )


def _attend_range(q, k, v, lo, hi, chunk: int):
    """Partials of ``q [B, Hq, D]`` over the contiguous slots ``[lo[b], hi[b])`` of ``k, v [B, Hkv, S, D]``, read
    in chunks of ``chunk`` slots from ``min(lo)`` (one slice of every row per chunk; trip count: the span
    ``max(hi) - min(lo)`` over ``chunk``; rows of a row's chunk outside its own range are masked)."""
    b, h, s, _ = k.shape
    c = min(chunk, s)
    lo0 = jnp.min(lo)
    trips = jnp.maximum(jnp.max(hi) - lo0 + c - 1, 0) // c

    def body(i, acc):
        first = lo0 + i * c
        start = jnp.clip(first, 0, s - c)
        rows = start + jnp.arange(c, dtype=jnp.int32)  # [C]
        take = (rows[None, :] >= jnp.maximum(first, lo)[:, None]) & (rows[None, :] < hi[:, None])  # [B, C]
        cut = lambda x: jax.lax.dynamic_slice_in_dim(x, start, c, axis=2)  # noqa: E731
        return attention.merge(acc, attention.attend(q, cut(k), cut(v), jnp.broadcast_to(take[:, None], (b, h, c))))

    return jax.lax.fori_loop(0, trips, body, _empty_partial(q))


def _attend_rows(q, k, v, idx, ok, chunk: int):
    """Partials of ``q`` over the rows ``idx [B, Hkv, N]`` (``ok`` a prefix of each row) of ``k, v``, gathered
    ``chunk`` rows at a time (trip count: the most ``ok`` entries of any row over ``chunk``)."""
    n = idx.shape[-1]
    c = min(chunk, n)
    pad = -n % c
    if pad:
        idx = jnp.concatenate([idx, jnp.broadcast_to(idx[..., -1:], (*idx.shape[:2], pad))], axis=-1)
        ok = jnp.concatenate([ok, jnp.zeros((*ok.shape[:2], pad), bool)], axis=-1)
    trips = (jnp.max(jnp.sum(ok, axis=-1)) + c - 1) // c

    def body(i, acc):
        ii = jax.lax.dynamic_slice_in_dim(idx, i * c, c, axis=2)
        take = jax.lax.dynamic_slice_in_dim(ok, i * c, c, axis=2)
        kk = jnp.take_along_axis(k, ii[..., None], axis=2, mode="clip")
        vv = jnp.take_along_axis(v, ii[..., None], axis=2, mode="clip")
        return attention.merge(acc, attention.attend(q, kk, vv, take))

    return attention.chunk_loop(trips, c, idx.shape[-1], body, _empty_partial(q))


def _scan_chunk(sc: int) -> int:
    """Slots per chunk of the code pass over ``sc`` slots: ``_SCAN_CHUNK`` on CPU, every slot in one pass
    (:func:`kvjax.attention.one_pass`)."""
    return sc if attention.one_pass() else min(_SCAN_CHUNK, sc)


def _attend_window(q, k, v, lo, hi, width: int):
    """Partials of ``q`` over ``[lo[b], hi[b])`` (at most ``width`` rows each) without a loop: one slice of ``width``
    rows per sequence from ``clip(lo, 0, S - width)`` (a gather on XLA:CPU, so the CPU takes
    :func:`_attend_range`'s shared slices instead)."""
    b, h, s, _ = k.shape
    width = min(width, s)
    start = jnp.clip(lo, 0, s - width)
    cut = lambda x: jax.vmap(lambda xb, st: jax.lax.dynamic_slice_in_dim(xb, st, width, axis=1))(x, start)  # noqa: E731
    rows = start[:, None] + jnp.arange(width, dtype=jnp.int32)
    take = (rows >= lo[:, None]) & (rows < hi[:, None])  # [B, W]
    return attention.attend(q, cut(k), cut(v), jnp.broadcast_to(take[:, None], (b, h, width)))


def _row_chunk(k) -> int:
    """Rows per attention chunk: cache-sized on the XLA path (``chunk_rows``), everything at once where the
    decode attention is a Pallas kernel (one gather, one kernel call)."""
    if attention_impl() == "xla":
        b, h, _, d = k.shape
        return chunk_rows(b, h, d, np.dtype(k.dtype).itemsize)
    return 1 << 30


@dataclasses.dataclass(frozen=True, eq=False)
class PQCache(Method):
    name: ClassVar[str] = "pqcache"
    why_no_decode_budget: ClassVar[str] = RECALL_NO_DECODE_BUDGET  # base.Method.why_no_decode_budget
    step_kernels: ClassVar[tuple[str, ...]] = ("decode_attention", "pq_lookup")  # base.Method.step_kernels
    traced_layer: ClassVar[bool] = True  # scan over layers (base.Method.traced_layer)
    recalls: ClassVar[bool] = True  # every token stays stored; selected_positions gives a step's attended set
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
        if not isinstance(self.m, int) or self.m < 1:
            raise ValueError(f"m={self.m!r} (sub-spaces) must be an int >= 1")
        if not isinstance(self.bits, int) or not 1 <= self.bits <= 8:
            raise ValueError(f"bits={self.bits!r} must be an int in [1, 8]: codes are stored as uint8; use bits <= 8")
        if not isinstance(self.sink, int) or self.sink < 0:
            raise ValueError(f"sink={self.sink!r} must be an int >= 0")
        if (
            isinstance(self.local_ratio, bool)
            or not isinstance(self.local_ratio, (int, float))
            or not 0.0 <= self.local_ratio <= 1.0
        ):
            raise ValueError(f"local_ratio={self.local_ratio} must be in [0, 1]")
        if not isinstance(self.iters, int) or self.iters < 0:
            raise ValueError(f"iters={self.iters!r} must be an int >= 0")
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
            host = _host_sharding()
            state = state.replace(k=jax.device_put(state.k, host), v=jax.device_put(state.v, host))
        return state

    def prefill(self, state: PQState, layer: int, q, k, v, lengths, previous=None) -> PQState:
        """Store the prompt KV and build the PQ index (paper §3.1; note §2.3 with A3 resolved: fit on
        ``[sink, L)``). k, v ``[B, Hkv, T, D]``; lengths ``[B]``."""
        b, h, t, d = k.shape
        m, dm = self.m, d // self.m
        pos = jnp.arange(t)
        valid = (pos[None, :] >= self.sink) & (pos[None, :] < lengths[:, None])  # [B, T]
        x = k.astype(jnp.float32).reshape(b, h, t, m, dm).transpose(0, 1, 3, 2, 4)  # [B, Hkv, m, T, dm]
        init = km.init_rows(jax.random.PRNGKey(self.seed), valid, self.num_centroids)  # [B, K]
        c0 = jnp.take_along_axis(x, init[:, None, None, :, None], axis=3)  # [B, Hkv, m, K, dm]
        cent, labels = km.kmeans(x, valid[:, None, None, :], c0, self.iters)  # labels [B, Hkv, m, T]
        new_k = state.k.at[:, :, :t].set(k.astype(state.k.dtype))
        new_v = state.v.at[:, :, :t].set(v.astype(state.v.dtype))
        lengths = jnp.asarray(lengths, jnp.int32)
        codes = state.codes.at[..., :t].set(labels.astype(jnp.uint8))
        state = state.replace(
            k=self._place(new_k), v=self._place(new_v), codes=codes, centroids=cent, lengths=lengths, filled=lengths
        )
        end = self._cand_end(state, lengths)  # the first step's candidate end (new token at t = L)
        hist = self._histogram(state, end) if self.uses_table() else state.hist
        return state.replace(hist=hist, hist_end=end)

    def _place(self, x):
        return jax.device_put(x, _host_sharding()) if self.offload else x

    def encode(self, centroids, k) -> jnp.ndarray:
        """Codes ``[B, Hkv, m]`` uint8 of keys ``k [B, Hkv, D]``: nearest frozen centroid per sub-space."""
        b, h, d = k.shape
        x = k.astype(jnp.float32).reshape(b, h, self.m, 1, d // self.m)
        return km.assign(x, centroids)[..., 0].astype(jnp.uint8)

    def _lut(self, state: PQState, q) -> jnp.ndarray:
        """``lut [B, Hkv, G, m, K]`` float32: ``q_i · C_{i,c}`` per query head (paper §3.1)."""
        b, hq, d = q.shape
        h = state.k.shape[1]
        qs = q.astype(jnp.float32).reshape(b, h, hq // h, self.m, d // self.m)
        return jnp.einsum("bhgid,bhicd->bhgic", qs, state.centroids, precision=jax.lax.Precision.HIGHEST)

    def scores(self, state: PQState, q, lengths=None) -> jnp.ndarray:
        """Approximate logits ``q · k_hat`` ``[B, Hkv, G, S]`` float32 from the codes (unscaled); slots
        ``>= lengths[b]`` (default: ``filled``) are ``NEG_INF`` and their code blocks are not read."""
        s = state.k.shape[2]
        lengths = state.filled if lengths is None else lengths
        lookup = lambda t, c, n: pq_lookup(t, c, n, impl=self.impl)  # noqa: E731  (per device on a mesh)
        return sharding.per_head(lookup, self._lut(state, q), state.codes, lengths)[..., :s]

    # ---- retrieval ----

    def _cand_end(self, state: PQState, t) -> jnp.ndarray:
        """``[B]`` int32: the candidates of the step whose new token is at ``t`` are ``[sink, end)``, ``end =
        t - W_b`` (never past the written slots or the buffer, never below the sinks)."""
        w, _ = self.split_dynamic(state.lengths)
        end = jnp.minimum(jnp.asarray(t, jnp.int32) - w, state.filled)
        return jnp.clip(end, state.sink, state.k.shape[2]).astype(jnp.int32)

    def _tuples(self, codes) -> jnp.ndarray:
        """Code tuple index ``sum_i c_i K^(m-1-i)`` int32 ``[..., N]`` of codes ``[..., m, N]``."""
        u = codes[..., 0, :].astype(jnp.int32)
        for i in range(1, self.m):
            u = u * self.num_centroids + codes[..., i, :].astype(jnp.int32)
        return u

    def _histogram(self, state: PQState, end) -> jnp.ndarray:
        """``[B, Hkv, K^m]`` int32: candidates ``[sink, end[b])`` per code tuple (one scatter-add, at prefill)."""
        s = state.k.shape[2]
        u = self._tuples(state.codes[..., :s])  # [B, Hkv, S]
        j = jnp.arange(s)
        cand = ((j[None, :] >= state.sink) & (j[None, :] < end[:, None])).astype(jnp.int32)  # [B, S]
        return rows_at(jnp.zeros_like(state.hist), u, cand[:, None, :], "add")

    def _tuple_at(self, codes, p) -> jnp.ndarray:
        """``[B, Hkv]`` tuple of the codes at slot ``p [B]`` (clipped into the buffer)."""
        c = jax.vmap(lambda row, pb: jax.lax.dynamic_slice_in_dim(row, pb, 1, axis=2))(codes, p)  # [B, Hkv, m, 1]
        return self._tuples(c)[..., 0]

    def _advance(self, codes, hist, hist_end, end) -> jnp.ndarray:
        """``hist`` counted over ``[sink, hist_end)`` -> over ``[sink, end)``: one count added (or removed) per
        slot between the two ends, a loop of ``max |end - hist_end|`` steps (one per decode step)."""
        lo, hi = jnp.minimum(hist_end, end), jnp.maximum(hist_end, end)
        sign = jnp.where(end >= hist_end, 1, -1).astype(jnp.int32)

        def body(i, hst):
            p = lo + i
            add = jnp.where(p < hi, sign, 0)[:, None]  # [B, 1]
            return rows_at(hst, self._tuple_at(codes, p), add, "add")

        return jax.lax.fori_loop(0, jnp.max(hi - lo), body, hist)

    def _tuple_keys(self, lut, hist, d: int) -> jnp.ndarray:
        """``[B, Hkv, K^m]`` uint32 order keys (:func:`~kvjax.methods.threshold.sortable`) of each code tuple's
        aggregated score; 0 for a tuple no candidate holds. ``d`` the head dim. G = 1: ``s_hat / sqrt(D)``; else the sum
        over the group of ``softmax(s_hat / sqrt(D))`` over the candidates, whose maximum and normaliser come from the
        tuples weighted by ``hist`` (their counts)."""
        b, h, g, m, kc = lut.shape
        s = lut[..., 0, :]  # [B, Hkv, G, K]
        for i in range(1, m):  # the lookup's sum over sub-spaces, in its order
            s = (s[..., :, None] + lut[..., i, None, :]).reshape(b, h, g, -1)
        z = s / jnp.sqrt(jnp.float32(d))  # [B, Hkv, G, K^m]
        present = (hist > 0)[:, :, None, :]
        if g == 1:
            agg = z[:, :, 0]
        else:
            mx = jnp.max(jnp.where(present, z, NEG_INF), axis=-1, keepdims=True)
            e = jnp.where(present, jnp.exp(z - mx), 0.0)
            # the count-weighted sum as a dot: XLA:CPU's fused multiply-reduce took 10x as long (0.46 ms at 4096 tuples)
            tot = jnp.einsum("bhgk,bhk->bhg", e, hist.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)[
                ..., None
            ]
            agg = sum_small_axis(e / jnp.maximum(tot, 1e-30), 2)
        return jnp.where(present[:, :, 0], th.sortable(agg), jnp.uint32(0))

    def _scan_codes(self, codes, keys, tau, sink: int, end):
        """One pass over the candidates' codes (:func:`kvjax.attention.live_pass`: chunks of :func:`_scan_chunk` up
        to ``max(end)``, or every slot at once where at least half are candidates): each slot's
        tuple key looked up in ``keys [B, Hkv, K^m]``, compared with ``tau [B, Hkv]``. Returns the bit words
        ``(above, tied) [B, Hkv, S_c / 32]`` uint32 of the candidates ``[sink, end[b])`` (zero past them)."""
        b, h, _, sc = codes.shape
        c = _scan_chunk(sc)
        words = jnp.zeros((b, h, sc // _WORD), jnp.uint32)

        def scan(start, c, acc):  # the words of slots [start, start + c)
            above, tied = acc
            key = jnp.take_along_axis(
                keys, self._tuples(jax.lax.dynamic_slice_in_dim(codes, start, c, axis=3)), axis=-1
            )  # [B, Hkv, C]
            j = start + jnp.arange(c, dtype=jnp.int32)
            cand = ((j[None, :] >= sink) & (j[None, :] < end[:, None]))[:, None, :]  # [B, 1, C]
            put = lambda w, bits: jax.lax.dynamic_update_slice_in_dim(w, th.pack_bits(bits), start // _WORD, 2)  # noqa
            return (put(above, cand & (key > tau[..., None])), put(tied, cand & (key == tau[..., None])))

        body = lambda i, acc: scan(jnp.minimum(i * c, sc - c), c, acc)  # noqa: E731 (a clamped last chunk: same words)
        init = (words, words)
        return attention.live_pass(jnp.max(end), c, sc, body, init, lambda: scan(0, sc, init))

    def _slot_keys(self, lut, codes, sink: int, end, d: int):
        """Per-slot path: ``(keys [B, Hkv, S_c] uint32, cand [B, 1, S_c] bool)`` from the lookup's scores
        (:func:`~kernels_pallas.pq_lookup.pq_lookup`, no block past ``end`` read) and the group softmax over the
        candidates ``[sink, end)`` taken per slot (note §8.7)."""
        s_hat = pq_lookup(lut, codes, end, impl=self.impl)  # [B, Hkv, G, S_c]
        j = jnp.arange(codes.shape[-1])
        cand = ((j[None, :] >= sink) & (j[None, :] < end[:, None]))[:, None, None, :]  # [B, 1, 1, S_c]
        z = jnp.where(cand, s_hat / jnp.sqrt(jnp.float32(d)), NEG_INF)
        if lut.shape[2] == 1:
            agg = z[:, :, 0]
        else:
            p = jnp.where(cand, jnp.exp(z - jnp.max(z, axis=-1, keepdims=True)), 0.0)
            agg = sum_small_axis(p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30), 2)
        cand = cand[:, :, 0]
        return jnp.where(cand, th.sortable(agg), jnp.uint32(0)), cand

    def _retrieve_local(self, lut, codes, hist, end, kk, *, sink: int, topk: int, d: int):
        """``(slots, ok) [B, Hkv, topk]``: the ``kk[b]`` candidates of ``[sink, end[b])`` with the largest
        aggregated scores, ties to the lower slot (= ``lax.top_k``), ascending; per device on a mesh."""
        if not self.uses_table():
            keys, cand = self._slot_keys(lut, codes, sink, end, d)
            return th.top_set(keys, jnp.broadcast_to(cand, keys.shape), kk[:, None], topk)
        keys = self._tuple_keys(lut, hist, d)
        tau, above = th.kth_key(keys, hist, kk[:, None])
        up, tie = self._scan_codes(codes, keys, tau, sink, end)
        return th.compact(up | th.keep_first(tie, kk[:, None] - above), topk)

    def _retrieve(self, state: PQState, q, end, hist):
        """Retrieved slots ``[B, Hkv, topk]`` int32 and ``ok`` bool for candidates ``[sink, end)`` (``hist``
        counted over them on the table path)."""
        _, kk = self.split_dynamic(state.lengths)
        run = lambda lut, codes, hst, e, k: self._retrieve_local(  # noqa: E731
            lut, codes, hst, e, k, sink=state.sink, topk=state.topk, d=q.shape[-1]
        )
        idx, ok = sharding.per_head(run, self._lut(state, q), state.codes, hist, end, kk)
        return jnp.minimum(idx, state.k.shape[2] - 1), ok  # unset entries point into the buffer

    def select(self, state: PQState, q, t):
        """Retrieved slots ``idx [B, Hkv, k_max]`` int32 (ascending) and ``ok`` bool (``k_b`` set, fewer when
        there are fewer candidates) for the step whose new token is at ``t [B]`` (note §8.7). Candidates
        ``[sink, t - W_b)``; the same set the step's ``decode`` retrieves."""
        end = self._cand_end(state, t)
        hist = self._advance(state.codes, state.hist, state.hist_end, end) if self.uses_table() else state.hist
        return self._retrieve(state, q, end, hist)

    def decode(self, state: PQState, layer: int, q, k, v, pos):
        """Encode + store the new token, retrieve, attend (note §2.4-2.5, §8.5-8.8). q ``[B, Hq, D]``; k, v
        ``[B, Hkv, D]``; pos ``[B]`` -> (out ``[B, Hq, D]`` float32, state)."""
        b, h, d = k.shape
        t = pos.astype(jnp.int32)
        ti = jnp.broadcast_to(t[:, None], (b, h))
        code = self.encode(state.centroids, k)  # [B, Hkv, m]
        rewrite = jnp.any((t >= state.sink) & (t < state.hist_end))  # a counted slot rewritten: never in a plain decode
        codes = _write_codes(state.codes, t, code)  # [B, Hkv, m, S_c]
        state = state.replace(
            k=self._place(rows_at(state.k, ti, k)),
            v=self._place(rows_at(state.v, ti, v)),
            codes=codes,
            filled=jnp.maximum(state.filled, t + 1),
        )
        end = self._cand_end(state, t)
        hist = state.hist
        if self.uses_table():  # one count per step; a rewritten counted slot (a rewind) recounts them all
            hist = jax.lax.cond(
                rewrite,
                lambda: self._histogram(state, end),
                lambda: self._advance(codes, state.hist, state.hist_end, end),
            )
        state = state.replace(hist=hist, hist_end=end)
        w, _ = self.split_dynamic(state.lengths)
        if state.topk:
            idx, ok = self._retrieve(state, q, end, hist)
        else:
            idx, ok = jnp.zeros((b, h, 0), jnp.int32), jnp.zeros((b, h, 0), bool)

        def sparse(_):
            # Reads the sinks, the window [t - W_b, t) and the retrieved rows; the new token is the input.
            kv = state.k, state.v
            if self.offload:
                dev = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
                kv = tuple(jax.device_put(x, dev) for x in kv)
            kc, vc = kv
            dt = kc.dtype
            part = attention.token_partial(q, k.astype(dt), v.astype(dt))
            chunk = _row_chunk(kc)
            if state.sink:
                live = jnp.broadcast_to((jnp.arange(state.sink)[None, :] < t[:, None])[:, None, :], (b, h, state.sink))
                part = attention.merge(part, attention.attend(q, kc[:, :, : state.sink], vc[:, :, : state.sink], live))
            if state.window:
                hi = jnp.minimum(t, kc.shape[2])
                lo = jnp.maximum(t - w, state.sink)
                if attention.one_pass():
                    part = attention.merge(part, _attend_window(q, kc, vc, lo, hi, state.window))
                else:
                    part = attention.merge(part, _attend_range(q, kc, vc, lo, hi, min(chunk, state.window)))
            if state.topk:
                part = attention.merge(part, _attend_rows(q, kc, vc, idx, ok, chunk))
            return part

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
                jnp.where(short[:, None, None], every, _rows_mask(rows, oks, s)),
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
        sel = _rows_mask(*self._attended_rows(state, t, *self.select(state, q, t)), s)
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

        - ``codes``: ``m`` bytes per slot the code pass visits (:func:`kvjax.attention.live_pass`: every slot
          where at least half are candidates, else whole chunks of ``_SCAN_CHUNK`` slots up to the largest
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
        b, h, s, d = state.k.shape
        hq = num_heads or h
        g = hq // h
        item = np.dtype(state.k.dtype).itemsize
        sc = state.codes.shape[-1]
        t = np.asarray(state.filled, np.int64)  # the next step's new token position
        w, kk = (np.asarray(x, np.int64) for x in self.split_dynamic(state.lengths))
        end = np.clip(t - w, state.sink, s)  # the step writes slot t first: filled = t + 1 > t - W_b
        live = jnp.asarray(np.minimum(t + 1, s), jnp.int32)
        out = dict.fromkeys(("codes", "centroids", "lut", "table", "scores", "words", "indices", "kv", "attention"), 0)
        if state.topk:  # no retrieval, no lookup
            out["centroids"] = int(state.centroids.size * 4)
            out["lut"] = 2 * b * hq * self.m * self.num_centroids * 4
            if self.uses_table():
                scanned = attention.live_pass_rows(int(end.max()), _scan_chunk(sc), sc)
                out["codes"] = b * h * self.m * scanned
                out["table"] = b * h * self.num_tuples * 4 * (2 + g)
            else:
                scanned = sc
                pallas = (self.impl or default_impl()) != "xla"
                out["codes"] = int(h * self.m * end.sum()) if pallas else b * h * self.m * sc
                out["scores"] = 2 * b * hq * sc * 4 + b * h * sc * 4
            out["words"] = 2 * 2 * b * h * (scanned // _WORD) * 4
            out["indices"] = b * h * state.topk * (4 + 1)
        short = np.asarray(state.lengths) - state.sink <= self.num_centroids
        if self.dense_short and short.any():
            out["attention"] = block_plan_bytes(state.k, live, num_heads=hq, with_mask=True)
        else:
            chunk = _row_chunk(state.k)
            qo = b * hq * d * item + b * hq * (d + 2) * 4  # one call's query and partial outputs
            calls, rows = 1, 1  # the new token: from the input, its mask row
            out["kv"] = 0
            if state.sink:
                calls, rows = calls + 1, rows + state.sink
                out["kv"] += b * h * state.sink * 2 * d * item
            if state.window:
                c = min(chunk, state.window, s)
                span = max(int(np.minimum(t, s).max() - np.maximum(t - w, state.sink).min()), 0)
                trips = -(-span // c)
                if attention.one_pass():  # _attend_window: one slice of the window's width per sequence
                    c, trips = min(state.window, s), 1
                calls, rows = calls + trips, rows + trips * c
                out["kv"] += b * h * trips * c * 2 * d * item
            if state.topk:
                c = min(chunk, state.topk)
                got = np.minimum(kk, np.maximum(end - state.sink, 0))
                trips = attention.chunk_trips(got.max(), c, state.topk)
                calls, rows = calls + trips, rows + trips * c
                out["kv"] += b * h * trips * c * 2 * d * item
            out["attention"] = calls * qo + b * h * rows
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
