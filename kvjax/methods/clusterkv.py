"""``clusterkv`` (Liu et al., DAC'25, *ClusterKV*): recall tokens by semantic clusters of their keys.

A recall method: every token stays stored; a decode step attends the sinks, the tokens of the clusters whose
centroids score highest against the query, and the recent not-yet-clustered tokens. Method note
``docs/notes/clusterkv.md`` (§2, §6 resolutions, §7 layout); paper §III (semantic clustering, selection
at cluster granularity), §IV-B/C (batched clustering, CSR indexing).

- **Prefill** (paper §III-B): per KV head, the post-RoPE prompt keys after the sinks are clustered by K-means
  under cosine distance (:func:`cosine_kmeans`: seeded random init rows sampled without replacement per
  position, layer and KV head (note §6 #3); Lloyd steps whose centroid is the mean of the raw member keys; an
  empty cluster keeps its centroid; stop when no label changes or after ``iters`` updates; a last assignment,
  note §2.3). ``C0 = max(1, Lc // tokens_per_cluster)`` clusters for ``Lc`` clustered tokens (the paper's
  ``L/80``, note §6 #2) or ``num_clusters``. The assignment and the centroid update go through
  :mod:`kernels_pallas.cosine_kmeans` (Pallas on TPU/GPU, its pure-JAX reference on CPU).
- **Cluster-sorted layout** (note §7.5c): the K/V rows of the clustered region are stored *permuted into
  cluster order* (positions ascending inside a cluster), with the cluster's first slot ``cstart`` and size
  ``csize``, so a selected cluster is a contiguous run of slots; ``pos`` keeps each slot's position. Slots:
  ``[0, sink_b)`` sinks, ``[sink_b, n_b)`` prompt clusters, then the decoded tokens by position, each window of
  ``window`` of them permuted in place once it is clustered.
- **Decode** (paper §III-C, note §2.5, §7.4): the centroids are scored by ``q·mu`` (inner product, unscaled).
  GQA (note §2.7, §6 #8): ``gqa="query"`` (default, the authors' code) ranks per query head;
  ``gqa="group_mean"`` ranks once per KV head with the group's mean query. Whole clusters are taken in
  descending score order until ``bsel_b`` tokens; the last one is cut to its earliest positions. The selected
  rows are *gathered* (exactly ``bsel`` rows per query head, or per KV head with ``group_mean``) and attended;
  the recent window ``[clustered_end, t]`` goes through the decode-attention kernel with a block list covering
  only its blocks (16 slots, 128 on TPU), the sinks as a ``[0, sink)`` slice; the three partials merge exactly.
  Every ``window`` decode steps the newest window is clustered into ``window_clusters`` clusters and appended
  (paper §III-B "clustering within the generated tokens only", note §6 #9), inside the jitted step with
  ``lax.cond`` (one compile).
- **Budget** (note §6 #1, kvjax contract): ``B_b`` tokens attended besides the recent window, sinks included: a
  fraction gives ``ceil(b n)`` of the sequence's own prompt, a count ``min(c, n + max_new_tokens)`` (so a count
  can cover generated tokens once they are clustered; :func:`kvjax.methods.base.evicting_budget`):
  ``sink_b = min(sink, B_b, n)`` sinks and ``bsel_b = B_b - sink_b`` tokens from clusters. The recent window
  (at most ``window`` tokens) and the new token are extra (the authors' efficiency path). When the clusters
  hold ``<= bsel_b`` tokens every one is attended (full attention).
- **Layers** ``< n_full`` (default 2, paper §V-A, as Quest) keep and attend the full cache (:class:`Full`).

Memory vs bandwidth: ``tokens_held = held(n, steps) = n + steps``; a step attends ``attended(n, steps)`` tokens
and reads :meth:`ClusterKV.bytes_read_per_step` bytes (centroids, sizes, the gathered rows, the sink/window
blocks). ``offload=True`` keeps K/V in ``pinned_host`` memory (accelerators only, EXPERIMENTAL as PQCache's).

Shapes (per compressed layer): k, v ``[B, Hkv, S, D]`` (``S`` = bucket + max_new_tokens); pos ``[B, Hkv, S]``
int32 (-1 empty); mu ``[B, Hkv, C, D]`` float32 with ``C = C0_max + window_clusters * W_max`` (prompt clusters
``[0, C0_max)``, window ``w``'s at ``C0_max + w * window_clusters``); csize, cstart ``[B, Hkv, C]`` int32;
lengths, sinks, bsel, filled, clustered ``[B]`` int32; windows ``[]`` int32. Einsum axes: b batch, h KV head,
g query head of the group, c cluster, s slot, j selected entry, d head dim.

Not reproduced: the GPU cache of last step's clusters (R = 1) and CPU offload overlap (note §7.8), the
asynchronous clustering stream (note §6 #18: XLA has no side stream; clustering runs in each layer's prefill).
Per-sequence clamp: a sequence with fewer clustered tokens than ``num_clusters`` gets one cluster per token (a
bucket too short for ``num_clusters`` is an error at ``init``). Clustering is batched over batch x KV heads in
each layer's prefill (the engine's layer loop calls ``prefill`` per layer; the note's batching over layers too
would need a post-prefill hook).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kernels_pallas.cosine_kmeans import cosine_assign, lloyd_step
from kernels_pallas.decode_attention import block_plan_bytes, default_impl
from kvjax import attention, sharding
from kvjax.attention import NEG_INF
from kvjax.budget import check_budget
from kvjax.methods import kmeans as km
from kvjax.methods.base import Capacity, Method, SlotCache, evicting_budget, rows_at, top_k
from kvjax.methods.full import Full

_FULL = Full()  # layers < n_full


def cosine_kmeans(x, valid, c0, cvalid, iters: int, impl=None):
    """Lloyd K-means under cosine distance (paper §III-B, note §2.3).

    x ``[N, L, D]`` keys, valid ``[N, L]`` bool, c0 ``[N, C, D]`` initial centroids, cvalid ``[N, C]`` bool ->
    (mu ``[N, C, D]`` float32, labels ``[N, L]`` int32, ``C`` for invalid rows, updates run ``[]`` int32).
    Each iteration assigns with the current centroids (argmax cosine similarity, ties to the lower index) and, if
    some label changed, moves each centroid to the mean of its members' raw keys (empty: unchanged); at most
    ``iters`` updates; then a last assignment (the labels returned)."""

    def cond(carry):
        _, _, it, done = carry
        return (it < iters) & ~done

    def body(carry):
        mu, prev, it, _ = carry
        new, labels = lloyd_step(x, mu, valid, cvalid, impl=impl)  # labels: the assignment against mu
        done = jnp.all(labels == prev)
        return jnp.where(done, mu, new), labels, it + jnp.where(done, 0, 1), done

    start = (c0.astype(jnp.float32), jnp.full(x.shape[:2], -1, jnp.int32), jnp.int32(0), jnp.bool_(False))
    mu, _, it, _ = jax.lax.while_loop(cond, body, start)
    return mu, cosine_assign(x, mu, valid, cvalid, impl=impl), it


@struct.dataclass
class ClusterState:
    """One compressed layer (see the module docstring for the slot layout)."""

    k: jnp.ndarray  # [B, Hkv, S, D]
    v: jnp.ndarray  # [B, Hkv, S, D]
    pos: jnp.ndarray  # [B, Hkv, S] int32 position of each slot, -1 empty
    mu: jnp.ndarray  # [B, Hkv, C, D] float32
    csize: jnp.ndarray  # [B, Hkv, C] int32 (0: unused or empty)
    cstart: jnp.ndarray  # [B, Hkv, C] int32 first slot of the cluster
    lengths: jnp.ndarray  # [B] prompt lengths
    sinks: jnp.ndarray  # [B] sinks attended (sink_b)
    bsel: jnp.ndarray  # [B] tokens taken from clusters (bsel_b)
    filled: jnp.ndarray  # [B] slots written (prompt + decoded)
    clustered: jnp.ndarray  # [B] end slot of the clustered region (n_b + windows * window)
    windows: jnp.ndarray  # [] decode windows clustered so far
    sink: int = struct.field(pytree_node=False, default=0)  # static: most sinks
    c0: int = struct.field(pytree_node=False, default=0)  # static: prompt cluster ids [0, c0)
    select: int = struct.field(pytree_node=False, default=0)  # static: gathered rows per selecting head
    max_new: int = struct.field(pytree_node=False, default=0)  # static: capacity.max_new_tokens


@dataclasses.dataclass(frozen=True)
class ClusterKV(Method):
    name: ClassVar[str] = "clusterkv"
    traced_layer: ClassVar[bool] = True  # scan over layers (base.Method.traced_layer)
    recalls: ClassVar[bool] = True
    budget: float | int = 1024  # prompt-side tokens attended, sinks included (the paper's B: 256..2048)
    sink: int = 16  # initial tokens always attended, never clustered (paper §III-B)
    tokens_per_cluster: int = 80  # C0 = Lc // 80 (the paper's L/80, 400 at 32k)
    num_clusters: int | None = None  # a fixed C0 instead (e.g. 400, the authors' accuracy runs)
    window: int = 320  # m: decode tokens per window clustered (paper)
    window_clusters: int = 4  # C+: clusters per window (paper; the authors' code uses 8)
    iters: int = 20  # K-means updates at most (the authors' code; the paper: until convergence)
    n_full: int = 2  # leading layers that keep full attention (paper §V-A)
    gqa: str = "query"  # "query" (each query head selects) | "group_mean"
    seed: int = 0
    impl: str | None = None  # cosine K-means kernels (None: by backend)
    offload: bool = False  # K/V in pinned_host memory (accelerators only)

    def __post_init__(self):
        check_budget(self.budget)
        for name in ("sink", "n_full"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}={v!r} must be an int >= 0")
        for name in ("tokens_per_cluster", "window", "window_clusters", "iters"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        if self.num_clusters is not None and (isinstance(self.num_clusters, bool) or
                                              not isinstance(self.num_clusters, int) or self.num_clusters < 1):
            raise ValueError(f"num_clusters={self.num_clusters!r} (C0) must be an int >= 1, or None for "
                             f"C0 = tokens // tokens_per_cluster")
        if self.window_clusters > self.window:
            raise ValueError(f"window_clusters={self.window_clusters} is more clusters than the window's "
                             f"{self.window} tokens; use window_clusters <= window")
        if isinstance(self.budget, int) and self.budget < self.sink:
            raise ValueError(f"budget={self.budget} tokens is below sink={self.sink}: the budget counts the sinks "
                             f"(note §6 #1); pass budget >= {self.sink} or a smaller sink")
        if self.gqa not in ("query", "group_mean"):
            raise ValueError(f"gqa={self.gqa!r} must be 'query' (each query head selects) or 'group_mean'")
        if self.impl not in (None, "xla", "pallas_tpu", "pallas_gpu"):
            raise ValueError(f"impl={self.impl!r} must be None, 'xla', 'pallas_tpu' or 'pallas_gpu'")

    # ---- sizes on the host (Python ints) ----

    def split(self, n: int, max_new_tokens: int = 0) -> tuple[int, int]:
        """``(sink_b, bsel_b)`` for an ``n``-token prompt: sinks and tokens taken from clusters. A token count
        can cover the generated tokens too (``min(count, n + max_new_tokens)``), a fraction is ``ceil(b n)``."""
        b = int(evicting_budget(self.budget, int(n), int(n) + max_new_tokens)) if n else 0
        s = min(self.sink, b, n)
        return s, b - s

    def clusters_for(self, n: int) -> int:
        """Prompt clusters ``C0`` of an ``n``-token prompt (0 when nothing is clustered)."""
        lc = n - min(self.sink, n)
        if lc <= 0:
            return 0
        c0 = self.num_clusters if self.num_clusters is not None else max(1, lc // self.tokens_per_cluster)
        return min(c0, lc)

    def attended(self, n: int, steps: int, max_new_tokens: int = 0) -> int:
        """Tokens (per query head) the decode step writing position ``n + steps`` attends: sinks + selected +
        the unclustered window + the new token."""
        s, bsel = self.split(n, max_new_tokens)
        unclustered = steps % self.window
        return s + min(bsel, n - s + steps - unclustered) + unclustered + 1

    def held(self, n: int, steps: int) -> int:
        return n + steps

    # ---- the method interface ----

    def init(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype):
        if layer < self.n_full:
            return _FULL.init(model_cfg, batch, capacity, layer, dtype)
        p = capacity.prompt_len
        if self.num_clusters is not None and self.num_clusters > p - min(self.sink, p):
            raise ValueError(f"num_clusters={self.num_clusters} is more clusters than the {p - min(self.sink, p)} "
                             f"clustered tokens a prompt of the bucket ({p}) can have after sink={self.sink}; use "
                             f"num_clusters <= {max(p - self.sink, 1)} or num_clusters=None (L/80)")
        h, d = model_cfg.num_kv_heads, model_cfg.head_dim
        slots = p + capacity.max_new_tokens
        c0 = max([self.clusters_for(n) for n in range(p + 1)] + [1])
        c = c0 + self.window_clusters * (capacity.max_new_tokens // self.window)
        new = capacity.max_new_tokens
        sel = max([self.split(n, new)[1] for n in range(p + 1)] + [0])
        sel = max(min(sel, slots), 1)
        z = lambda *s: jnp.zeros(s, jnp.int32)  # noqa: E731
        state = ClusterState(
            k=jnp.zeros((batch, h, slots, d), dtype), v=jnp.zeros((batch, h, slots, d), dtype),
            pos=jnp.full((batch, h, slots), -1, jnp.int32), mu=jnp.zeros((batch, h, c, d), jnp.float32),
            csize=z(batch, h, c), cstart=z(batch, h, c), lengths=z(batch), sinks=z(batch), bsel=z(batch),
            filled=z(batch), clustered=z(batch), windows=jnp.int32(0), sink=min(self.sink, p), c0=c0,
            select=sel, max_new=new)
        if self.offload:
            from kvjax.methods.pqcache import _host_sharding
            host = _host_sharding()
            state = state.replace(k=jax.device_put(state.k, host), v=jax.device_put(state.v, host))
        return state

    def _split_dynamic(self, lengths, max_new_tokens: int):
        """Per-sequence ``(sink_b, bsel_b, c0_b)`` ``[B]`` int32 (exactly :meth:`split`, :meth:`clusters_for`)."""
        n = jnp.asarray(lengths, jnp.int32)
        b = jnp.where(n > 0, evicting_budget(self.budget, n, n + max_new_tokens), 0).astype(jnp.int32)
        s = jnp.minimum(jnp.minimum(self.sink, b), n)
        lc = n - s
        c0 = (jnp.full_like(n, self.num_clusters) if self.num_clusters is not None
              else jnp.maximum(1, lc // self.tokens_per_cluster))
        return s, b - s, jnp.where(lc > 0, jnp.minimum(c0, lc), 0)

    def init_rows(self, stream, num_heads: int, positions, valid, num: int):
        """Initial centroid rows ``[B, Hkv, num]`` int32 (note §6 #3: sampled without replacement, independent per
        KV head; ``stream`` is the layer for the prompt, :meth:`window_stream` for a decode window). positions,
        valid ``[B, L]``."""
        key = jax.random.fold_in(jax.random.PRNGKey(self.seed), stream)
        keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(num_heads))  # one stream per KV head
        return jax.vmap(lambda kk: km.init_rows(kk, valid, num, positions), out_axes=1)(keys)

    @staticmethod
    def window_stream(layer, window):
        """The init stream of decode window ``window`` (0-based) of ``layer``."""
        return layer * 100003 + 7919 * (window + 1)

    def _cluster(self, layer: int, k, positions, valid, ncl, num: int):
        """K-means of rows ``k [B, Hkv, L, D]`` (positions ``[L]`` or ``[B, L]``, valid ``[B, L]``) into ``ncl [B]`` of
        ``num`` clusters -> (mu ``[B, Hkv, num, D]``, labels ``[B, Hkv, L]`` with ``num`` for invalid rows)."""
        b, h, l, d = k.shape
        init = self.init_rows(layer, h, positions, valid, num)  # [B, Hkv, num]
        c0 = jnp.take_along_axis(k, init[..., None], axis=2)  # [B, Hkv, num, D]
        cvalid = jnp.broadcast_to((jnp.arange(num)[None, :] < ncl[:, None])[:, None], (b, h, num))
        vmask = jnp.broadcast_to(valid[:, None], (b, h, l))

        def rows(x, vm, c, cv):  # one device's (sequences, KV heads) as rows of the k-means kernel
            bb, hh = x.shape[:2]
            mu, labels, _ = cosine_kmeans(x.reshape(bb * hh, l, d), vm.reshape(bb * hh, l),
                                          c.reshape(bb * hh, num, d), cv.reshape(bb * hh, num), self.iters, self.impl)
            return mu.reshape(bb, hh, num, d), labels.reshape(bb, hh, l)

        return sharding.per_head(rows, k, vmask, c0, cvalid)

    @staticmethod
    def _csr(labels, num: int, base):
        """Sizes ``[B, Hkv, num]`` (a bincount: no ``[L, num]`` one-hot) and starts (``base [B]`` + exclusive
        prefix sums) of labels ``[B, Hkv, L]`` (``num`` = invalid, not counted)."""
        lead = labels.shape[:-1]
        count = jax.vmap(lambda x: jnp.bincount(x, length=num + 1))(labels.reshape(-1, labels.shape[-1]))
        size = count[:, :num].reshape(*lead, num).astype(jnp.int32)
        start = base[:, None, None] + jnp.cumsum(size, axis=-1) - size
        return size, start.astype(jnp.int32)

    def prefill(self, state, layer: int, q, k, v, lengths, previous=None):
        """Store the prompt, cluster ``[sink_b, n_b)`` per KV head and permute it into cluster order.
        k, v ``[B, Hkv, T, D]``; lengths ``[B]``."""
        if isinstance(state, SlotCache):  # a full layer (layer < n_full; layer may be traced)
            return _FULL.prefill(state, layer, q, k, v, lengths)
        b, h, t, d = k.shape
        n = jnp.asarray(lengths, jnp.int32)
        sinks, bsel, ncl = self._split_dynamic(n, state.max_new)
        p = jnp.arange(t, dtype=jnp.int32)
        valid = (p[None, :] >= sinks[:, None]) & (p[None, :] < n[:, None])  # [B, T]
        mu, labels = self._cluster(layer, k, p, valid, ncl, state.c0)  # positions shared by the rows
        size, start = self._csr(labels, state.c0, sinks)
        # slot order: sinks (group -1), clusters by id, then padding (group c0); stable keeps positions ascending
        group = jnp.where(p[None, None, :] < sinks[:, None, None], -1, labels)
        order = jnp.argsort(group, axis=-1, stable=True).astype(jnp.int32)  # [B, Hkv, T]
        ks = jnp.take_along_axis(k, order[..., None], axis=2).astype(state.k.dtype)
        vs = jnp.take_along_axis(v, order[..., None], axis=2).astype(state.v.dtype)
        pos = jnp.where(order < n[:, None, None], order, -1)
        return state.replace(
            k=self._place(state.k.at[:, :, :t].set(ks)), v=self._place(state.v.at[:, :, :t].set(vs)),
            pos=state.pos.at[:, :, :t].set(pos), mu=state.mu.at[:, :, :state.c0].set(mu),
            csize=state.csize.at[:, :, :state.c0].set(size), cstart=state.cstart.at[:, :, :state.c0].set(start),
            lengths=n, sinks=sinks, bsel=bsel, filled=n, clustered=n, windows=jnp.int32(0))

    def _place(self, x):
        if not self.offload:
            return x
        from kvjax.methods.pqcache import _host_sharding
        return jax.device_put(x, _host_sharding())

    # ---- selection (paper §III-C, note §7.4) ----

    def select(self, state: ClusterState, q):
        """Slots ``[B, Hkv, G', J]`` int32 and ``ok`` bool of the tokens taken from clusters (``G' = G`` for
        ``gqa="query"``, 1 for ``group_mean``; ``J = state.select``). q ``[B, Hq, D]``."""
        b, hq, d = q.shape
        h, c = state.mu.shape[1], state.mu.shape[2]
        qg = q.astype(jnp.float32).reshape(b, h, hq // h, d)
        if self.gqa == "group_mean":
            qg = qg.mean(axis=2, keepdims=True)
        s = jnp.einsum("bhgd,bhcd->bhgc", qg, state.mu, precision=jax.lax.Precision.HIGHEST)
        live = (state.csize > 0)[:, :, None, :]
        s = jnp.where(live, s, NEG_INF)  # empty clusters rank last (ties: the lower id first)
        _, order = top_k(s, c)  # [B, Hkv, G', C] descending
        sz = jnp.take_along_axis(jnp.broadcast_to(state.csize[:, :, None], s.shape), order, axis=-1)
        ps = jnp.cumsum(sz, axis=-1)
        ps0 = ps - sz
        j = jnp.arange(state.select, dtype=jnp.int32)
        # rank r of the cluster holding entry j: one marker at each non-empty cluster's first entry
        mark = lambda p0, z: (jnp.zeros((state.select + 1,), jnp.int32)  # noqa: E731
                              .at[jnp.minimum(p0, state.select)].add((z > 0).astype(jnp.int32)))
        marks = jax.vmap(jax.vmap(jax.vmap(mark)))(ps0, sz)  # per (b, h, g): no flattening across heads
        r = jnp.cumsum(marks[..., :-1], axis=-1) - 1
        r = jnp.clip(r, 0, c - 1)
        cid = jnp.take_along_axis(order, r, axis=-1)
        off = j - jnp.take_along_axis(ps0, r, axis=-1)
        start = jnp.take_along_axis(jnp.broadcast_to(state.cstart[:, :, None], s.shape), cid, axis=-1)
        ok = j < jnp.minimum(ps[..., -1:], state.bsel[:, None, None, None])
        slot = jnp.where(ok, start + off, 0)
        return slot.astype(jnp.int32), ok

    @staticmethod
    def _window_block(s: int) -> int:
        """Slots per block for the window's attention: 128 for the TPU kernel (a masked call needs lane-dense
        blocks), 16 elsewhere (reads at most 15 clustered rows before the window)."""
        return min(128 if default_impl() == "pallas_tpu" else 16, s)

    def _window(self, state: ClusterState, t):
        """The unclustered window ``[clustered, t]``: its mask ``[B, Hkv, S]``, the block list ``[B, N]``
        covering only it, and the block size."""
        s = state.k.shape[2]
        slot = jnp.arange(s, dtype=jnp.int32)[None, :]
        m = (slot >= state.clustered[:, None]) & (slot <= t[:, None])
        bs = self._window_block(s)
        first = state.clustered // bs
        blocks = first[:, None] + jnp.arange(-(-self.window // bs) + 1, dtype=jnp.int32)[None, :]
        blocks = jnp.where(blocks < -(-s // bs), blocks, -1)
        return jnp.broadcast_to(m[:, None], (t.shape[0], state.k.shape[1], s)), blocks, bs

    def _gathered(self, state: ClusterState, slot):
        """K/V rows at ``slot [B, Hkv, G', J]`` as ``[B, Hkv*G', J, D]`` (device memory)."""
        b, h, g, j = slot.shape
        flat = slot.reshape(b, h, g * j)[..., None]
        kk = jnp.take_along_axis(state.k, flat, axis=2).reshape(b, h * g, j, -1)
        vv = jnp.take_along_axis(state.v, flat, axis=2).reshape(b, h * g, j, -1)
        if self.offload:
            dev = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
            kk, vv = jax.device_put(kk, dev), jax.device_put(vv, dev)
        return kk, vv

    def decode(self, state, layer: int, q, k, v, pos):
        """Store the new token at slot ``pos``, attend sinks + selected clusters + the window, then cluster the
        window when it is full. q ``[B, Hq, D]``; k, v ``[B, Hkv, D]``; pos ``[B]``."""
        if isinstance(state, SlotCache):  # a full layer (layer < n_full; layer may be traced)
            return _FULL.decode(state, layer, q, k, v, pos)
        b, h, d = k.shape
        t = pos.astype(jnp.int32)
        ti = jnp.broadcast_to(t[:, None], (b, h))
        state = state.replace(k=self._place(rows_at(state.k, ti, k)), v=self._place(rows_at(state.v, ti, v)),
                              pos=rows_at(state.pos, ti, ti), filled=jnp.maximum(state.filled, t + 1))
        slot, ok = self.select(state, q)
        kk, vv = self._gathered(state, slot)
        # gqa="query": [B, Hq, J, D] rows, one "KV head" per query head; group_mean: [B, Hkv, J, D], GQA-native
        part_sel = attention.attend(q, kk, vv, ok.reshape(b, h * slot.shape[2], -1))
        mask, blocks, bs = self._window(state, t)
        part = attention.merge(part_sel, attention.attend(q, state.k, state.v, mask, lengths=state.filled,
                                                          block_indices=blocks, block_size=bs))
        if state.sink:  # the sinks: slots [0, sinks_b) of a static [0, sink) slice
            part = attention.merge(part, attention.attend(q, state.k[:, :, :state.sink], state.v[:, :, :state.sink],
                                                          None, lengths=state.sinks))
        out = attention.normalise(part)
        return out, self._maybe_cluster_window(state, layer, t)

    # ---- decode-time clustering (paper §III-B, note §2.4, §6 #9) ----

    def _maybe_cluster_window(self, state: ClusterState, layer: int, t):
        c_total = state.mu.shape[2]
        wmax = (c_total - state.c0) // self.window_clusters
        if wmax == 0:
            return state
        full = jnp.all(t + 1 - state.clustered >= self.window) & (state.windows < wmax)
        return jax.lax.cond(full, lambda s: self._cluster_window(s, layer), lambda s: s, state)

    def _cluster_window(self, state: ClusterState, layer: int) -> ClusterState:
        """Cluster slots ``[clustered, clustered + window)`` into ``window_clusters`` clusters, permute the rows
        into cluster order in place and append the clusters (ids ``c0 + windows * window_clusters + j``)."""
        b, h, _, d = state.k.shape
        m, cp = self.window, self.window_clusters
        slots = state.clustered[:, None] + jnp.arange(m, dtype=jnp.int32)[None, :]  # [B, m]
        idx = jnp.broadcast_to(slots[:, None, :, None], (b, h, m, 1))
        kw = jnp.take_along_axis(state.k, idx, axis=2)
        vw = jnp.take_along_axis(state.v, idx, axis=2)
        pw = jnp.take_along_axis(state.pos, idx[..., 0], axis=2)
        mu, labels = self._cluster(self.window_stream(layer, state.windows), kw, slots, jnp.ones((b, m), bool),
                                   jnp.full((b,), cp, jnp.int32), cp)
        size, start = self._csr(labels, cp, state.clustered)
        order = jnp.argsort(labels, axis=-1, stable=True).astype(jnp.int32)  # cluster order, positions ascending
        ks = jnp.take_along_axis(kw, order[..., None], axis=2)
        vs = jnp.take_along_axis(vw, order[..., None], axis=2)
        ps = jnp.take_along_axis(pw, order, axis=2)
        si = jnp.broadcast_to(slots[:, None, :], (b, h, m))
        at = state.c0 + state.windows * cp
        return state.replace(
            k=self._place(rows_at(state.k, si, ks)), v=self._place(rows_at(state.v, si, vs)),
            pos=rows_at(state.pos, si, ps),
            mu=jax.lax.dynamic_update_slice_in_dim(state.mu, mu, at, axis=2),
            csize=jax.lax.dynamic_update_slice_in_dim(state.csize, size, at, axis=2),
            cstart=jax.lax.dynamic_update_slice_in_dim(state.cstart, start, at, axis=2),
            clustered=state.clustered + m, windows=state.windows + 1)

    # ---- reporting ----

    def selected_positions(self, state, layer: int, q):
        """``[B, Hq, S]`` bool: positions the next decode step attends for ``q`` (the new token excluded)."""
        b, hq, _ = q.shape
        if isinstance(state, SlotCache):  # a full layer (layer < n_full; layer may be traced)
            return _FULL.selected_positions(state, layer, q)
        h, s = state.k.shape[1], state.k.shape[2]
        slot, ok = self.select(state, q)  # [B, Hkv, G', J]
        g = slot.shape[2]
        p = jnp.take_along_axis(state.pos, slot.reshape(b, h, -1), axis=2).reshape(slot.shape)
        p = jnp.where(ok & (p >= 0), p, s)
        sel = jnp.zeros((b, h, g, s + 1), bool)
        sel = sel.at[jnp.arange(b)[:, None, None, None], jnp.arange(h)[None, :, None, None],
                     jnp.arange(g)[None, None, :, None], p].set(True)[..., :s]
        sel = jnp.broadcast_to(sel, (b, h, hq // h, s)).reshape(b, hq, s)
        # outside the clustered regions a slot holds its own position: sinks and the unclustered window
        rec = jnp.arange(s)[None, :]
        recent = (rec < state.sinks[:, None]) | ((rec >= state.clustered[:, None]) & (rec < state.filled[:, None]))
        return sel | recent[:, None, :]

    def tokens_held(self, state):
        if isinstance(state, ClusterState):
            return jnp.mean(jnp.sum(state.pos >= 0, axis=-1), axis=-1).astype(jnp.float32)
        return _FULL.tokens_held(state)

    def bytes_read_per_step(self, state, num_heads: int) -> int:
        """Bytes one decode step reads: the centroids, sizes and starts of the live clusters (per KV head), the
        gathered rows (``bsel`` per selecting head, K and V), the sink/window blocks the kernel's block plan
        visits with their float32 mask, the sinks, and the query/outputs (once per partial)."""
        if not isinstance(state, ClusterState):
            return _FULL.bytes_read_per_step(state, num_heads)
        b, h, s, d = state.k.shape
        item = np.dtype(state.k.dtype).itemsize
        g = 1 if self.gqa == "group_mean" else num_heads // h
        live = int(np.sum(np.asarray(state.csize) > 0))
        total = live * (d * 4 + 8)
        bsel = np.asarray(state.bsel)
        clustered_tokens = np.asarray(state.clustered) - np.asarray(state.sinks)
        rows = np.minimum(bsel, clustered_tokens) * h * g
        total += int(np.sum(rows)) * 2 * d * item
        t = np.asarray(state.filled)  # the next token's position
        _, blocks, bs = self._window(state, jnp.asarray(t))
        total += block_plan_bytes(state.k, jnp.asarray(t + 1), blocks, block_size=bs, num_heads=num_heads,
                                  with_mask=True)
        if state.sink:
            total += block_plan_bytes(state.k[:, :, :state.sink], state.sinks, num_heads=num_heads)
        return int(total)
