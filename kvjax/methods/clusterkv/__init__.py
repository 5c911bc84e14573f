"""``clusterkv`` (Liu et al., DAC'25, *ClusterKV*): recall tokens by semantic clusters of their keys.

A recall method: every token stays stored; a decode step attends the sinks, the tokens of the clusters whose
centroids score highest against the query, and the recent not-yet-clustered tokens. Method note
``docs/notes/clusterkv.md`` (§2, §6 resolutions, §7 layout); paper §III (semantic clustering, selection
at cluster granularity), §IV-B/C (batched clustering, CSR indexing).

The method's parts, each a module of pure functions: :mod:`~kvjax.methods.clusterkv.index` (cosine K-means per KV
head, the clusters as CSR runs, the prompt and each decode window put in cluster order),
:mod:`~kvjax.methods.clusterkv.recall` (the clusters a query ranks highest, as runs of slots) and
:mod:`~kvjax.methods.clusterkv.attend` (attention over those runs, offloaded or not, and what a step reads). This
module holds the state and the :class:`ClusterKV` method that ties them together.

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
from kernels_pallas.decode_attention import runs_mask
from kvjax.model import attention
from kvjax.budget import MIN_TOKENS, check_budget
from kvjax.methods.clusterkv import (
    attend as cluster_attend,
    budget as cluster_budget,
    index as cluster_index,
    recall as cluster_recall,
)
from kvjax.methods.core.offload import host_sharding
from kvjax.methods.base import (
    Recalls,
    RECALL_NO_DECODE_BUDGET,
    Capacity,
    full_bytes,
    LayerContext,
    Method,
    rows_at,
    slot_axes,
)
from kvjax.methods.plans.layers import FullFirstLayers

#: The public names, some re-exported from the parts.
__all__ = ["ClusterKV", "ClusterState"]


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


@dataclasses.dataclass(frozen=True, eq=False)
class ClusterKV(FullFirstLayers, Method, Recalls):
    name: ClassVar[str] = "clusterkv"
    why_no_decode_budget: ClassVar[str] = RECALL_NO_DECODE_BUDGET  # base.Method.why_no_decode_budget
    step_kernels: ClassVar[tuple[str, ...]] = ("centroid_update", "cosine_assign", "decode_attention")  # base.Method
    traced_layer: ClassVar[bool] = True  # scan over layers (base.Method.traced_layer)
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
        return cluster_budget.split(self.budget, self.sink, n, max_new_tokens)

    def clusters_for(self, n: int) -> int:
        """Prompt clusters ``C0`` of an ``n``-token prompt (0 when nothing is clustered)."""
        return cluster_budget.clusters_for(self.sink, self.tokens_per_cluster, self.num_clusters, n)

    def attended(self, n: int, steps: int, ctx: LayerContext = LayerContext()) -> int:
        """Tokens (per query head) the decode step writing position ``n + steps`` attends: sinks + selected +
        the unclustered window + the new token (a token budget covers ``ctx.capacity.max_new_tokens`` too)."""
        s, bsel = self.split(n, ctx.capacity.max_new_tokens if ctx.capacity else 0)
        return cluster_budget.attended(s, bsel, n, steps, self.window)

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
        return cluster_index.index_bytes(state.mu, state.csize, c0 + windows * self.window_clusters)

    # ---- the method interface ----

    def init(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype):
        self.compressed_layer(model_cfg, capacity, layer)
        p = capacity.prompt_len
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
        opts = (self.budget, self.sink, self.tokens_per_cluster, self.num_clusters)
        return cluster_budget.split_dynamic(*opts, lengths, max_new_tokens)

    def _kmeans(self) -> dict:
        """The K-means options of :mod:`~kvjax.methods.clusterkv.index`."""
        return dict(seed=self.seed, iters=self.iters, impl=self.impl)

    def prefill(self, state, layer: int, q, k, v, lengths, previous=None):
        """Store the prompt, cluster ``[sink_b, n_b)`` per KV head and permute it into cluster order
        (:func:`~kvjax.methods.clusterkv.index.cluster_prompt`). k, v ``[B, Hkv, T, D]``; lengths ``[B]``."""
        t = k.shape[2]
        n = jnp.asarray(lengths, jnp.int32)
        sinks, bsel, ncl = self._split_dynamic(n, state.max_new)
        dtypes = (state.k.dtype, state.v.dtype)
        ks, vs, pos, mu, size, start = cluster_index.cluster_prompt(
            k, v, n, sinks, ncl, state.c0, dtypes, layer=layer, **self._kmeans()
        )
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
        return jax.device_put(x, host_sharding()) if self.offload else x

    # ---- selection (paper §III-C, note §7.4) ----

    def take_lengths(self, state: ClusterState, q):
        """Tokens each selecting head takes from each cluster: ``(starts [B, Hkv, C], take [B, Hkv, G', C])`` int32
        in cluster-id order, ``G' = G`` for ``gqa="query"``, 1 for ``group_mean``; the clusters ranked by ``q·mu``,
        taken whole until ``bsel`` tokens, the last one cut (:func:`~kvjax.methods.clusterkv.recall.take_lengths`).
        q ``[B, Hq, D]``."""
        return state.cstart, cluster_recall.take_lengths(q, state.mu, state.csize, state.bsel, self.gqa)

    def runs(self, state: ClusterState, q, t):
        """The runs of slots the step whose new token is at ``t [B]`` attends: ``(starts [B, Hkv, R], lens [B, Hkv,
        R] or [B, Hkv, G, R])`` (``R = C + 2``): the sinks, the unclustered window ``[clustered, t]``, then the
        clusters (:meth:`take_lengths`, :func:`~kvjax.methods.clusterkv.recall.runs`)."""
        cstart, take = self.take_lengths(state, q)
        return cluster_recall.runs(take, cstart, state.sinks, state.clustered, t)

    def max_rows(self, state: ClusterState, num_heads: int) -> int:
        """Static bound on the rows a step's runs list per KV head: the sinks, the unclustered window (at most
        ``window`` tokens, and at most ``max_new_tokens``), and ``bsel`` tokens per selecting head."""
        g = 1 if self.gqa == "group_mean" else num_heads // state.k.shape[1]
        return int(state.sink + min(self.window, state.max_new) + min(g * state.select, state.k.shape[2]))

    def decode(self, state, layer: int, q, k, v, pos):
        """Store the new token at slot ``pos``, attend sinks + selected clusters + the window (runs of slots, each
        read once per KV head, :func:`~kvjax.methods.clusterkv.attend.attend`), then cluster the window when it is
        full. q ``[B, Hq, D]``; k, v ``[B, Hkv, D]``; pos ``[B]``."""
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
        rows = self.max_rows(state, q.shape[1])
        part, read = cluster_attend.attend(q, state.k, state.v, starts, lens, max_rows=rows, offload=self.offload)
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
        into cluster order in place and append the clusters (ids ``c0 + windows * window_clusters + j``;
        :func:`~kvjax.methods.clusterkv.index.cluster_window`)."""
        cp = self.window_clusters
        opts = dict(window=self.window, clusters=cp, layer=layer, **self._kmeans())
        si, ks, vs, ps, mu, size, start = cluster_index.cluster_window(
            state.k, state.v, state.pos, state.clustered, state.windows, **opts
        )
        at = state.c0 + state.windows * cp
        return state.replace(
            k=self._place(rows_at(state.k, si, ks)),
            v=self._place(rows_at(state.v, si, vs)),
            pos=rows_at(state.pos, si, ps),
            mu=jax.lax.dynamic_update_slice_in_dim(state.mu, mu, at, axis=2),
            csize=jax.lax.dynamic_update_slice_in_dim(state.csize, size, at, axis=2),
            cstart=jax.lax.dynamic_update_slice_in_dim(state.cstart, start, at, axis=2),
            clustered=state.clustered + self.window,
            windows=state.windows + 1,
        )

    # ---- reporting ----

    def selected_positions(self, state, layer: int, q):
        """``[B, Hq, S]`` bool: positions the next decode step (new token at ``t = filled``) attends for ``q``, the
        new token excluded: the slots of :meth:`runs` mapped to their positions."""
        b, hq, _ = q.shape
        h, s = state.k.shape[1], state.k.shape[2]
        starts, lens = self.runs(state, q, state.filled - 1)  # the window [clustered, filled): t excluded
        slots = runs_mask(b, h, hq // h, s, starts, lens)  # [B, Hkv, G, S] by slot
        return cluster_recall.positions_of(state.pos, slots).reshape(b, hq, s)

    def state_axes(self, state: ClusterState):
        """Batch- and head-major; the slot buffer (base.Method.state_axes): the K/V rows and their positions;
        centroids and cluster tables are the index (``index_bytes``)."""
        return slot_axes(state, "k", "v", "pos")

    def tokens_held(self, state):
        return jnp.mean(jnp.sum(state.pos >= 0, axis=-1), axis=-1).astype(jnp.float32)

    def bytes_read_breakdown(self, state: ClusterState, num_heads: int) -> dict[str, int]:
        """Bytes one decode step of this compressed layer reads, by part: ``centroids``, ``ranking``, ``runs`` (the
        K/V rows the run reads touch: after a decode step the rows it read, before the first a bound), ``total``,
        and ``full_kv`` for comparison (:func:`~kvjax.methods.clusterkv.attend.read_bytes`; concrete state, call
        outside ``jit``)."""
        g = 1 if self.gqa == "group_mean" else num_heads // state.k.shape[1]
        arrays = (state.csize, state.lengths, state.filled, state.clustered, state.sinks, state.bsel, state.rows_read)
        return cluster_attend.read_bytes(state.k, *arrays, num_heads=num_heads, g=g)

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
