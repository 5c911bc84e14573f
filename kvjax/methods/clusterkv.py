"""``clusterkv`` (Liu et al., DAC'25, *ClusterKV*): recall tokens by semantic clusters of their keys.

A recall method: every token stays stored; a decode step attends the sinks, the tokens of the clusters whose
centroids score highest against the query, and the recent not-yet-clustered tokens. Method note
``docs/notes/clusterkv.md`` (§2, §6 resolutions, §7 layout); paper §III (semantic clustering, selection
at cluster granularity), §IV-B/C (batched clustering, CSR indexing).

Shapes (per compressed layer): k, v ``[B, Hkv, S, D]`` (``S`` = bucket + max_new_tokens); pos ``[B, Hkv, S]``
int32 (-1 empty); mu ``[B, Hkv, C, D]`` float32 with ``C = C0_max + window_clusters * W_max`` (prompt clusters
``[0, C0_max)``, window ``w``'s at ``C0_max + w * window_clusters``); csize, cstart ``[B, Hkv, C]`` int32;
lengths, sinks, bsel, filled, clustered ``[B]`` int32; windows ``[]`` int32; rows_read ``[B, Hkv]`` int32. Einsum
axes: b batch, h KV head, g query head of the group, c cluster, d head dim.

How each step follows the paper, the budget split, what a step reads and what is not reproduced:
``docs/methods/clusterkv.md``, "From the paper to the code".
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kernels_pallas.checks import check_int
from kernels_pallas.cosine_kmeans import cosine_assign, lloyd_step
from kernels_pallas.decode_attention import gather_runs, runs_mask
from kvjax.model import attention
from kvjax import sharding
from kvjax.model.attention import NEG_INF
from kvjax.budget import MIN_TOKENS, check_budget
from kvjax.methods import kmeans as km
from kvjax.methods import threshold as th
from kvjax.budget import warn_full_attention
from kvjax.methods.offload import host_sharding
from kvjax.methods.base import (
    RECALL_NO_DECODE_BUDGET,
    attends_all_steps,
    Capacity,
    evicting_budget,
    full_bytes,
    LayerContext,
    Method,
    rows_at,
    slot_axes,
)
from kvjax.methods.layers import full_below, refuse_full_layer


#: Rows per window of the decode step's run reads (``kernels_pallas.decode_attention.decode_attention_runs``).
RUN_BLOCK = 16


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
    rows_read: jnp.ndarray  # [B, Hkv] int32 K/V rows the last decode step read (0 before the first)
    sink: int = struct.field(pytree_node=False, default=0)  # static: most sinks
    c0: int = struct.field(pytree_node=False, default=0)  # static: prompt cluster ids [0, c0)
    select: int = struct.field(pytree_node=False, default=0)  # static: gathered rows per selecting head
    max_new: int = struct.field(pytree_node=False, default=0)  # static: capacity.max_new_tokens


def take_by_rank(score, size, bsel):
    """Rows taken per cluster when clusters are taken whole in descending ``score`` order (ties: the lower index)
    until ``bsel`` rows, the last one cut: ``clip(bsel - (rows of the clusters ranked before), 0, size)`` ``[...,
    C]`` int32, in cluster order. ``score [..., C]`` float32, ``size [..., C]`` int (``>= 0``), ``bsel`` broadcastable
    to ``score.shape[:-1]``. No sort: ``tau``, the cut cluster's score, from a size-weighted bisection
    (:func:`~kvjax.methods.threshold.kth_key`); the clusters above it are taken whole (their rows sum to less than
    ``bsel``), those tied with it in index order, those below not at all."""
    keys = th.sortable(score)
    size = size.astype(jnp.int32)
    bsel = jnp.broadcast_to(jnp.asarray(bsel, jnp.int32), score.shape[:-1])
    tau, above = th.kth_key(keys, size, bsel)
    tied = jnp.where(keys == tau[..., None], size, 0)
    cut = jnp.clip((bsel - above)[..., None] - (jnp.cumsum(tied, axis=-1) - tied), 0, size)
    return jnp.where(keys > tau[..., None], size, jnp.where(keys == tau[..., None], cut, 0)).astype(jnp.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class ClusterKV(Method):
    name: ClassVar[str] = "clusterkv"
    why_no_decode_budget: ClassVar[str] = RECALL_NO_DECODE_BUDGET  # base.Method.why_no_decode_budget
    step_kernels: ClassVar[tuple[str, ...]] = ("centroid_update", "cosine_assign", "decode_attention")  # base.Method
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
    gqa: str = "group_mean"  # "group_mean" (one selection per KV head, the default) | "query" (per query head)
    seed: int = 0
    impl: str | None = None  # cosine K-means kernels (None: by backend)
    offload: bool = False  # K/V in pinned_host memory (accelerators only)

    @property
    def offloads(self) -> bool:  # base.Method.offloads
        return self.offload

    def min_legal_budget(self) -> int:
        return self.sink  # the budget counts the sinks (__post_init__)

    def __post_init__(self):
        check_budget(self.budget)
        for name in ("sink", "n_full"):
            check_int(name, getattr(self, name), at_least=0)
        for name in ("tokens_per_cluster", "window", "window_clusters", "iters"):
            check_int(name, getattr(self, name))
        check_int("num_clusters", self.num_clusters, "C0; None: tokens // tokens_per_cluster", none_ok=True)
        if self.window_clusters > self.window:
            raise ValueError(
                f"window_clusters={self.window_clusters} is more clusters than the window's "
                f"{self.window} tokens; use window_clusters <= window"
            )
        if isinstance(self.budget, int) and self.budget < self.sink:
            raise ValueError(
                f"budget={self.budget} tokens is below sink={self.sink}: the budget counts the sinks "
                f"(note §6 #1); pass budget >= {self.sink} or a smaller sink"
            )
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

    def attended(self, n: int, steps: int, ctx: LayerContext = LayerContext()) -> int:
        """Tokens (per query head) the decode step writing position ``n + steps`` attends: sinks + selected +
        the unclustered window + the new token (a token budget covers ``ctx.capacity.max_new_tokens`` too)."""
        s, bsel = self.split(n, ctx.capacity.max_new_tokens if ctx.capacity else 0)
        unclustered = steps % self.window
        return s + min(bsel, n - s + steps - unclustered) + unclustered + 1

    def min_budget(self) -> tuple[int, str]:
        return self.sink + MIN_TOKENS, f"sink={self.sink} + at least {MIN_TOKENS} tokens selected from clusters"

    def held(self, n: int, steps: int, ctx: LayerContext = LayerContext()) -> int:
        return n + steps

    def index_bytes(self, state, n=None, steps=None):
        """The centroids, sizes and starts (``mu``, ``csize``, ``cstart``) of the clusters a sequence has made: its
        prompt's ``C0`` and ``window_clusters`` per decode window clustered (base.Method.index_bytes)."""
        wmax = (state.mu.shape[2] - state.c0) // self.window_clusters
        if n is None:
            n, windows = np.asarray(state.lengths), int(state.windows)
        else:
            n, windows = np.asarray(n), min(steps // self.window, wmax)
        c0 = np.asarray(self._split_dynamic(jnp.asarray(n, jnp.int32), state.max_new)[2]).astype(np.int64)
        b, h, c, d = state.mu.shape
        per = h * (d * np.dtype(state.mu.dtype).itemsize + 2 * np.dtype(state.csize.dtype).itemsize)
        return b * c * per, (c0 + windows * self.window_clusters) * per

    # ---- the method interface ----

    def at(self, layer: int) -> Method:
        """Layers ``< n_full`` run ``full`` (base.Method.at): the engine builds and runs them as full layers."""
        return full_below(self.n_full, layer, self)

    def attends_everything(self, model_cfg, capacity: Capacity, layer: int = 0) -> bool:
        """Every decode step of a bucket-filling prompt attends every token (:meth:`attended`; base.Method)."""
        return attends_all_steps(self, model_cfg, capacity, layer)

    def init(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype):
        refuse_full_layer(self, layer)
        p = capacity.prompt_len
        warn_full_attention(self, model_cfg, capacity, [layer])
        if self.num_clusters is not None and self.num_clusters > p - min(self.sink, p):
            raise ValueError(
                f"num_clusters={self.num_clusters} is more clusters than the {p - min(self.sink, p)} "
                f"clustered tokens a prompt of the bucket ({p}) can have after sink={self.sink}; use "
                f"num_clusters <= {max(p - self.sink, 1)} or num_clusters=None (L/80)"
            )
        h, d = model_cfg.num_kv_heads, model_cfg.head_dim
        slots = p + capacity.max_new_tokens
        c0 = max([self.clusters_for(n) for n in range(p + 1)] + [1])
        c = c0 + self.window_clusters * (capacity.max_new_tokens // self.window)
        new = capacity.max_new_tokens
        sel = max([self.split(n, new)[1] for n in range(p + 1)] + [0])
        sel = max(min(sel, slots), 1)
        z = lambda *s: jnp.zeros(s, jnp.int32)  # noqa: E731
        state = ClusterState(
            k=jnp.zeros((batch, h, slots, d), dtype),
            v=jnp.zeros((batch, h, slots, d), dtype),
            pos=jnp.full((batch, h, slots), -1, jnp.int32),
            mu=jnp.zeros((batch, h, c, d), jnp.float32),
            csize=z(batch, h, c),
            cstart=z(batch, h, c),
            lengths=z(batch),
            sinks=z(batch),
            bsel=z(batch),
            filled=z(batch),
            clustered=z(batch),
            windows=jnp.int32(0),
            rows_read=z(batch, h),
            sink=min(self.sink, p),
            c0=c0,
            select=sel,
            max_new=new,
        )
        if self.offload:
            host = host_sharding()
            state = state.replace(k=jax.device_put(state.k, host), v=jax.device_put(state.v, host))
        return state

    def _split_dynamic(self, lengths, max_new_tokens: int):
        """Per-sequence ``(sink_b, bsel_b, c0_b)`` ``[B]`` int32 (exactly :meth:`split`, :meth:`clusters_for`)."""
        n = jnp.asarray(lengths, jnp.int32)
        b = jnp.where(n > 0, evicting_budget(self.budget, n, n + max_new_tokens), 0).astype(jnp.int32)
        s = jnp.minimum(jnp.minimum(self.sink, b), n)
        lc = n - s
        c0 = (
            jnp.full_like(n, self.num_clusters)
            if self.num_clusters is not None
            else jnp.maximum(1, lc // self.tokens_per_cluster)
        )
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
            mu, labels, _ = cosine_kmeans(
                x.reshape(bb * hh, l, d),
                vm.reshape(bb * hh, l),
                c.reshape(bb * hh, num, d),
                cv.reshape(bb * hh, num),
                self.iters,
                self.impl,
            )
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
            k=self._place(state.k.at[:, :, :t].set(ks)),
            v=self._place(state.v.at[:, :, :t].set(vs)),
            pos=state.pos.at[:, :, :t].set(pos),
            mu=state.mu.at[:, :, : state.c0].set(mu),
            csize=state.csize.at[:, :, : state.c0].set(size),
            cstart=state.cstart.at[:, :, : state.c0].set(start),
            lengths=n,
            sinks=sinks,
            bsel=bsel,
            filled=n,
            clustered=n,
            windows=jnp.int32(0),
        )

    def _place(self, x):
        if not self.offload:
            return x
        return jax.device_put(x, host_sharding())

    # ---- selection (paper §III-C, note §7.4) ----

    def take_lengths(self, state: ClusterState, q):
        """Tokens each selecting head takes from each cluster: ``(starts [B, Hkv, C], take [B, Hkv, G', C])`` int32
        in cluster-id order, ``G' = G`` for ``gqa="query"``, 1 for ``group_mean``. The clusters are ranked by
        ``q·mu`` (ties: the lower id), whole clusters taken until ``bsel`` tokens, the last one cut to its first
        (earliest-position) rows: cluster ``c`` at rank ``r`` gives ``clip(bsel - Σ_{r' < r} size, 0, size)`` rows
        from ``cstart[c]``, computed without a sort (:func:`take_by_rank`; XLA:CPU's sort of 8 x 409 scores took
        0.4-0.5 ms a step at 32k). q ``[B, Hq, D]``."""
        b, hq, d = q.shape
        h = state.mu.shape[1]
        qg = q.astype(jnp.float32).reshape(b, h, hq // h, d)
        if self.gqa == "group_mean":
            qg = qg.mean(axis=2, keepdims=True)
        s = jnp.einsum("bhgd,bhcd->bhgc", qg, state.mu, precision=jax.lax.Precision.HIGHEST)
        live = (state.csize > 0)[:, :, None, :]
        size = jnp.broadcast_to(state.csize[:, :, None], s.shape)
        return state.cstart, take_by_rank(jnp.where(live, s, NEG_INF), size, state.bsel[:, None, None])

    def runs(self, state: ClusterState, q, t):
        """The runs of slots the step whose new token is at ``t [B]`` attends: ``(starts [B, Hkv, R], lens [B, Hkv,
        R] or [B, Hkv, G, R])`` (``R = C + 2``): the sinks ``[0, sink_b)``, the unclustered window ``[clustered,
        t]``, then the clusters (:meth:`take_lengths`). ``gqa="query"`` gives every query head its own lengths over
        the clusters any head of its group takes (read once per KV head, masked per query head)."""
        b, h = state.k.shape[0], state.k.shape[1]
        cstart, take = self.take_lengths(state, q)
        g = take.shape[2]
        fixed = lambda x: jnp.broadcast_to(x.astype(jnp.int32)[:, None, None, None], (b, h, g, 1))  # noqa: E731
        lens = jnp.concatenate([fixed(state.sinks), fixed(t + 1 - state.clustered), take], axis=-1)
        starts = jnp.concatenate(
            [
                jnp.zeros((b, h, 1), jnp.int32),
                jnp.broadcast_to(state.clustered[:, None, None], (b, h, 1)).astype(jnp.int32),
                cstart.astype(jnp.int32),
            ],
            axis=-1,
        )
        return starts, (lens[:, :, 0] if g == 1 else lens)

    def max_rows(self, state: ClusterState, num_heads: int) -> int:
        """Static bound on the rows a step's runs list per KV head: the sinks, the unclustered window (at most
        ``window`` tokens, and at most ``max_new_tokens``), and ``bsel`` tokens per selecting head."""
        g = 1 if self.gqa == "group_mean" else num_heads // state.k.shape[1]
        return int(state.sink + min(self.window, state.max_new) + min(g * state.select, state.k.shape[2]))

    @staticmethod
    def _run_block(s: int) -> int:
        """Rows per window of the run reads (``decode_attention_runs``' ``block_size``)."""
        return min(RUN_BLOCK, s)

    def decode(self, state, layer: int, q, k, v, pos):
        """Store the new token at slot ``pos``, attend sinks + selected clusters + the window (runs of slots, each
        read once per KV head), then cluster the window when it is full. q ``[B, Hq, D]``; k, v ``[B, Hkv, D]``;
        pos ``[B]``."""
        b, h, d = k.shape
        t = pos.astype(jnp.int32)
        ti = jnp.broadcast_to(t[:, None], (b, h))
        state = state.replace(
            k=self._place(rows_at(state.k, ti, k)),
            v=self._place(rows_at(state.v, ti, v)),
            pos=rows_at(state.pos, ti, ti),
            filled=jnp.maximum(state.filled, t + 1),
        )
        starts, lens = self.runs(state, q, t)
        bs = self._run_block(state.k.shape[2])
        rows = self.max_rows(state, q.shape[1])
        if self.offload:  # gather the windows from host memory, attend them on the device
            kk, vv, valid = gather_runs(state.k, state.v, starts, lens, max_rows=rows, block_size=bs)
            dev = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
            part = attention.attend(q, jax.device_put(kk, dev), jax.device_put(vv, dev), valid)
        else:
            part = attention.attend_runs(q, state.k, state.v, starts, lens, max_rows=rows, block_size=bs)
        span = lens if lens.ndim == 3 else jnp.max(lens, axis=2)
        read = jnp.sum(jnp.where(span > 0, jnp.maximum(span, bs), 0), axis=-1).astype(jnp.int32)  # [B, Hkv]
        state = state.replace(rows_read=read)
        # The window's clustering permutes K/V rows in place. Without a data dependency XLA may run it before the
        # attention that reads those rows and copy K and V (both branches of the cond) to keep the old rows; its
        # predicate depending on the attention's result (``l`` is never -1) orders it after: no copy
        # (tests/kvjax/test_clusterkv.py reads the compiled step).
        after = part[2][0, 0] != -1.0
        return attention.normalise(part), self._maybe_cluster_window(state, layer, t, after)

    # ---- decode-time clustering (paper §III-B, note §2.4, §6 #9) ----

    def _maybe_cluster_window(self, state: ClusterState, layer: int, t, after=True):
        c_total = state.mu.shape[2]
        wmax = (c_total - state.c0) // self.window_clusters
        if wmax == 0:
            return state
        full = jnp.all(t + 1 - state.clustered >= self.window) & (state.windows < wmax) & after
        # a while_loop of 0 or 1 rounds, not a lax.cond: its body updates K/V in place, and on a step that does not
        # cluster the state passes through untouched (a cond's identity branch would hold a second copy; in a
        # scanned layer stack a branch's outputs are new values, written back into the stack by a copy)
        state, _ = jax.lax.while_loop(
            lambda c: c[1], lambda c: (self._cluster_window(c[0], layer), jnp.array(False)), (state, full)
        )
        return state

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
        mu, labels = self._cluster(
            self.window_stream(layer, state.windows),
            kw,
            slots,
            jnp.ones((b, m), bool),
            jnp.full((b,), cp, jnp.int32),
            cp,
        )
        size, start = self._csr(labels, cp, state.clustered)
        order = jnp.argsort(labels, axis=-1, stable=True).astype(jnp.int32)  # cluster order, positions ascending
        ks = jnp.take_along_axis(kw, order[..., None], axis=2)
        vs = jnp.take_along_axis(vw, order[..., None], axis=2)
        ps = jnp.take_along_axis(pw, order, axis=2)
        si = jnp.broadcast_to(slots[:, None, :], (b, h, m))
        at = state.c0 + state.windows * cp
        return state.replace(
            k=self._place(rows_at(state.k, si, ks)),
            v=self._place(rows_at(state.v, si, vs)),
            pos=rows_at(state.pos, si, ps),
            mu=jax.lax.dynamic_update_slice_in_dim(state.mu, mu, at, axis=2),
            csize=jax.lax.dynamic_update_slice_in_dim(state.csize, size, at, axis=2),
            cstart=jax.lax.dynamic_update_slice_in_dim(state.cstart, start, at, axis=2),
            clustered=state.clustered + m,
            windows=state.windows + 1,
        )

    # ---- reporting ----

    def selected_positions(self, state, layer: int, q):
        """``[B, Hq, S]`` bool: positions the next decode step (new token at ``t = filled``) attends for ``q``, the
        new token excluded: the slots of :meth:`runs` mapped to their positions."""
        b, hq, _ = q.shape
        h, s = state.k.shape[1], state.k.shape[2]
        starts, lens = self.runs(state, q, state.filled - 1)  # the window [clustered, filled): t excluded
        g = hq // h
        slots = runs_mask(b, h, g, s, starts, lens)  # [B, Hkv, G, S] by slot
        p = jnp.where(state.pos >= 0, state.pos, s)  # [B, Hkv, S] the position each slot holds
        put = lambda pp, m: jnp.zeros((s + 1,), bool).at[pp].max(m)[:s]  # noqa: E731
        sel = jax.vmap(jax.vmap(jax.vmap(put, in_axes=(None, 0))))(p, slots)  # [B, Hkv, G, S] by position
        return sel.reshape(b, hq, s)

    def state_axes(self, state: ClusterState):
        """Batch- and head-major; the slot buffer (base.Method.state_axes): the K/V rows and their positions;
        centroids and cluster tables are the index (``index_bytes``)."""
        return slot_axes(state, "k", "v", "pos")

    def tokens_held(self, state):
        return jnp.mean(jnp.sum(state.pos >= 0, axis=-1), axis=-1).astype(jnp.float32)

    def bytes_read_breakdown(self, state: ClusterState, num_heads: int) -> dict[str, int]:
        """Bytes one decode step of this compressed layer reads, by part (concrete state; call outside ``jit``):

        - ``centroids``: ``mu`` (float32), ``csize`` and ``cstart`` of the live clusters per KV head;
        - ``ranking``: the float32 score and the size of each live cluster, per selecting head (the size-weighted
          bisection, :meth:`take_lengths`, passes over these small arrays 32 times, in cache).
        The scoring einsum and the bisection run over the static ``C``-cluster buffers (the bucket's ``C0_max``
        prompt clusters and every decode window's slots); the slots no cluster of the sequence uses are not
        counted (at most ``bucket / tokens_per_cluster`` centroids of ``4 D`` bytes per KV head, well under 1% of
        a step's reads at the budgets of the paper);
        - ``runs``: the K and V rows the run reads touch (:func:`~kernels_pallas.decode_attention.runs_plan_bytes`:
          every listed run's rows, a run shorter than ``RUN_BLOCK`` rows a whole window): the sinks, the unclustered
          window and the selected clusters, read once per KV head (``gqa="query"``: the union of the group's
          selections). The rows depend on the query: after a decode step, the rows that step read
          (``rows_read``, recorded by :meth:`decode`); before the first, the bound ``bsel`` per selecting head
          plus the sink and window runs. Plus the query and the partial outputs;
        - ``full_kv``, not in ``total``: full attention over the same live slots."""
        b, h, s, d = state.k.shape
        item = np.dtype(state.k.dtype).itemsize
        g = 1 if self.gqa == "group_mean" else num_heads // h
        bs = self._run_block(s)
        live = int(np.sum(np.asarray(state.csize) > 0))
        filled, clustered = np.asarray(state.filled), np.asarray(state.clustered)
        if np.any(filled > np.asarray(state.lengths)):  # a decode step has run: what it read
            rows = int(np.sum(np.asarray(state.rows_read)))
        else:  # the next step's bound: bsel per selecting head (at most the clustered tokens), sinks, window
            sinks, bsel = np.asarray(state.sinks), np.asarray(state.bsel)
            run = lambda n: np.where(n > 0, np.maximum(n, bs), 0)  # noqa: E731
            sel = np.minimum(g * bsel, clustered - sinks)
            rows = int(h * np.sum(run(sinks) + run(filled + 1 - clustered) + sel))
        out = {
            "centroids": live * (d * 4 + 8),
            "ranking": live * g * 8,
            "runs": rows * 2 * d * item + b * num_heads * d * item + b * num_heads * (d + 2) * 4,
        }
        out["total"] = sum(out.values())
        out["full_kv"] = int(h * np.sum(filled + 1) * 2 * d * item + b * num_heads * (2 * d * item + (d + 2) * 4))
        return out

    def held_overhead_bytes(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> int:
        """A recall method keeps everything: full's bytes, plus per cluster a float32 centroid, its size and
        first slot (one cluster per ``tokens_per_cluster`` prompt tokens, or ``num_clusters``, and
        ``window_clusters`` per decode window) and the per-sequence counters."""
        p, new = capacity.prompt_len, capacity.max_new_tokens
        c = (self.num_clusters or -(-p // self.tokens_per_cluster)) + self.window_clusters * (new // self.window)
        h = model_cfg.num_kv_heads
        return (
            full_bytes(model_cfg, batch, capacity, dtype)
            + batch * h * (c * (4 * model_cfg.head_dim + 8) + 4)
            + 6 * 4 * batch
            + 4
        )

    def bytes_read_per_step(self, state, num_heads: int) -> int:
        """Bytes one decode step reads: a full layer's live slots, else the total of :meth:`bytes_read_breakdown`
        (centroids, ranking, the runs' K/V rows, query and outputs)."""
        return self.bytes_read_breakdown(state, num_heads)["total"]
