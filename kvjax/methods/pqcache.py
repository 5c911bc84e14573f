"""``pqcache`` (Zhang et al., 2024, *PQCache*): product-quantized keys, top-k retrieval by PQ lookup.

A recall method: the full KV stays resident (it shrinks what each decode step *reads*, not what is stored).
Method note ``../shared/specs/pqcache.md`` (§2.2-2.6, §8); paper §3.1 (PQ construction, decode retrieval,
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
- Budget split (authors' code, note §2.2, A1): ``budget = r`` (float) gives ``W = int((L - sink) r lr)``
  local and ``k = int((L - sink) r (1 - lr))`` retrieved tokens per sequence, ``lr = local_ratio`` (0.5);
  an int budget is a token count ``W + k`` with ``W = int(budget lr)``. Default ``sink = 32``.

Shapes (per layer): k, v ``[B, Hkv, S, D]`` (``S`` = prompt bucket + max_new_tokens, slot = position); codes
``[B, Hkv, S, m]`` uint8; centroids ``[B, Hkv, m, 2^bits, D/m]`` float32; lengths ``[B]`` int32. Axes in
einsums: b batch, h KV head, g query head in group, i sub-space, c centroid, d sub-vector dim, s slot.

Host offload (``offload=True``, EXPERIMENTAL): the full K/V live in the ``pinned_host`` memory kind (results
of prefill/decode are placed there with ``jax.device_put``), the gathered rows are moved to device memory for
attention. CPU raises a ValueError (no separate device memory). Not yet run on an accelerator: XLA has no
first-class per-row gather from host memory inside ``jit`` (note §8.10), so it may move whole arrays; measure
before relying on it.

Short prompts (note A11, authors' code): a sequence with ``L - sink <= 2^bits`` attends to every cached token
(``dense_short=True``); in a batch that has one, a ``lax.cond`` switches the step to attention over all slots
with a per-row mask (the other rows keep exactly their sparse set), else the step reads only the gathered set.

Not reproduced: the paper's CPU offload machinery (overlap, adaptive iterations, the GPU block cache).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from kernels_pallas.pq_lookup import pq_lookup
from kvjax import attention
from kvjax.methods import kmeans as km
from kvjax.methods.base import Capacity, Method, tree_bytes

NEG_INF = -1e30


@struct.dataclass
class PQState:
    """Full KV plus the PQ index of one layer. ``window``/``topk``/``sink`` are the static maxima."""

    k: jnp.ndarray  # [B, Hkv, S, D]
    v: jnp.ndarray  # [B, Hkv, S, D]
    codes: jnp.ndarray  # [B, Hkv, S, m] uint8
    centroids: jnp.ndarray  # [B, Hkv, m, K, D/m] float32
    lengths: jnp.ndarray  # [B] int32 prompt lengths (0 before prefill)
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


@dataclasses.dataclass(frozen=True)
class PQCache(Method):
    name: ClassVar[str] = "pqcache"
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
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise ValueError(f"budget={b!r} must be a fraction r in (0, 1] (float) or a token count >= 1 (int)")
        if isinstance(b, float) and not 0.0 < b <= 1.0:
            raise ValueError(f"budget={b} as a fraction must be in (0, 1]; pass an int for a token count")
        if isinstance(b, int) and b < 1:
            raise ValueError(f"budget={b} tokens must be >= 1")
        if not isinstance(self.m, int) or self.m < 1:
            raise ValueError(f"m={self.m!r} (sub-spaces) must be an int >= 1")
        if not isinstance(self.bits, int) or not 1 <= self.bits <= 8:
            raise ValueError(f"bits={self.bits!r} must be an int in [1, 8]: codes are stored as uint8; use bits <= 8")
        if not isinstance(self.sink, int) or self.sink < 0:
            raise ValueError(f"sink={self.sink!r} must be an int >= 0")
        if not 0.0 <= self.local_ratio <= 1.0:
            raise ValueError(f"local_ratio={self.local_ratio} must be in [0, 1]")
        if not isinstance(self.iters, int) or self.iters < 0:
            raise ValueError(f"iters={self.iters!r} must be an int >= 0")
        if self.impl not in (None, "xla", "pallas_tpu", "pallas_gpu"):
            raise ValueError(f"impl={self.impl!r} must be None, 'xla', 'pallas_tpu' or 'pallas_gpu'")

    @property
    def num_centroids(self) -> int:
        return 2 ** self.bits

    # ---- budget split (authors' code: W = int((L-S) r lr), k = int((L-S) r (1-lr))) ----

    def split(self, prompt_len: int) -> tuple[int, int]:
        """Static ``(W, k)`` for a prompt of ``prompt_len`` tokens."""
        n = max(prompt_len - self.sink, 0)
        if isinstance(self.budget, float):
            return int(n * self.budget * self.local_ratio), int(n * self.budget * (1.0 - self.local_ratio))
        w = int(self.budget * self.local_ratio)
        return w, self.budget - w

    def split_dynamic(self, lengths: jnp.ndarray):
        """Per-sequence ``(W [B], k [B])`` int32 (float32 products truncated as ``int()`` does)."""
        n = jnp.maximum(lengths - self.sink, 0).astype(jnp.float32)
        if isinstance(self.budget, float):
            w = jnp.floor(n * self.budget * self.local_ratio)
            k = jnp.floor(n * self.budget * (1.0 - self.local_ratio))
            return w.astype(jnp.int32), k.astype(jnp.int32)
        w, k = self.split(0)
        return jnp.full_like(lengths, w), jnp.full_like(lengths, k)

    # ---- the method interface ----

    def init(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> PQState:
        h, d = model_cfg.num_kv_heads, model_cfg.head_dim
        if d % self.m:
            raise ValueError(f"m={self.m} does not divide head_dim={d}; choose m among the divisors of {d}")
        slots = capacity.prompt_len + capacity.max_new_tokens
        w, k = self.split(capacity.prompt_len)  # per-sequence values are at most the bucket's
        if w + k == 0 and not (self.dense_short and capacity.prompt_len - self.sink <= self.num_centroids):
            raise ValueError(f"budget={self.budget} with sink={self.sink} gives no local or retrieved tokens at "
                             f"prompt bucket {capacity.prompt_len}; raise the budget or lower sink")
        cand = slots - min(self.sink, slots) - w
        if k > cand:
            raise ValueError(f"budget={self.budget} asks for k={k} retrieved tokens but at most {cand} candidates "
                             f"exist ({slots} slots - sink {self.sink} - window {w}); lower the budget or raise "
                             "local_ratio")
        state = PQState(
            k=jnp.zeros((batch, h, slots, d), dtype), v=jnp.zeros((batch, h, slots, d), dtype),
            codes=jnp.zeros((batch, h, slots, self.m), jnp.uint8),
            centroids=jnp.zeros((batch, h, self.m, self.num_centroids, d // self.m), jnp.float32),
            lengths=jnp.zeros((batch,), jnp.int32), sink=min(self.sink, slots), window=w, topk=k)
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
        cent, labels = km.kmeans(x, valid[:, None, None, :], c0, self.iters)
        codes = labels.transpose(0, 1, 3, 2).astype(jnp.uint8)  # [B, Hkv, T, m]
        new_k = state.k.at[:, :, :t].set(k.astype(state.k.dtype))
        new_v = state.v.at[:, :, :t].set(v.astype(state.v.dtype))
        return state.replace(k=self._place(new_k), v=self._place(new_v), codes=state.codes.at[:, :, :t].set(codes),
                             centroids=cent, lengths=lengths.astype(jnp.int32))

    def _place(self, x):
        return jax.device_put(x, _host_sharding()) if self.offload else x

    def encode(self, centroids, k) -> jnp.ndarray:
        """Codes ``[B, Hkv, m]`` uint8 of keys ``k [B, Hkv, D]``: nearest frozen centroid per sub-space."""
        b, h, d = k.shape
        x = k.astype(jnp.float32).reshape(b, h, self.m, 1, d // self.m)
        return km.assign(x, centroids)[..., 0].astype(jnp.uint8)

    def scores(self, state: PQState, q) -> jnp.ndarray:
        """Approximate logits ``q · k_hat`` ``[B, Hkv, G, S]`` float32 from the codes (unscaled)."""
        b, hq, d = q.shape
        h = state.k.shape[1]
        qs = q.astype(jnp.float32).reshape(b, h, hq // h, self.m, d // self.m)
        lut = jnp.einsum("bhgid,bhicd->bhgic", qs, state.centroids, precision=jax.lax.Precision.HIGHEST)
        return pq_lookup(lut, state.codes, impl=self.impl)

    def select(self, state: PQState, q, t):
        """Retrieved slots ``idx [B, Hkv, k_max]`` int32 and ``ok`` bool (note §8.7). t ``[B]`` = new position."""
        b, hq, d = q.shape
        h, s = state.k.shape[1], state.k.shape[2]
        w, kk = self.split_dynamic(state.lengths)
        j = jnp.arange(s)
        cand = ((j[None, :] >= state.sink) & (j[None, :] < (t - w)[:, None]))[:, None, None, :]  # [B,1,1,S]
        z = jnp.where(cand, self.scores(state, q) / jnp.sqrt(jnp.float32(d)), NEG_INF)  # [B, Hkv, G, S]
        if hq == h:
            agg = z[:, :, 0]
        else:
            p = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))
            p = jnp.where(cand, p, 0.0)
            agg = (p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)).sum(axis=2)
        agg = jnp.where(cand[:, :, 0], agg, NEG_INF)  # [B, Hkv, S]
        vals, idx = jax.lax.top_k(agg, state.topk)
        ok = (jnp.arange(state.topk)[None, None, :] < kk[:, None, None]) & (vals > NEG_INF / 2)
        return idx.astype(jnp.int32), ok

    def decode(self, state: PQState, layer: int, q, k, v, pos):
        """Encode + store the new token, retrieve, attend (note §2.4-2.5, §8.5-8.8). q ``[B, Hq, D]``; k, v
        ``[B, Hkv, D]``; pos ``[B]`` -> (out ``[B, Hq, D]`` float32, state)."""
        b, h, d = k.shape
        t = pos.astype(jnp.int32)
        bi, hi, ti = jnp.arange(b)[:, None], jnp.arange(h)[None, :], t[:, None]
        code = self.encode(state.centroids, k)
        state = state.replace(k=self._place(state.k.at[bi, hi, ti].set(k.astype(state.k.dtype))),
                              v=self._place(state.v.at[bi, hi, ti].set(v.astype(state.v.dtype))),
                              codes=state.codes.at[bi, hi, ti].set(code))
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
        parts.append(jnp.broadcast_to(t[:, None, None], (b, h, 1)))
        oks.append(jnp.ones((b, h, 1), bool))
        idx = jnp.clip(jnp.concatenate(parts, axis=-1), 0, state.k.shape[2] - 1)  # [B, Hkv, N]
        ok = jnp.concatenate(oks, axis=-1)

        def sparse(_):
            kk = jnp.take_along_axis(state.k, idx[..., None], axis=2)
            vv = jnp.take_along_axis(state.v, idx[..., None], axis=2)
            if self.offload:
                dev = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
                kk, vv = jax.device_put(kk, dev), jax.device_put(vv, dev)
            return attention.attend(q, kk, vv, ok)

        if not self.dense_short:
            return attention.normalise(sparse(None)), state
        short = (state.lengths - state.sink) <= self.num_centroids  # [B]

        def dense(_):
            # Authors' fallback (note A11): a short prompt's row attends to every cached token; the other
            # rows of the batch keep exactly their sparse set, as a mask over all slots.
            s = state.k.shape[2]
            sel = jnp.zeros((b, h, s), jnp.int32).at[bi[..., None], hi[..., None], idx].max(ok.astype(jnp.int32))
            every = jnp.arange(s)[None, None, :] <= t[:, None, None]
            return attention.attend(q, state.k, state.v, jnp.where(short[:, None, None], every, sel > 0))

        return attention.normalise(jax.lax.cond(jnp.any(short), dense, sparse, None)), state

    def memory_bytes(self, state: PQState) -> int:
        """Stored bytes: full KV + codes + centroids + lengths (the KV is not shrunk; see
        :meth:`bytes_read_per_step`)."""
        return tree_bytes(state)

    def tokens_held(self, state: PQState):
        """``[B]`` tokens stored (the full KV stays resident: prompt + decoded so far)."""
        return jnp.asarray(state.lengths, jnp.float32)  # TODO(helper): + decoded

    def held(self, n: int, steps: int, layer: int = 0, num_layers: int = 1) -> int:
        return n + steps

    def bytes_read_per_step(self, state: PQState, num_heads: int | None = None) -> dict[str, int]:
        """Bytes one decode step reads for this layer at the static maxima: the codes and centroids (scoring),
        the approximate logits (float32, written then read by the top-k; ``num_heads`` query heads, default
        the KV heads), the attended K/V rows (sinks + window + k + new token), and ``full_kv`` for comparison
        (what full attention over every slot reads). A step of a batch with a short-prompt row
        (``dense_short``) reads ``full_kv`` instead of ``kv_attended``."""
        b, h, s, d = state.k.shape
        item = state.k.dtype.itemsize
        hq = num_heads or h
        n_att = state.sink + state.window + state.topk + 1
        out = {"codes": b * h * s * self.m, "centroids": int(state.centroids.size * 4),
               "scores": 2 * b * hq * s * 4, "kv_attended": 2 * b * h * n_att * d * item}
        out["total"] = sum(out.values())
        out["full_kv"] = 2 * b * h * s * d * item
        return out
