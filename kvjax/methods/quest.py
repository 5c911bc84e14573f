"""``quest`` (Tang et al., ICML 2024, *Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference*):
query-aware page selection by a per-channel min/max upper bound.

A recall method: the full KV stays stored (Quest shrinks what each decode step *reads*, not what is held). The
ClusterKV paper (Liu et al., 2024, §II-C, §V-A; ``docs/notes/clusterkv.md`` §3, §4) uses Quest as its
recallable baseline with its original ``page_size = 16`` and the first two layers uncompressed; this module is
that baseline, written from the Quest paper's description (§3: page criticality estimation, §3.2 the upper
bound) and kvjax's resolutions of what it leaves open (docs/methods/quest.md).

Shapes (per compressed layer): k, v ``[B, Hkv, S, D]`` (``S`` = prompt bucket + max_new_tokens, slot =
position); kmin, kmax ``[B, Hkv, n_pages, D]`` (KV dtype, ``n_pages = ceil(S / page_size)``); lengths (prompt)
and filled ``[B]`` int32. Static: ``page_size`` and ``topk`` (the block list holds ``topk + 1`` pages: the
bucket's largest ``pages_b - 1`` or its largest all-live page count, whichever is larger, at most ``n_pages -
1``). Einsum axes: b batch, h KV head, g query head in group, p page, d head dim.

How each step follows the paper, the budget split, what a step reads and what is not reproduced:
``docs/methods/quest.md``, "From the paper to the code".
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kernels_pallas.checks import check_int
from kernels_pallas.decode_attention import block_plan_bytes
from kvjax.model import attention
from kvjax import sharding
from kvjax.budget import MIN_TOKENS, budget_tokens, check_budget
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
from kvjax.methods.core import threshold as th
from kvjax.methods.plans.layers import FullFirstLayers


#: Bytes of ``kmax`` (``[Hkv, pages, D]`` of one sequence) one scoring chunk reads: small, so the chunks read past
#: the candidates are few, large enough that the loop's per-trip cost is small.
SCORE_CHUNK_BYTES = 1 << 20


def _top_pages(score, cur, keep, topk: int):
    """``(pages, ok) [B, Hkv, topk]``: the ``min(keep, topk)`` best of the candidate pages ``[0, cur)`` of ``score
    [B, Hkv, P]`` (``cur``, ``keep`` ``[B]``), ascending (:func:`~kvjax.methods.core.threshold.top_set`)."""
    b, h, p = score.shape
    pad = -p % 32
    cand = jnp.arange(p + pad)[None, None, :] < cur[:, None, None]
    keys = jnp.pad(th.sortable(score), ((0, 0), (0, 0), (0, pad)))
    return th.top_set(keys, jnp.broadcast_to(cand, keys.shape), jnp.minimum(keep, topk)[:, None], topk)


def _score_chunk(h: int, d: int, itemsize: int, n_pages: int) -> int:
    """Pages per scoring chunk: on CPU about ``SCORE_CHUNK_BYTES`` of ``kmax`` for one sequence, at least 16;
    elsewhere every page at once (one pass, no loop: :func:`kvjax.model.attention.chunk_loop`). At most ``n_pages``."""
    if attention.one_pass():
        return n_pages
    return min(max(SCORE_CHUNK_BYTES // max(h * d * itemsize, 1), 16), n_pages)


@struct.dataclass
class QuestState:
    """Full KV plus the page metadata of one compressed layer (see the module docstring)."""

    k: jnp.ndarray  # [B, Hkv, S, D]
    v: jnp.ndarray  # [B, Hkv, S, D]
    kmin: jnp.ndarray  # [B, Hkv, n_pages, D] per-channel key minimum of each page
    kmax: jnp.ndarray  # [B, Hkv, n_pages, D] per-channel key maximum of each page
    lengths: jnp.ndarray  # [B] int32 prompt lengths (0 before prefill)
    filled: jnp.ndarray  # [B] int32 slots written: prompt + decoded tokens
    page_size: int = struct.field(pytree_node=False, default=16)
    topk: int = struct.field(pytree_node=False, default=0)  # static top-k size; the list holds topk + 1 pages
    shrink: bool = struct.field(pytree_node=False, default=False)  # a sequence may have B_b < page_size


@dataclasses.dataclass(frozen=True, eq=False)
class Quest(FullFirstLayers, Method, Recalls):
    name: ClassVar[str] = "quest"
    why_no_decode_budget: ClassVar[str] = RECALL_NO_DECODE_BUDGET  # base.Method.why_no_decode_budget
    traced_layer: ClassVar[bool] = True  # scan over layers (base.Method.traced_layer)
    budget: float | int = 1024  # tokens attended per step (int), or a fraction of each prompt (float)
    page_size: int = 16  # tokens per page (Quest's and ClusterKV's setting)
    n_full: int = 2  # the first n_full layers keep and attend the full cache (Quest skips the first two)

    def min_legal_budget(self) -> int:
        return self.page_size  # at least one page (__post_init__)

    def __post_init__(self):
        check_budget(self.budget)
        check_int("page_size", self.page_size, "tokens per page; Quest uses 16", numpy_ok=True)
        if isinstance(self.budget, int) and self.budget < self.page_size:
            raise ValueError(
                f"budget={self.budget} tokens is less than one page of page_size={self.page_size}; "
                f"pass budget >= {self.page_size} or a smaller page_size"
            )
        check_int(
            "n_full",
            self.n_full,
            "layers that keep the full cache; Quest uses 2, 0 compresses every layer",
            at_least=0,
            numpy_ok=True,
        )

    # ---- budget ----

    def token_budget(self, lengths):
        """``B_b``: tokens each sequence may attend (int32 ``[B]`` from ``lengths [B]``, or a Python int from an
        int): ``ceil(b n)`` of its own prompt for a fraction, the count for an int."""
        if isinstance(self.budget, float):
            return budget_tokens(self.budget, lengths)
        if isinstance(lengths, (int, np.integer)):
            return int(self.budget)
        return jnp.full_like(jnp.asarray(lengths, jnp.int32), self.budget)

    def page_budget(self, lengths):
        """``pages_b = max(B_b // page_size, 1)`` (same kind as ``lengths``)."""
        b = self.token_budget(lengths)
        if isinstance(b, int):
            return max(b // self.page_size, 1)
        return jnp.maximum(b // self.page_size, 1)

    def _topk_size(self, prompt_len: int, slots: int) -> int:
        """Static top-k size for a bucket: the most non-current pages any sequence of it attends."""
        bmax = self.token_budget(int(prompt_len))  # B_b is non-decreasing in n: the bucket's is the largest
        pmax = max(bmax // self.page_size, 1)
        n_pages = -(-slots // self.page_size)
        return int(max(min(max(pmax - 1, (bmax - 1) // self.page_size), n_pages - 1), 0))

    def kept_pages(self, lengths, t):
        """``(cur, keep)`` ``[B]``: the current page of the new token at ``t [B]`` and how many candidate pages
        ``[0, cur)`` the step keeps: all of them while the live tokens fit the budget or its pages, else
        ``pages_b - 1`` (the one rule :meth:`select_pages` and :meth:`bytes_read_breakdown` share)."""
        t = jnp.asarray(t, jnp.int32)
        cur = t // self.page_size
        bb, pb = self.token_budget(lengths), self.page_budget(lengths)
        dense = (t + 1 <= bb) | (cur + 1 <= pb)
        return cur, jnp.where(dense, cur, jnp.minimum(pb - 1, cur))

    def can_shrink(self) -> bool:
        """Whether any sequence can have ``B_b < page_size`` (static): a fraction (``B_b = 1`` at ``n = 1``) with
        ``page_size > 1``; an int budget is at least one page."""
        return self.token_budget(1) < self.page_size

    def recent_window(self, lengths, t):
        """``(shrunk, w)`` ``[B]``: whether the sequence's ``B_b`` is below ``page_size``, and then the tokens
        ``w = min(B_b, t mod page_size + 1)`` (at least 1: the new token) the step whose new token is at ``t``
        attends: the most recent ``w`` of the current page, positions ``[t + 1 - w, t]``."""
        t = jnp.asarray(t, jnp.int32)
        bb = jnp.asarray(self.token_budget(lengths), jnp.int32)
        return bb < self.page_size, jnp.minimum(jnp.maximum(bb, 1), t % self.page_size + 1)

    def attended(self, n: int, steps: int, ctx: LayerContext = LayerContext()) -> int:
        """Tokens (per KV head) the decode step whose new token is at position ``t = n + steps`` attends in a
        compressed layer, the new token included: every live token (``t + 1``) while they fit the budget or its
        pages, else ``pages_b - 1`` whole pages plus the current page's ``t mod page_size + 1`` tokens; below one
        page (``B_b < page_size``) the current page's most recent ``min(B_b, t mod page_size + 1)``. At most
        ``B_b``. Layers ``< n_full`` attend ``t + 1``. Quest saves bandwidth, not memory: compare with
        :meth:`held`."""
        t = n + steps
        bb, pb = self.token_budget(n), self.page_budget(n)
        if bb < self.page_size:  # the current page cut to its most recent B_b tokens
            return min(max(bb, 1), t % self.page_size + 1)
        c = t // self.page_size
        if t + 1 <= bb or c + 1 <= pb:
            return t + 1
        return (pb - 1) * self.page_size + t % self.page_size + 1

    # ---- the method interface ----

    def init(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype):
        self.compressed_layer(model_cfg, capacity, layer)
        h, d = model_cfg.num_kv_heads, model_cfg.head_dim
        slots = capacity.prompt_len + capacity.max_new_tokens
        n_pages = -(-slots // self.page_size)
        return QuestState(
            k=jnp.zeros((batch, h, slots, d), dtype),
            v=jnp.zeros((batch, h, slots, d), dtype),
            kmin=jnp.zeros((batch, h, n_pages, d), dtype),
            kmax=jnp.zeros((batch, h, n_pages, d), dtype),
            lengths=jnp.zeros((batch,), jnp.int32),
            filled=jnp.zeros((batch,), jnp.int32),
            page_size=self.page_size,
            topk=self._topk_size(capacity.prompt_len, slots),
            shrink=self.can_shrink(),
        )

    def prefill(self, state, layer: int, q, k, v, lengths, previous=None):
        """Store the prompt KV and build each page's per-channel key min/max over the real tokens (Quest §3.1).
        k, v ``[B, Hkv, T, D]``; lengths ``[B]``."""
        b, h, t, d = k.shape
        ps = self.page_size
        pt = -(-t // ps)  # pages covering the prompt buffer
        lengths = jnp.asarray(lengths, jnp.int32)
        kk = k.astype(state.kmin.dtype)
        if pt * ps > t:
            kk = jnp.concatenate([kk, jnp.zeros((b, h, pt * ps - t, d), kk.dtype)], axis=2)
        kk = kk.reshape(b, h, pt, ps, d)
        real = (jnp.arange(pt * ps) < lengths[:, None]).reshape(b, 1, pt, ps, 1)
        inf = jnp.asarray(jnp.inf, kk.dtype)
        kmin = jnp.min(jnp.where(real, kk, inf), axis=3)
        kmax = jnp.max(jnp.where(real, kk, -inf), axis=3)
        any_real = jnp.any(real, axis=3)  # [B, 1, pt, 1]
        kmin = jnp.where(any_real, kmin, 0)  # pages with no prompt token: overwritten by their first decode token
        kmax = jnp.where(any_real, kmax, 0)
        return state.replace(
            k=state.k.at[:, :, :t].set(k.astype(state.k.dtype)),
            v=state.v.at[:, :, :t].set(v.astype(state.v.dtype)),
            kmin=state.kmin.at[:, :, :pt].set(kmin),
            kmax=state.kmax.at[:, :, :pt].set(kmax),
            lengths=lengths,
            filled=lengths,
        )

    def page_scores(self, state: QuestState, q) -> jnp.ndarray:
        """Quest's upper bound ``u = Σ_d max(q_d kmin_d, q_d kmax_d)`` per query head and page, ``[B, Hkv, G,
        n_pages]`` float32 (unscaled; every page, live or not: mask with the candidates). For analysis and tests:
        the decode step ranks pages by their group mean, :meth:`group_scores`."""
        b, hq, d = q.shape
        h = state.kmin.shape[1]
        qg = q.astype(jnp.float32).reshape(b, h, hq // h, d)
        hi = jax.lax.Precision.HIGHEST
        return jnp.einsum(
            "bhgd,bhpd->bhgp", jnp.maximum(qg, 0.0), state.kmax.astype(jnp.float32), precision=hi
        ) + jnp.einsum("bhgd,bhpd->bhgp", jnp.minimum(qg, 0.0), state.kmin.astype(jnp.float32), precision=hi)

    def group_scores(self, state: QuestState, q, t) -> jnp.ndarray:
        """The step's page ranking ``[B, Hkv, n_pages]`` float32: the mean over the group's query heads of Quest's
        bound, folded into one query per KV head, ``mean_g(q_g⁺)·kmax + mean_g(q_g⁻)·kmin`` (the mean of the
        bounds, exactly: the bound is linear in ``q⁺`` and ``q⁻``), for the candidate pages ``[0, t // page_size)``,
        ``-inf`` elsewhere. On CPU, where at least half the pages are candidates, one product reads every page's
        min/max; otherwise they are read in chunks of pages up to the longest sequence's current page (a
        ``lax.fori_loop`` with a dynamic trip count), so the pages past it (bucket padding, unwritten decode pages)
        are not read. On GPU/TPU one pass over every page."""
        b, hq, d = q.shape
        h, n_pages = state.kmin.shape[1], state.kmin.shape[2]
        qg = q.astype(jnp.float32).reshape(b, h, hq // h, d)
        qp, qn = jnp.mean(jnp.maximum(qg, 0.0), axis=2), jnp.mean(jnp.minimum(qg, 0.0), axis=2)  # [B, Hkv, D]
        cur = jnp.asarray(t, jnp.int32) // self.page_size  # candidates: pages [0, cur)
        c = _score_chunk(h, d, np.dtype(state.kmin.dtype).itemsize, n_pages)
        hi = jax.lax.Precision.HIGHEST

        def bound(start, c):  # the bound of pages [start, start + c)
            sl = lambda x: jax.lax.dynamic_slice_in_dim(x, start, c, axis=2).astype(jnp.float32)  # noqa: E731
            return jnp.einsum("bhd,bhpd->bhp", qp, sl(state.kmax), precision=hi) + jnp.einsum(
                "bhd,bhpd->bhp", qn, sl(state.kmin), precision=hi
            )

        def body(i, buf):
            start = jnp.minimum(i * c, n_pages - c)
            return jax.lax.dynamic_update_slice_in_dim(buf, bound(start, c), start, axis=2)

        buf = jnp.full((b, h, n_pages), -jnp.inf, jnp.float32)
        # CPU: one product over every page where at least half are candidates (at 32k 0.25-0.31 ms against
        # 0.75-0.88 ms for the loop over live chunks), the live chunks otherwise
        score = attention.live_pass(jnp.max(cur), c, n_pages, body, buf, lambda: bound(0, n_pages))
        cand = jnp.arange(n_pages)[None, None, :] < cur[:, None, None]
        return jnp.where(cand, score, -jnp.inf)

    def select_pages(self, state: QuestState, q, t) -> jnp.ndarray:
        """Pages the step whose new token is at position ``t [B]`` attends, per KV head: ``[B, Hkv, topk + 1]``
        int32, the ``keep`` best candidate pages (``lax.top_k``'s set, ties to the lower page, found without a sort:
        :func:`~kvjax.methods.core.threshold.top_set`), ascending, ``-1`` pads, then the current page ``t //
        page_size``."""
        b = q.shape[0]
        h = state.kmin.shape[1]
        cur, keep = self.kept_pages(state.lengths, t)  # the candidates are the complete pages [0, cur)
        current = jnp.broadcast_to(cur[:, None, None], (b, h, 1)).astype(jnp.int32)
        if state.topk == 0:
            return current
        idx, ok = sharding.per_head(
            lambda s, c, kk: _top_pages(s, c, kk, state.topk), self.group_scores(state, q, t), cur, keep
        )
        return jnp.concatenate([jnp.where(ok, idx, -1).astype(jnp.int32), current], axis=-1)

    def decode(self, state, layer: int, q, k, v, pos):
        """Write the new token at slot ``pos``, update its page's min/max, select pages, attend over them.
        q ``[B, Hq, D]``; k, v ``[B, Hkv, D]``; pos ``[B]`` -> (out ``[B, Hq, D]`` float32, state)."""
        b, h, _ = k.shape
        ps = self.page_size
        t = pos.astype(jnp.int32)
        ti, ci = jnp.broadcast_to(t[:, None], (b, h)), jnp.broadcast_to((t // ps)[:, None], (b, h))
        kn = k.astype(state.kmin.dtype)
        opens = (t % ps == 0)[:, None, None]  # the new token opens its page: no earlier token in it
        page = lambda x: jnp.take_along_axis(x, ci[:, :, None, None], axis=2)[:, :, 0]  # [B, Hkv, D]
        kmin = jnp.where(opens, kn, jnp.minimum(page(state.kmin), kn))
        kmax = jnp.where(opens, kn, jnp.maximum(page(state.kmax), kn))
        state = state.replace(
            k=rows_at(state.k, ti, k),
            v=rows_at(state.v, ti, v),
            kmin=rows_at(state.kmin, ci, kmin),
            kmax=rows_at(state.kmax, ci, kmax),
            filled=jnp.maximum(state.filled, t + 1),
        )
        pages = self.select_pages(state, q, t)
        if not state.shrink:
            part = attention.attend(q, state.k, state.v, None, lengths=state.filled, block_indices=pages, block_size=ps)
            return attention.normalise(part), state
        # Below one page: the sequence's page list is emptied, its window attended from a gathered buffer.
        shrunk, w = self.recent_window(state.lengths, t)
        pages = jnp.where(shrunk[:, None, None], -1, pages)
        part = attention.attend(q, state.k, state.v, None, lengths=state.filled, block_indices=pages, block_size=ps)
        rows = jnp.minimum((t + 1 - w)[:, None] + jnp.arange(ps), state.k.shape[2] - 1)  # [B, P], window first
        gather = lambda x: jnp.take_along_axis(x, rows[:, None, :, None], axis=2)  # [B, Hkv, P, D]
        win = attention.attend(
            q, gather(state.k), gather(state.v), None, lengths=jnp.where(shrunk, w, 0), block_size=ps
        )
        return attention.normalise(attention.merge(part, win)), state

    def selected_positions(self, state, layer: int, q) -> jnp.ndarray:
        """``[B, Hq, S]`` bool: positions the next decode step (new token at ``t = filled``) attends for ``q``,
        the new token excluded: the tokens ``< t`` of the listed pages (of the whole cache in a full layer;
        below one page, the current page's from ``t + 1 - w``: :meth:`recent_window`), the KV head's pages
        broadcast to its query heads."""
        hq = q.shape[1]
        h, s = state.k.shape[1], state.k.shape[2]
        t = state.filled
        pages = self.select_pages(state, q, t)  # [B, Hkv, N]
        slot_page = jnp.arange(s) // self.page_size
        listed = jnp.any(pages[..., None] == slot_page[None, None, None, :], axis=2)  # [B, Hkv, S]
        shrunk, w = self.recent_window(state.lengths, t)
        lo = jnp.where(shrunk, t + 1 - w, 0)
        slot = jnp.arange(s)[None, None, :]
        sel = listed & (slot < t[:, None, None]) & (slot >= lo[:, None, None])
        return jnp.repeat(sel, hq // h, axis=1)

    def state_axes(self, state: QuestState):
        """Batch- and head-major; the slot buffer (base.Method.state_axes): the K/V rows; the page summaries are the
        index (``index_bytes``)."""
        return slot_axes(state, "k", "v")

    def tokens_held(self, state):
        """``[B]`` float32 tokens stored: every token stays resident (prompt + decoded so far)."""
        return jnp.asarray(state.filled, jnp.float32)

    def min_budget(self) -> tuple[int, str]:
        return max(MIN_TOKENS, self.page_size), f"one page of page_size={self.page_size}"

    def index_bytes(self, state, n=None, steps=None):
        """The page bounds (``kmin``, ``kmax``) of the ``ceil(filled / page_size)`` pages a sequence has written
        (base.Method.index_bytes)."""
        filled = np.asarray(state.filled) if n is None else np.asarray(n) + steps
        pages = -(-filled.astype(np.int64) // state.page_size)
        b, h, _, d = state.kmin.shape
        per_page = 2 * h * d * np.dtype(state.kmin.dtype).itemsize
        return 2 * int(np.prod(state.kmin.shape)) * np.dtype(state.kmin.dtype).itemsize, pages * per_page

    def held(self, n: int, steps: int, ctx: LayerContext = LayerContext()) -> int:
        """Every token is stored: ``n + steps``. (Tokens attended per step: :meth:`attended`.)"""
        return n + steps

    def bytes_read_breakdown(self, state, num_heads: int | None = None) -> dict[str, int]:
        """Bytes the next decode step of this compressed layer reads (new token at ``t = filled``), by part;
        concrete state only (call outside ``jit``). ``num_heads`` query heads (default the KV heads).

        - ``metadata``: ``kmin`` and ``kmax`` per KV head of the pages :meth:`group_scores` reads (whole chunks
          of ``c`` pages up to the batch's largest candidate count: ``min(ceil(max_b (t_b // page_size) / c) c,
          n_pages)`` pages per sequence) and of the current page, read for its update (only the latter when
          ``topk = 0``).
        - ``scores``: the float32 group-mean page scores ``[Hkv, n_pages]`` the selection reads (static size).
        - ``attention``: the decode-attention block plan over the listed pages (``page_size`` rows of K and V
          per visited page, the current page included), the query and the partial outputs
          (:func:`~kernels_pallas.decode_attention.block_plan_bytes`; no mask is passed). A sequence below one
          page lists none.
        - ``window``: where a sequence can be below one page (``state.shrink``), the second call's block plan
          over the gathered ``[B, Hkv, page_size, D]`` window buffer: one block of ``page_size`` K/V rows per
          KV head of each sequence below a page, none for the others, and the query and partial outputs again
          (0 otherwise). The XLA gather that fills the buffer copies ``page_size`` rows per sequence and KV head;
          this counts what the kernel reads, as for the scores.

        ``full_kv`` (not in ``total``) is what full attention over the same live slots would read."""
        b, h, s, d = state.k.shape
        hq = num_heads or h
        ps = self.page_size
        n_pages = state.kmin.shape[2]
        t = np.asarray(state.filled, np.int64)
        live = jnp.asarray(np.minimum(t + 1, s), jnp.int32)
        cur, keep = (np.asarray(x, np.int64) for x in self.kept_pages(state.lengths, state.filled))
        # The kernel's block count does not depend on which candidates win: list the first ``keep`` pages.
        blocks = np.full((b, h, state.topk + 1), -1, np.int32)
        shrunk, w = (np.asarray(x) for x in self.recent_window(state.lengths, state.filled))
        for bi in range(b):
            blocks[bi, :, : keep[bi]] = np.arange(keep[bi])
            blocks[bi, :, -1] = -1 if (state.shrink and shrunk[bi]) else cur[bi]
        c = _score_chunk(h, d, np.dtype(state.kmin.dtype).itemsize, n_pages)
        read = attention.live_pass_rows(int(np.max(t // ps)), c, n_pages)  # group_scores' pages
        scored = np.full_like(cur, read + 1) if state.topk else np.ones_like(cur)
        window = 0
        if state.shrink:
            buf = jax.ShapeDtypeStruct((b, h, ps, d), state.k.dtype)
            window = block_plan_bytes(buf, jnp.asarray(np.where(shrunk, w, 0), jnp.int32), block_size=ps, num_heads=hq)
        out = {
            "metadata": int(h * 2 * np.sum(scored) * d * np.dtype(state.kmin.dtype).itemsize),
            "scores": b * h * n_pages * 4 if state.topk else 0,
            "attention": block_plan_bytes(state.k, live, jnp.asarray(blocks), block_size=ps, num_heads=hq),
            "window": window,
        }
        out["total"] = sum(out.values())
        out["full_kv"] = block_plan_bytes(state.k, live, num_heads=hq)
        return out

    def held_overhead_bytes(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> int:
        """A recall method keeps everything: full's bytes, plus the per-channel key min and max of every page."""
        slots = capacity.prompt_len + capacity.max_new_tokens
        pages = 2 * batch * model_cfg.num_kv_heads * -(-slots // self.page_size) * model_cfg.head_dim
        return full_bytes(model_cfg, batch, capacity, dtype) + pages * jnp.dtype(dtype).itemsize

    def bytes_read_per_step(self, state, num_heads: int | None = None) -> int:
        """Bytes one decode step of this layer reads: the live slots' block plan in a full layer, else the total
        of :meth:`bytes_read_breakdown` (live pages' min/max, the page scores, the listed pages' K/V rows, the
        query and outputs, and the below-a-page window)."""
        return self.bytes_read_breakdown(state, num_heads)["total"]
