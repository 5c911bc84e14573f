"""``chunkkv`` (Liu et al., 2025, arXiv 2502.00299): keep whole chunks of tokens, reuse indices across layers.

ChunkKV (§3.2, Algorithm 1) scores the prompt with SnapKV's observation window (softmax of the last ``window``
real prompt queries over the keys, float32, summed over the window queries; GQA: mean over each KV group's
query heads), splits the keys into chunks of ``chunk_size`` tokens aligned to position 0, scores each chunk
by the **sum** of its tokens' votes (``A_i = sum_j A[:, j]``), keeps the top chunks whole, in their original
order, and always keeps the last ``window`` tokens. Selection is per KV head and per batch element (the public
PyTorch code picks chunks from batch element 0 for every element; kvjax does not). The paper does not say
whether heads share their chunks (Algorithm 1 is written for one head; method note §6 A4): ``head_mode=
"per_kv_head"`` (default) gives each KV head its own, ``"shared"`` averages the votes over the KV heads so that every
head keeps the same chunks, as kvpress's ``ChunkKVPress`` does (it sums them: the same ranking).

Layer-wise index reuse (§3.3, Algorithm 2): layers with ``layer % reuse == 0`` select; layer ``l`` reuses the
positions selected at layer ``(l // reuse) * reuse`` and gathers its *own* K/V at them (KV head ``h`` reuses
head ``h``'s positions, method note ``docs/notes/chunkkv.md`` §6 A14). ``reuse=1`` selects at every layer. The
reused positions travel through the state itself (``SlotCache.pos``): the class declares
``reuses_previous_layer`` and the engine passes the previous layer's state as ``previous=``; the state shapes
are the same at every layer.

Modes (method note §2.4, §6 A5):

- ``"prefix_exclusive"`` (default): only the prefix ``[0, len - window)`` is scored;
  ``(budget - window) // chunk_size`` whole chunks are kept plus the window, so no token is stored twice and
  every kept chunk is whole except the one that straddles ``len - window`` (cut there; the window follows).
  A partial chunk is scored by the sum over its real prefix tokens (method note §6 A6).
- ``"paper_literal"``: Algorithm 1 as written: all ``len`` keys are scored (window included),
  ``budget // chunk_size`` chunks are selected, the first ``budget - window`` of their tokens (in position
  order) are kept and the last ``window`` tokens are appended. Window tokens can then be stored twice (their
  keys count twice in attention) and the last selected chunks can be cut by position. For fidelity checks only.

``ChunkKV(chunk_size=1)`` is SnapKV without pooling (``SnapKV(kernel=1)``). Budgets are SnapKV's (method
note §3): a fraction of each prompt or a token count, window included; a sequence whose length is within its
budget is kept whole. Compression happens at prefill only (method note §6 A11): decode tokens are appended.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kernels_pallas.checks import check_int
from kvjax.methods.base import (
    Recompressible,
    Capacity,
    LayerContext,
    MIN_TOKENS,
    SlotCache,
    SlotMethod,
    budget_tokens,
    check_budget,
    empty_slots,
    store_prompt,
    top_k,
)
from kvjax.methods.core.scorers import Scorer, check_scorer, make_scorer
from kvjax.methods.core.select import NEG_INF, append_window

MODES = ("prefix_exclusive", "paper_literal")
HEAD_MODES = ("per_kv_head", "shared")


@dataclasses.dataclass(frozen=True, eq=False)
class ChunkKV(SlotMethod, Recompressible):
    """ChunkKV config. ``budget``: fraction of each prompt in (0, 1] or a token count, window included
    (the paper's ``L_max``); ``window``: observation window ``w``; ``chunk_size``: ``c`` (paper default 10);
    ``reuse``: ``N_reuse`` (1 = no index reuse, 2 = the paper's "ChunkKV_reuse"); ``mode``: see module doc;
    ``scorer``: the token scorer whose votes are summed per chunk (``"snapkv"``: the observation window without
    pooling, the paper's; ``"h2o"``: accumulated attention; or a :class:`~kvjax.methods.core.scorers.Scorer`);
    ``head_mode``: ``"per_kv_head"`` (each KV head its own chunks) or ``"shared"`` (the votes averaged over the KV
    heads, the same chunks in every head: kvpress's ``ChunkKVPress``)."""

    name: ClassVar[str] = "chunkkv"
    holds_exactly: ClassVar[bool] = False  # at most held(): the chunk that straddles the window is cut there
    traced_layer: ClassVar[bool] = True  # scan over layers (base.Method.traced_layer)
    reuses_previous_layer: ClassVar[bool] = True  # the engine passes ``previous=`` (index reuse, Alg. 2)
    budget: float | int = 0.2
    window: int = 8
    chunk_size: int = 10
    reuse: int = 1
    mode: str = "prefix_exclusive"
    scorer: str | Scorer = "snapkv"
    head_mode: str = "per_kv_head"

    def __post_init__(self):
        check_budget(self.budget)
        for field, value, fix in (
            ("window", self.window, "use the paper's 4, 8, 16 or 32"),
            ("chunk_size", self.chunk_size, "use the paper's default 10 (1 = SnapKV without pooling)"),
            ("reuse", self.reuse, "use 1 for no index reuse or 2 for the paper's setting"),
        ):
            check_int(field, value, fix=fix)
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} must be one of {', '.join(MODES)}")
        if self.head_mode not in HEAD_MODES:
            raise ValueError(
                f"head_mode={self.head_mode!r} must be one of {', '.join(HEAD_MODES)} ('shared': every KV head keeps "
                "the same chunks, as kvpress's ChunkKVPress)"
            )
        check_scorer(self.scorer)

    # ------------------------------------------------------------------------------------------------------
    # static sizes and the budget contract

    def prompt_slots(self, prompt_len: int) -> int:
        """Static slots for the compressed prompt at bucket ``prompt_len`` (window included; the same at every
        layer, so reused positions always fit): the largest budget of any prompt in the bucket."""
        return budget_tokens(self.budget, prompt_len)

    def windows(self, budgets):
        """Per-sequence kept window ``[B]``: ``min(window, P)``; when no whole chunk fits beside it
        (``P - w < chunk_size``), the window takes the whole budget (the most recent ``P`` tokens)."""
        w = jnp.minimum(self.window, budgets)
        if self.mode == "prefix_exclusive":
            return jnp.where(budgets - w < self.chunk_size, budgets, w).astype(jnp.int32)
        return jnp.where(budgets < self.chunk_size, budgets, w).astype(jnp.int32)

    def init(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> SlotCache:
        p = self.prompt_slots(capacity.prompt_len)
        return empty_slots(model_cfg, batch, p + capacity.max_new_tokens, dtype, prompt_slots=p)

    def starts_at(self, layer: int) -> bool:  # base.Method.starts_at: a follower reuses the layer before it
        return self.is_leader(layer)

    def is_leader(self, layer: int) -> bool:
        """Whether ``layer`` selects its own positions (Algorithm 2: ``layer % reuse == 0``)."""
        return self.reuse == 1 or layer % self.reuse == 0  # reuse=1: every layer, traced or not

    # ------------------------------------------------------------------------------------------------------
    # the four functions

    def select(self, q, k, lengths, slots: int):
        """Kept positions ``idx [B, Hkv, slots]`` int32 (-1 when empty) and ``ok [B, Hkv, slots]``.

        q: ``[B, Hq, T, D]``; k: ``[B, Hkv, T, D]``; lengths: ``[B]`` (right padding beyond is never read).
        Real entries come first: the kept chunk tokens in position order, then the window.
        """
        budgets = jnp.minimum(budget_tokens(self.budget, lengths), slots)
        windows = self.windows(budgets)
        scorer = make_scorer(self.scorer, self.window, kernel=1)
        votes = self.head_votes(scorer(q, k, lengths, lengths - windows))  # [B, Hkv, T] (Alg. 1 "observe window")
        return chunk_select(votes, lengths, budgets, self.window, self.chunk_size, slots, self.mode, windows)

    def head_votes(self, votes):
        """``votes [B, Hkv, T]`` as the chunks are chosen from: unchanged per KV head, or (``head_mode="shared"``)
        their mean over the KV heads in every head (kvpress sums them: the same ranking; the mean keeps a decode
        budget's ``threshold`` on the scale of one head's votes)."""
        if self.head_mode == "per_kv_head":
            return votes
        return jnp.broadcast_to(votes.mean(axis=1, keepdims=True), votes.shape)

    def prefill(self, state: SlotCache, layer: int, q, k, v, lengths, previous: SlotCache | None = None) -> SlotCache:
        """Select (leader layer) or reuse ``previous.pos`` (follower layer), then gather this layer's K/V."""
        p = state.prompt_slots
        if self.reuse > 1 and not isinstance(layer, int):  # a traced layer (scan over layers): choose on device
            if previous is None:
                raise ValueError("a traced layer with reuse > 1 needs previous=<the previous layer's prefill state>")

            def follow():
                idx = previous.pos[:, :, :p]
                return idx, idx >= 0

            idx, ok = jax.lax.cond(layer % self.reuse == 0, lambda: self.select(q, k, lengths, p), follow)
            return store_prompt(state, k, v, idx, ok)
        if not self.is_leader(layer):
            if previous is None:
                raise ValueError(
                    f"layer={layer} reuses the positions of layer {layer - layer % self.reuse} "
                    f"(reuse={self.reuse}) but previous=None; pass previous=<layer {layer - 1}'s "
                    "prefill state> (the engine does) or use reuse=1"
                )
            if previous.prompt_slots != p or previous.pos.shape[:2] != state.pos.shape[:2]:
                raise ValueError(
                    f"previous state has prompt_slots={previous.prompt_slots} and pos shape "
                    f"{previous.pos.shape}, this layer {p} and {state.pos.shape}; index reuse needs "
                    "states initialised with the same config, batch and capacity"
                )
            idx = previous.pos[:, :, :p]  # the leader's positions, carried layer to layer (Alg. 2)
            return store_prompt(state, k, v, idx, idx >= 0)
        idx, ok = self.select(q, k, lengths, p)
        return store_prompt(state, k, v, idx, ok)

    def rescorer(self) -> Scorer:
        return make_scorer(self.scorer, self.window, kernel=1)

    def observation_window(self) -> int:
        return self.window

    def reselect(self, votes, lengths, budgets, slots: int):
        """Whole chunks of ``chunk_size`` consecutive held slots (aligned to the first held slot) ranked by the sum
        of their votes, plus the last ``w`` held slots (base.Method.reselect)."""
        votes = self.rescorer().finish(votes, lengths - self.windows(budgets))  # heads shared before: head_votes
        return chunk_select(
            votes, lengths, budgets, self.window, self.chunk_size, slots, self.mode, self.windows(budgets)
        )

    def min_budget(self) -> tuple[int, str]:
        return (
            max(MIN_TOKENS, self.window + self.chunk_size),
            f"window={self.window} + one chunk of chunk_size={self.chunk_size}",
        )

    def held(self, n: int, steps: int, ctx: LayerContext = LayerContext()) -> int:
        """At most: the whole prompt when it fits its budget ``P``; in ``prefix_exclusive`` mode the window ``w``
        and ``(P - w) // chunk_size`` whole chunks (fewer tokens when the chunk that straddles the window is
        chosen: it is cut there), or ``P`` when no chunk fits beside the window; ``P`` in ``paper_literal``
        mode; plus the decoded tokens."""
        b = int(budget_tokens(self.budget, n))
        if n <= b:
            return n + steps
        w = min(self.window, b)
        if self.mode == "prefix_exclusive" and b - w >= self.chunk_size:
            b = w + (b - w) // self.chunk_size * self.chunk_size
        return b + steps


def chunk_select(
    votes, lengths, budgets, window: int, chunk: int, slots: int, mode: str = "prefix_exclusive", windows=None
):
    """ChunkKV's chunk selection (Alg. 1 "Chunk Attention Score", "Top-K Chunk Selection", "Concatenation").

    votes: ``[B, Hkv, T]`` float32 token scores (larger is kept); lengths, budgets: ``[B]`` int32 (budgets in
    tokens, window included, ``<= slots``); slots: static output size. Returns ``idx [B, Hkv, slots]`` int32
    (-1 for empty slots) and ``ok [B, Hkv, slots]``; real entries first. A sequence with ``length <= budget``
    keeps every token. Ties between chunks go to the lower chunk index (``lax.top_k``).
    """
    b, h, t = votes.shape
    c = chunk
    nc = -(-t // c)
    windows = jnp.minimum(window, budgets) if windows is None else windows
    if mode == "prefix_exclusive":
        limit = lengths - windows  # candidate region [0, limit): the prefix
        kchunks = (budgets - windows) // c
        kmax = max(slots - window, 0) // c
    elif mode == "paper_literal":
        limit = lengths  # every key is scored, the window's own too
        kchunks = jnp.where(budgets < c, 0, budgets // c)
        kmax = slots // c
    else:
        raise ValueError(f"mode={mode!r} must be one of {', '.join(MODES)}")
    kmax = max(0, min(kmax, nc))
    tpos = jnp.arange(nc * c)
    s = jnp.pad(votes.astype(jnp.float32), ((0, 0), (0, 0), (0, nc * c - t)))
    s = jnp.where(tpos[None, None, :] < limit[:, None, None], s, 0.0)
    chunk_scores = s.reshape(b, h, nc, c).sum(-1)  # [B, Hkv, C]: A_i = sum over the chunk's real tokens
    cvalid = (jnp.arange(nc) * c)[None, None, :] < limit[:, None, None]
    chunk_scores = jnp.where(cvalid, chunk_scores, NEG_INF)
    if kmax:
        val, top = top_k(chunk_scores, kmax)  # [B, Hkv, kmax]
        keep = (jnp.arange(kmax)[None, None, :] < kchunks[:, None, None]) & (val > NEG_INF / 2)
        top = jnp.sort(jnp.where(keep, top, nc), axis=-1)  # original order; unused ranks sort last
        tok = (top[..., None] * c + jnp.arange(c)).reshape(b, h, kmax * c)  # [B, Hkv, kmax * c]
        tok_ok = jnp.repeat(top < nc, c, axis=-1) & (tok < limit[:, None, None])
        if mode == "paper_literal":  # K'_{0 : L_max - w}: the first budget - w selected tokens by position
            tok_ok &= jnp.cumsum(tok_ok, axis=-1) <= (budgets - windows)[:, None, None]
    else:
        tok = jnp.zeros((b, h, 0), jnp.int32)
        tok_ok = jnp.zeros((b, h, 0), bool)
    # A window that took the whole budget (no chunk fits beside it) is at most window + chunk - 1 tokens.
    wmax = max(window, min(slots, window + c - 1 if mode == "prefix_exclusive" else c - 1))
    return append_window(tok, tok_ok, lengths, budgets, wmax, slots, windows)
