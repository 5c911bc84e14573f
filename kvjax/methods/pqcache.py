"""``pqcache`` (Zhang et al., 2024, *PQCache*): product-quantized keys, top-k retrieval by PQ lookup.

A recall method: the full KV stays resident (it shrinks what each decode step *reads*, not what is stored).
Method note ``docs/notes/pqcache.md`` (§2.2-2.6, §8); paper §3.1 (PQ construction, decode retrieval,
new tokens), §3.3 (K-means at prefill).

- Prefill (paper §3.1, note §2.3): every prompt KV is stored. Per KV head, the post-RoPE keys of the
  non-sink prompt tokens ``[sink, L)`` are split into ``m`` contiguous sub-vectors (HF ``rotate_half``
  order, note A14) and each sub-space is clustered with K-means into ``2^bits`` centroids
  (:mod:`kvjax.methods.kmeans`: Lloyd, Euclidean, fixed ``iters``, seeded init rows shared by the heads and
  sub-spaces of a sequence as in the authors' code, empty clusters keep their centroid). Every prompt token
  gets ``m`` uint8 codes (the final assignment).
- Decode (paper §3.1, note §2.4, §8.7): the new key is encoded with the frozen centroids when written (the
  same code the paper assigns when it leaves the local window, since centroids never change; note §2.5, §8.5).
  Per query head a lookup table ``lut[i, c] = q_i · C_{i,c}`` gives approximate logits for every token from
  its codes (:func:`kernels_pallas.pq_lookup.pq_lookup`). Candidates are the tokens in ``[sink, t - W)``; per
  query head ``softmax(s_hat / sqrt(D))`` over the candidates is summed over the query group (the authors'
  GQA rule; with G = 1 the raw logits rank), and ``lax.top_k`` picks ``k`` per KV head (exact top-k, ties to
  the lower position). Exact attention then runs over sinks + the local window + the ``k`` retrieved tokens
  + the new token (gathered at fixed shape ``sink + W_max + k_max + 1``).
- Budget split (authors' code, note §2.2, A1), exact integers (:mod:`kvjax.budget`): ``budget = r`` (float)
  gives each sequence ``W_b = floor((n_b - sink) r lr)`` local and ``k_b = floor((n_b - sink) r (1 - lr))``
  retrieved tokens of its own prompt length ``n_b`` (never the bucket), ``lr = local_ratio`` (0.5). ``r`` and
  ``lr`` are read as the decimals they are written as (:func:`kvjax.budget.as_fraction`); each product is one
  fraction ``p/q`` applied with :func:`kvjax.budget.floor_mul` (int32-safe while ``q^2 < 2^31``; a product
  with a larger denominator is rounded *down* to the ``1/10000`` grid, which never happens for budgets and
  ratios with at most two decimals). An int budget is a token count ``W + k`` with ``W = floor(budget lr)``.
  The static ``window``/``topk`` (gather sizes) are those of the bucket, the maxima. Default ``sink = 32``.
- Live slots only: the state's ``filled [B]`` counts the written slots (prompt + decoded). The PQ lookup gets
  the candidate end ``t - W_b`` as its ``lengths`` (the Pallas kernels read and score no code block past it),
  the group softmax and the top-k are masked to ``[sink, t - W_b)``, and the dense fallback attends with
  ``lengths = filled``. ``lax.top_k`` needs a static size: it runs over the ``S - sink`` masked scores (no
  tighter static bound exists: a sequence may fill the whole bucket); :meth:`PQCache.bytes_read_breakdown`
  counts that buffer.
- Memory vs bandwidth: every token stays stored (``tokens_held = held(n, steps) = n + steps``); what a step
  *attends* is ``sink + W_b + k_b + 1`` tokens (:meth:`PQCache.attended`, the whole cache for a
  ``dense_short`` row), and what it reads is :meth:`PQCache.bytes_read_per_step`.
- Recall method (``recalls = True``): :meth:`PQCache.selected_positions` is the mask of the positions the next
  step attends (sinks + window + retrieved, the new token excluded), which ``kvjax-eval fidelity`` compares
  with the exact top-B attention tokens (``topb_recall``).

Shapes (per layer): k, v ``[B, Hkv, S, D]`` (``S`` = prompt bucket + max_new_tokens, slot = position); codes
``[B, Hkv, m, S_c]`` uint8, sub-space-major: the layout the PQ-lookup kernels read (no per-step repack), with
``S_c`` = ``S`` rounded up to ``CODE_ALIGN`` when a Pallas kernel does the lookup (no padding copy per step;
``S_c = S`` on the XLA path); centroids ``[B, Hkv, m, 2^bits, D/m]`` float32; lengths (prompt) and filled
``[B]`` int32. Axes in einsums: b batch, h KV head, g query head in group, i sub-space, c centroid, d
sub-vector dim, s slot.

Host offload (``offload=True``, EXPERIMENTAL): the full K/V live in the ``pinned_host`` memory kind (results
of prefill/decode are placed there with ``jax.device_put``), the gathered rows are moved to device memory for
attention. CPU raises a ValueError (no separate device memory). Not yet run on an accelerator: XLA has no
first-class per-row gather from host memory inside ``jit`` (note §8.10), so it may move whole arrays; measure
before relying on it.

Short prompts (note A11, authors' code): a sequence with ``L - sink <= 2^bits`` attends to every cached token
(``dense_short=True``); in a batch that has one, a ``lax.cond`` switches the step to attention over the live
slots ``[0, filled)`` with a per-row mask (the other rows keep exactly their sparse set), else the step reads
only the gathered set. Any prompt length and budget works (a prompt shorter than the sinks attends to what
exists); only impossible configurations raise (``m`` not dividing ``head_dim``, bad values).

Not reproduced: the paper's CPU offload machinery (overlap, adaptive iterations, the GPU block cache).
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
from kernels_pallas.pq_lookup import CODE_ALIGN, default_impl, pq_lookup
from kvjax import attention, sharding
from kvjax.budget import as_fraction, check_budget, floor_fraction, floor_mul
from kvjax.methods import kmeans as km
from kvjax.methods.base import Capacity, Method, rows_at, top_k, tree_bytes

from kvjax.attention import NEG_INF  # noqa: E402  (defined once)
#: Largest denominator ``floor_mul`` takes exactly on int32 (``(n % q) p < q^2 < 2^31``).
_EXACT_Q = 46340


@struct.dataclass
class PQState:
    """Full KV plus the PQ index of one layer. ``window``/``topk``/``sink`` are the static maxima."""

    k: jnp.ndarray  # [B, Hkv, S, D]
    v: jnp.ndarray  # [B, Hkv, S, D]
    codes: jnp.ndarray  # [B, Hkv, m, S_c] uint8 (sub-space-major, S_c >= S)
    centroids: jnp.ndarray  # [B, Hkv, m, K, D/m] float32
    lengths: jnp.ndarray  # [B] int32 prompt lengths (0 before prefill)
    filled: jnp.ndarray  # [B] int32 slots written: prompt + decoded tokens
    sink: int = struct.field(pytree_node=False, default=0)
    window: int = struct.field(pytree_node=False, default=0)
    topk: int = struct.field(pytree_node=False, default=0)


def _host_sharding():
    """The ``pinned_host`` sharding of the default device, or a ValueError where the backend has none."""
    backend = jax.default_backend()
    dev = jax.devices()[0]
    if backend == "cpu":
        raise ValueError("offload=True is not supported on the CPU backend: the KV already lives in host memory "
                         "and there is no separate device memory to offload from; use offload=False on CPU "
                         "(offload needs a GPU/TPU backend with a 'pinned_host' memory kind)")
    kinds = {m.kind for m in dev.addressable_memories()}
    if "pinned_host" not in kinds:
        raise ValueError(f"offload=True needs the 'pinned_host' memory kind, but device {dev} offers "
                         f"{sorted(kinds)}; use offload=False")
    return jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")


def _rows_mask(idx, ok, s: int) -> jnp.ndarray:
    """``[B, Hkv, S]`` bool: the slots ``idx [B, Hkv, N]`` whose ``ok`` is set."""
    b, h = idx.shape[:2]
    return rows_at(jnp.zeros((b, h, s), bool), idx, ok, "max")


def _int32_fraction(f: Fraction) -> tuple[int, int]:
    """``(p, q)`` of ``f`` in ``[0, 1]``, exact when ``q^2 < 2^31``, else rounded down to ``1/MAX_DENOMINATOR``."""
    return floor_fraction(f, _EXACT_Q)


@dataclasses.dataclass(frozen=True)
class PQCache(Method):
    name: ClassVar[str] = "pqcache"
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

    def __post_init__(self):
        check_budget(self.budget)
        if not isinstance(self.m, int) or self.m < 1:
            raise ValueError(f"m={self.m!r} (sub-spaces) must be an int >= 1")
        if not isinstance(self.bits, int) or not 1 <= self.bits <= 8:
            raise ValueError(f"bits={self.bits!r} must be an int in [1, 8]: codes are stored as uint8; use bits <= 8")
        if not isinstance(self.sink, int) or self.sink < 0:
            raise ValueError(f"sink={self.sink!r} must be an int >= 0")
        if isinstance(self.local_ratio, bool) or not isinstance(self.local_ratio, (int, float)) \
                or not 0.0 <= self.local_ratio <= 1.0:
            raise ValueError(f"local_ratio={self.local_ratio} must be in [0, 1]")
        if not isinstance(self.iters, int) or self.iters < 0:
            raise ValueError(f"iters={self.iters!r} must be an int >= 0")
        if self.impl not in (None, "xla", "pallas_tpu", "pallas_gpu"):
            raise ValueError(f"impl={self.impl!r} must be None, 'xla', 'pallas_tpu' or 'pallas_gpu'")

    @property
    def num_centroids(self) -> int:
        return 2 ** self.bits

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

    def attended(self, n: int, steps: int) -> int:
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
        if (self.impl or default_impl()) == "xla":
            return slots
        return -(-slots // CODE_ALIGN) * CODE_ALIGN

    def init(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> PQState:
        h, d = model_cfg.num_kv_heads, model_cfg.head_dim
        if d % self.m:
            raise ValueError(f"m={self.m} does not divide head_dim={d}; choose m among the divisors of {d}")
        slots = capacity.prompt_len + capacity.max_new_tokens
        sink = min(self.sink, slots)
        w, k = self.split(capacity.prompt_len)  # per-sequence values are at most the bucket's
        state = PQState(
            k=jnp.zeros((batch, h, slots, d), dtype), v=jnp.zeros((batch, h, slots, d), dtype),
            codes=jnp.zeros((batch, h, self.m, self._code_slots(slots)), jnp.uint8),
            centroids=jnp.zeros((batch, h, self.m, self.num_centroids, d // self.m), jnp.float32),
            lengths=jnp.zeros((batch,), jnp.int32), filled=jnp.zeros((batch,), jnp.int32), sink=sink,
            window=min(w, slots - sink), topk=min(k, slots - sink))
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
        return state.replace(k=self._place(new_k), v=self._place(new_v),
                             codes=state.codes.at[..., :t].set(labels.astype(jnp.uint8)),
                             centroids=cent, lengths=lengths, filled=lengths)

    def _place(self, x):
        return jax.device_put(x, _host_sharding()) if self.offload else x

    def encode(self, centroids, k) -> jnp.ndarray:
        """Codes ``[B, Hkv, m]`` uint8 of keys ``k [B, Hkv, D]``: nearest frozen centroid per sub-space."""
        b, h, d = k.shape
        x = k.astype(jnp.float32).reshape(b, h, self.m, 1, d // self.m)
        return km.assign(x, centroids)[..., 0].astype(jnp.uint8)

    def scores(self, state: PQState, q, lengths=None) -> jnp.ndarray:
        """Approximate logits ``q · k_hat`` ``[B, Hkv, G, S]`` float32 from the codes (unscaled); slots
        ``>= lengths[b]`` (default: ``filled``) are ``NEG_INF`` and their code blocks are not read."""
        b, hq, d = q.shape
        h, s = state.k.shape[1], state.k.shape[2]
        qs = q.astype(jnp.float32).reshape(b, h, hq // h, self.m, d // self.m)
        lut = jnp.einsum("bhgid,bhicd->bhgic", qs, state.centroids, precision=jax.lax.Precision.HIGHEST)
        lengths = state.filled if lengths is None else lengths
        lookup = lambda t, c, n: pq_lookup(t, c, n, impl=self.impl)  # noqa: E731  (per device on a mesh)
        return sharding.per_head(lookup, lut, state.codes, lengths)[..., :s]

    def select(self, state: PQState, q, t):
        """Retrieved slots ``idx [B, Hkv, k_max]`` int32 and ``ok`` bool (note §8.7). t ``[B]`` = new position.

        Candidates ``[sink, t - W_b)``: the lookup scores only slots below ``t - W_b`` (always ``< filled``), the
        softmax and the top-k see the ``S - sink`` slots past the sinks with the others masked."""
        b, hq, d = q.shape
        h, s = state.k.shape[1], state.k.shape[2]
        sink = state.sink
        w, kk = self.split_dynamic(state.lengths)
        end = jnp.clip(jnp.minimum(t - w, state.filled), 0, s)  # candidate end (exclusive)
        j = jnp.arange(sink, s)
        cand = (j[None, :] < end[:, None])[:, None, None, :]  # [B, 1, 1, S - sink]
        z = jnp.where(cand, self.scores(state, q, end)[..., sink:] / jnp.sqrt(jnp.float32(d)), NEG_INF)
        if hq == h:
            agg = z[:, :, 0]
        else:
            p = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))
            p = jnp.where(cand, p, 0.0)
            agg = (p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)).sum(axis=2)
        agg = jnp.where(cand[:, :, 0], agg, NEG_INF)  # [B, Hkv, S - sink]
        vals, idx = top_k(agg, state.topk)
        ok = (jnp.arange(state.topk)[None, None, :] < kk[:, None, None]) & (vals > NEG_INF / 2)
        return (idx + sink).astype(jnp.int32), ok

    def decode(self, state: PQState, layer: int, q, k, v, pos):
        """Encode + store the new token, retrieve, attend (note §2.4-2.5, §8.5-8.8). q ``[B, Hq, D]``; k, v
        ``[B, Hkv, D]``; pos ``[B]`` -> (out ``[B, Hq, D]`` float32, state)."""
        b, h, d = k.shape
        t = pos.astype(jnp.int32)
        ti = jnp.broadcast_to(t[:, None], (b, h))
        code = self.encode(state.centroids, k)  # [B, Hkv, m]
        codes = jnp.swapaxes(rows_at(jnp.swapaxes(state.codes, 2, 3), ti, code), 2, 3)  # [B, Hkv, m, S]
        state = state.replace(k=self._place(rows_at(state.k, ti, k)), v=self._place(rows_at(state.v, ti, v)),
                              codes=codes,
                              filled=jnp.maximum(state.filled, t + 1))
        idx, ok = self._attended_rows(state, q, t)
        idx = jnp.concatenate([idx, jnp.broadcast_to(t[:, None, None], (b, h, 1))], axis=-1)  # + the new token
        ok = jnp.concatenate([ok, jnp.ones((b, h, 1), bool)], axis=-1)

        def sparse(_):
            # Reads exactly the N = sink + window + topk + 1 gathered rows per KV head.
            kk = jnp.take_along_axis(state.k, idx[..., None], axis=2)
            vv = jnp.take_along_axis(state.v, idx[..., None], axis=2)
            if self.offload:
                dev = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
                kk, vv = jax.device_put(kk, dev), jax.device_put(vv, dev)
            return attention.attend(q, kk, vv, ok)

        if not self.dense_short:
            return attention.normalise(sparse(None)), state
        short = self._short(state)  # [B]

        def dense(_):
            # Authors' fallback (note A11): a short prompt's row attends to every cached token; the other
            # rows of the batch keep exactly their sparse set, as a mask; only the live slots are read.
            every = jnp.arange(state.k.shape[2])[None, None, :] <= t[:, None, None]
            return attention.attend(q, state.k, state.v,
                                    jnp.where(short[:, None, None], every, _rows_mask(idx, ok, state.k.shape[2])),
                                    lengths=state.filled)

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
        sel = _rows_mask(*self._attended_rows(state, q, t), s)
        if self.dense_short:
            every = (jnp.arange(s)[None, :] < t[:, None])[:, None, :]
            sel = jnp.where(self._short(state)[:, None, None], every, sel)
        return jnp.repeat(sel, hq // h, axis=1)

    def _short(self, state: PQState) -> jnp.ndarray:
        """``[B]`` bool: the row's prompt is short enough for the authors' dense fallback (note A11)."""
        return (state.lengths - state.sink) <= self.num_centroids

    def _attended_rows(self, state: PQState, q, t):
        """Slots ``[B, Hkv, sink + window + topk]`` int32 (clipped into the buffer) and ``ok`` bool the step whose
        new token is at ``t [B]`` attends besides it: the sinks ``[0, min(sink, t))``, the local window
        ``[max(t - W_b, sink), t)`` and the retrieved tokens (:meth:`select`)."""
        b, h = q.shape[0], state.k.shape[1]
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
        if state.topk:
            idx, ok = self.select(state, q, t)
            parts.append(idx)
            oks.append(ok)
        if not parts:
            return jnp.zeros((b, h, 0), jnp.int32), jnp.zeros((b, h, 0), bool)
        idx = jnp.clip(jnp.concatenate(parts, axis=-1), 0, state.k.shape[2] - 1)
        return idx, jnp.concatenate(oks, axis=-1)

    def memory_bytes(self, state: PQState) -> int:
        """Stored bytes: full KV + codes + centroids + lengths + fill counts (the KV is not shrunk; see
        :meth:`bytes_read_per_step`)."""
        return tree_bytes(state)

    def tokens_held(self, state: PQState):
        """``[B]`` float32 tokens stored: the full KV stays resident (prompt + decoded so far = ``filled``)."""
        return jnp.asarray(state.filled, jnp.float32)

    def held(self, n: int, steps: int, layer: int = 0, num_layers: int = 1) -> int:
        """Every token is stored: ``n + steps``. (Tokens attended per step: :meth:`attended`.)"""
        return n + steps

    def bytes_read_breakdown(self, state: PQState, num_heads: int | None = None) -> dict[str, int]:
        """Bytes the next decode step of this layer reads (new token at ``t = filled``), by part; concrete
        state only (call outside ``jit``). ``num_heads`` query heads (default the KV heads).

        - ``codes``: ``m`` bytes per slot below the candidate end ``t - W_b`` (the Pallas kernels read no
          block past it; they round up to their token tile, the XLA reference reads all ``S_c`` slots);
        - ``centroids`` (read for the LUT) and ``lut`` (float32, written then read by the lookup);
        - ``scores``: the lookup's float32 output ``[Hq, S]`` (written; blocks past the candidate end are only
          filled with ``NEG_INF``) and its ``S - sink`` slots past the sinks read by the masked group softmax;
          ``topk``: the ``S - sink`` float32 scores ``lax.top_k`` reads (a static size, see the module doc);
        - ``kv_gathered``: the ``N = sink + window + topk + 1`` K and V rows per KV head the gather reads
          (fixed shape: rows of a short sequence's unused entries are read too, then masked);
        - ``attention``: the decode-attention block plan over the gathered ``N`` rows (their K/V, the float32
          mask, the query and outputs: :func:`~kernels_pallas.decode_attention.block_plan_bytes`).

        A step of a batch with a ``dense_short`` row reads, instead of the last two, the block plan over the
        live slots ``[0, t + 1)`` of the full cache (with its mask). ``full_kv`` (not in ``total``) is what full
        attention over the same live slots would read, for comparison."""
        b, h, s, d = state.k.shape
        hq = num_heads or h
        item = np.dtype(state.k.dtype).itemsize
        filled = np.asarray(state.filled, np.int64)
        w, _ = (np.asarray(x, np.int64) for x in self.split_dynamic(state.lengths))
        t = filled  # the next step's new token position
        end = np.clip(np.minimum(t - w, filled), 0, s)
        live = jnp.asarray(np.minimum(t + 1, s), jnp.int32)
        n_att = state.sink + state.window + state.topk + 1
        out = {"codes": int(h * self.m * end.sum()), "centroids": int(state.centroids.size * 4),
               "lut": 2 * b * hq * self.m * self.num_centroids * 4, "scores": 0, "topk": 0}
        if state.topk:
            out["scores"] = b * hq * s * 4 + b * hq * (s - state.sink) * 4
            out["topk"] = b * h * (s - state.sink) * 4
        else:  # no retrieval: no lookup runs
            out["codes"] = out["centroids"] = out["lut"] = 0
        short = np.asarray(state.lengths) - state.sink <= self.num_centroids
        if self.dense_short and short.any():
            out["kv_gathered"] = 0
            out["attention"] = block_plan_bytes(state.k, live, num_heads=hq, with_mask=True)
        else:
            gathered = jax.ShapeDtypeStruct((b, h, n_att, d), state.k.dtype)
            out["kv_gathered"] = 2 * b * h * n_att * d * item
            out["attention"] = block_plan_bytes(gathered, num_heads=hq, with_mask=True)
        out["total"] = sum(out.values())
        out["full_kv"] = block_plan_bytes(state.k, live, num_heads=hq, with_mask=False)
        return out

    def bytes_read_per_step(self, state: PQState, num_heads: int | None = None) -> int:
        """Total of :meth:`bytes_read_breakdown`: codes below the candidate end, centroids, LUT, the score
        buffers, the gathered K/V rows and the attention over them (query and outputs included)."""
        return self.bytes_read_breakdown(state, num_heads)["total"]
