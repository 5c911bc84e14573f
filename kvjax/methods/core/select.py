"""Prefill scoring and selection shared by the score-based methods (SnapKV, PyramidKV, H2O, ChunkKV).

Formulas follow the papers' harness (``docs/notes/chunkkv.md`` section 4): softmax attention in float32,
GQA aggregated as the mean over the query heads of each KV group, per-KV-head top-k over the prefix
``[0, len - w)`` plus the last ``w`` tokens always kept, kept tokens in position order, and no compression
for a sequence whose length is within its budget. Ties in top-k go to the lower position (``lax.top_k``).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from kvjax.model import attention
from kvjax import sharding
from kvjax.model.attention import NEG_INF
from kvjax.methods.base import top_k


def window_scores(q, k, lengths, window: int) -> jnp.ndarray:
    """SnapKV observation-window votes ``[B, Hkv, T]`` float32.

    Softmax of the last ``window`` real queries of each sequence over all its keys (causal inside the
    window), summed over those queries, averaged over each KV group's query heads (SnapKV §4.2, Alg. 1).
    q: ``[B, Hq, T, D]``; k: ``[B, Hkv, T, D]``; lengths: ``[B]``.
    """
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    qpos = lengths[:, None] - window + jnp.arange(window)  # [B, w]
    qw = jnp.take_along_axis(q, jnp.clip(qpos, 0, t - 1)[:, None, :, None], axis=2)  # [B, Hq, w, D]
    qw = qw.reshape(b, hkv, hq // hkv, window, d)
    s = jnp.einsum("bhgwd,bhtd->bhgwt", qw, k, preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(d))
    kpos = jnp.arange(t)
    mask = (kpos[None, None, :] <= qpos[:, :, None]) & (kpos[None, None, :] < lengths[:, None, None])
    mask &= (qpos >= 0)[:, :, None]
    s = jnp.where(mask[:, None, None], s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(mask[:, None, None], p, 0.0)
    return p.sum(axis=3).mean(axis=2)


def observed_votes(q_obs, q_pos, k, k_pos) -> jnp.ndarray:
    """Votes ``[B, Hkv, S]`` float32 of held slots from recent queries (a decode-time SnapKV window).

    q_obs: ``[B, Hq, W, D]`` the last ``W`` queries (post-RoPE; any order), q_pos: ``[B, W]`` their positions (-1:
    empty); k: ``[B, Hkv, S, D]`` held keys, k_pos: ``[B, Hkv, S]`` their positions (-1: empty). Each query's
    softmax over the held keys it may see (``0 <= k_pos <= q_pos``, float32), summed over the queries, averaged
    over each KV group's query heads: :func:`window_scores` over a cache that no longer holds every position.
    Empty slots vote 0."""
    b, hq, w, d = q_obs.shape
    hkv = k.shape[1]
    qg = q_obs.reshape(b, hkv, hq // hkv, w, d)
    s = jnp.einsum("bhgwd,bhsd->bhgws", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(d))
    mask = (k_pos[:, :, None, :] >= 0) & (k_pos[:, :, None, :] <= q_pos[:, None, :, None])  # [B, Hkv, W, S]
    mask &= (q_pos >= 0)[:, None, :, None]
    s = jnp.where(mask[:, :, None], s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(mask[:, :, None], p, 0.0)
    return p.sum(axis=3).mean(axis=2)


#: Query rows per block of :func:`accumulated_scores` (its score buffer holds ``G x rows x T`` float32 per head).
SCORE_ROWS = 64
#: How the prompt pass (:func:`accumulated_scores`, :func:`accumulated_attention`) runs: ``tiles`` (the CPU's row
#: blocks and cache-sized key tiles per head group, :func:`_column_sums`) or ``bands`` (GPU/TPU: query bands against
#: all their causal keys in large tiles, or the Pallas kernel where verified; ``kernels_pallas.accumulated_attention``).
PROMPT_PASSES = ("tiles", "bands")
ENV_PROMPT_PASS = "KVJAX_PROMPT_PASS"


def prompt_pass_method(path: str | None = None) -> str:
    """``path`` if given, else ``$KVJAX_PROMPT_PASS`` if set, else ``tiles`` on the CPU backend and ``bands`` on a
    GPU/TPU (:func:`kvjax.model.attention.one_pass`: there every loop trip is a host round trip and every small tile a
    kernel launch). Read at trace time. Both give the same scores and output to float32 rounding
    (tests/kvjax/test_prompt_pass.py)."""
    how = path or os.environ.get(ENV_PROMPT_PASS) or ("bands" if attention.one_pass() else "tiles")
    if how not in PROMPT_PASSES:
        raise ValueError(
            f"{ENV_PROMPT_PASS} (or path=) {how!r} is not one of {PROMPT_PASSES}; unset it to choose by backend"
        )
    return how


def accumulated_scores(
    q,
    k,
    lengths,
    chunk: int = 512,
    rows: int | None = None,
    heads_at_once: bool | None = None,
    path: str | None = None,
) -> jnp.ndarray:
    """H2O accumulated attention ``[B, Hkv, T]``: column sums of the causal softmax over all real queries
    (averaged over each KV group's query heads).

    path (:func:`prompt_pass_method`): ``bands`` (GPU/TPU) is ``kernels_pallas.accumulated_attention``: the Pallas
    kernel where verified, else query bands against all their causal keys in tiles of up to 1 GiB (``rows``: query
    rows per tile, default from that budget; ``chunk`` and ``heads_at_once`` unused): a few while loops of a few
    hundred trips in all at 32k tokens, no per-head loops. ``tiles`` (CPU) is described below.

    One ``q·k`` per causal score (the ``T^2/2`` of one causal attention pass, once), memory linear in ``T``: per
    ``(sequence, KV head)`` (:func:`_column_sums`; split per device on a mesh) the queries go in blocks of ``rows``
    (default :data:`SCORE_ROWS`, or ``chunk`` when it does not divide it), the keys in tiles of ``chunk``. A block
    first folds its causal key tiles into each row's running max and sum (the diagonal tile, the only one masked,
    first; key tiles past it are never computed), keeping each tile's ``exp(s - running max)`` in a buffer of
    ``G x rows x T`` float32; once the row log-sum-exp is final, each tile's column sums are a matrix-vector
    product of the buffer with the per-row factors ``exp(running max - max) / sum`` (no second ``q·k``, no second
    ``exp`` per score). Query blocks past a sequence's length are never visited; padded queries vote for nothing
    and padding is zeroed before use (never read as NaN or inf).

    heads_at_once: run every ``(sequence, KV head)`` together (vmapped; the loops then run to the longest prompt's
    blocks) instead of one after another (``lax.map``: each sequence stops at its own length, and the buffer is one
    head's). None: one after another on CPU (the buffer, ``G x rows x T`` float32, 16 MiB at 16k tokens, stays
    small), together elsewhere (fewer, larger kernels; ``B x Hq x rows x T`` float32)."""
    return _prompt_pass(q, k, None, lengths, chunk, rows, heads_at_once, path)[1]


def accumulated_attention(
    q,
    k,
    v,
    lengths,
    chunk: int = 512,
    rows: int | None = None,
    heads_at_once: bool | None = None,
    path: str | None = None,
):
    """The causal attention of the prompt and H2O's accumulated scores from the same probabilities: ``(out [B, Hq,
    T, D] in q.dtype, scores [B, Hkv, T] float32)``, as ``prefill_attention(q, k, v, lengths)`` and
    :func:`accumulated_scores` (up to float rounding; rows of padded queries are 0). Each query block's buffered
    ``exp`` tiles also give its output (``Σ_j f_j ⊙ (P_j V_j)``), so the pair costs one ``q·k`` and one ``P·v`` per
    causal score: a prefill attention's work, where attention then :func:`accumulated_scores` do a second ``q·k``.
    path: as :func:`accumulated_scores` (``bands``: each tile's full rows give the output and the column sums)."""
    return _prompt_pass(q, k, v, lengths, chunk, rows, heads_at_once, path)


def _prompt_pass(q, k, v, lengths, chunk, rows, heads_at_once, path=None):
    """(out or None, scores) of :func:`accumulated_attention` / :func:`accumulated_scores`."""
    lengths = jnp.asarray(lengths, jnp.int32)
    if prompt_pass_method(path) == "bands":
        return _bands(q, k, v, lengths, rows)
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    c = max(min(chunk, t), 1)
    r = rows or (min(SCORE_ROWS, c) if c % min(SCORE_ROWS, c) == 0 else c)
    if c % r:
        raise ValueError(f"rows={r} must divide chunk={c} (query rows per block inside a key tile)")
    n = -(-t // c)
    at_once = heads_at_once if heads_at_once is not None else jax.default_backend() != "cpu"

    def run(q, k, lengths, *v):
        bl = q.shape[0]
        real = (jnp.arange(t)[None, :] < lengths[:, None])[:, None, :, None]  # [B, 1, T, 1]
        pad = ((0, 0), (0, 0), (0, n * c - t), (0, 0))
        tiles = lambda x: jnp.pad(jnp.where(real, x, 0), pad).reshape(-1, n, c, d)  # noqa: E731  [B*Hkv, N, C, D]
        h = k.shape[1]
        xs = (
            jnp.pad(jnp.where(real, q, 0), pad).reshape(bl * h, g, n * c, d),
            tiles(k),
            jnp.repeat(lengths, h),
            *(tiles(x) for x in v),
        )
        if at_once:
            live = (jnp.max(lengths) + r - 1) // r  # unbatched: the loops are not batched under vmap
            acc, out = jax.vmap(lambda *a: _column_sums(*a[:3], live, r, *a[3:]))(*xs)
        else:
            acc, out = jax.lax.map(lambda a: _column_sums(*a[:3], (a[2] + r - 1) // r, r, *a[3:]), xs)
        acc = acc.reshape(bl, h, n * c)[..., :t] / g
        if out is None:
            return acc
        return out.reshape(bl, h * g, n * c, d)[:, :, :t].astype(q.dtype), acc

    if v is None:
        return None, sharding.per_head(run, q, k, lengths)
    return sharding.per_head(run, q, k, lengths, v)


def _bands(q, k, v, lengths, rows):
    """The ``bands`` prompt pass: ``kernels_pallas.accumulated_attention`` per device's heads (its Pallas kernel
    where verified, else the banded XLA path with ``rows`` query rows per tile)."""
    from kernels_pallas import accumulated_attention as aa

    impl = aa.default_impl()
    if impl == "pallas_gpu" and not aa.pallas_gpu_supports(q.shape[-1]):
        impl = "xla"  # a head_dim Triton cannot tile (not a power of two >= 16): decided by shape, not by a failure
    opts = {"rows": rows} if impl == "xla" else {}

    def run(q, k, lengths, v):
        out, acc = aa.accumulated_attention(q, k, v, lengths, impl=impl, **opts)
        return acc if out is None else (out, acc)

    if v is None:
        return None, sharding.per_head(run, q, k, lengths, None)
    return sharding.per_head(run, q, k, lengths, v)


def _column_sums(q, k, length, live, r: int, v=None):
    """Column sums ``[N * C]`` of one head group's causal softmax and, with ``v``, its attention output ``[G, N *
    C, D]`` float32 (else None): q ``[G, N * C, D]`` (zero past ``length``), k, v ``[N, C, D]`` key tiles, length:
    int32 scalar, live: query blocks to visit (``>= ceil(length / r)``), r: query rows per block (divides ``C``).
    See :func:`accumulated_scores`."""
    g, tp, d = q.shape
    n, c = k.shape[:2]
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    offs_r, offs_c = jnp.arange(r), jnp.arange(c)

    def block(i, carry):
        buf, mt, acc, out = carry  # buf [N, G, R, C]: exp(s - running max) per key tile, mt [N, G, R] that max
        qi = jax.lax.dynamic_slice_in_dim(q, i * r, r, axis=1)  # [G, R, D]
        jd = (i * r) // c  # the key tile holding this block's diagonal
        tile = lambda j: jnp.einsum("grd,cd->grc", qi, k[j], preferred_element_type=jnp.float32) * scale  # noqa: E731
        causal = (jd * c + offs_c)[None, :] <= (i * r + offs_r)[:, None]  # [R, C]
        s = jnp.where(causal, tile(jd), NEG_INF)
        m = jnp.max(s, axis=-1)  # finite: every row sees itself
        p = jnp.exp(s - m[..., None])  # exactly 0 where masked
        buf = jax.lax.dynamic_update_index_in_dim(buf, p, jd, axis=0)
        mt = jax.lax.dynamic_update_index_in_dim(mt, m, jd, axis=0)

        def forward(j, cr):  # unmasked tiles left of the diagonal: online max and sum
            buf, mt, m, l = cr
            s = tile(j)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None])
            l = l * jnp.exp(m - m_new) + jnp.sum(p, axis=-1)
            buf = jax.lax.dynamic_update_index_in_dim(buf, p, j, axis=0)
            return buf, jax.lax.dynamic_update_index_in_dim(mt, m_new, j, axis=0), m_new, l

        buf, mt, m, l = jax.lax.fori_loop(0, jd, forward, (buf, mt, m, jnp.sum(p, axis=-1)))
        real = (i * r + offs_r < length)[None, :]  # [1, R]: padded queries vote for nothing

        def columns(j, cr):  # exp(s - lse) = buf_j * exp(mt_j - m) / l, summed over the group's rows
            acc, o = cr
            f = jnp.where(real, jnp.exp(mt[j] - m) / l, 0.0)  # [G, R]
            col = jnp.einsum("gr,grc->c", f, buf[j], preferred_element_type=jnp.float32)
            acc = jax.lax.dynamic_update_index_in_dim(acc, acc[j] + col, j, axis=0)
            if v is not None:
                o = o + f[..., None] * jnp.einsum(
                    "grc,cd->grd", buf[j].astype(v.dtype), v[j], preferred_element_type=jnp.float32
                )
            return acc, o

        o = None if v is None else jnp.zeros((g, r, d), jnp.float32)
        acc, o = jax.lax.fori_loop(0, jd + 1, columns, (acc, o))
        if v is not None:
            out = jax.lax.dynamic_update_slice_in_dim(out, o, i * r, axis=1)
        return buf, mt, acc, out

    init = (
        jnp.zeros((n, g, r, c), jnp.float32),
        jnp.zeros((n, g, r), jnp.float32),
        jnp.zeros((n, c), jnp.float32),
        None if v is None else jnp.zeros((g, tp, d), jnp.float32),
    )
    _, _, acc, out = jax.lax.fori_loop(0, live, block, init)
    return acc.reshape(n * c), out


def pool1d(x: jnp.ndarray, kernel: int, kind: str) -> jnp.ndarray:
    """Stride-1 'same' pooling over the last axis (PyTorch ``avg_pool1d``/``max_pool1d`` with
    ``padding=kernel//2``; average counts the zero padding, as PyTorch's default does)."""
    if kernel == 1:
        return x
    pad = kernel // 2
    dims = (1,) * (x.ndim - 1) + (kernel,)
    pads = ((0, 0),) * (x.ndim - 1) + ((pad, pad),)
    if kind == "max":
        return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, dims, (1,) * x.ndim, pads)
    return jax.lax.reduce_window(x, 0.0, jax.lax.add, dims, (1,) * x.ndim, pads) / kernel


def kept_window(budgets, window: int):
    """Per-sequence kept window ``[B]``: ``min(window, budget)`` (a budget below the window keeps its most
    recent ``budget`` tokens instead of overshooting)."""
    return jnp.minimum(window, budgets).astype(jnp.int32)


def topk_with_window(scores, lengths, budgets, window: int, slots: int, windows=None):
    """Per-KV-head selection: top ``budget - w`` prefix tokens plus the last ``w`` tokens.

    scores: ``[B, Hkv, T]`` (larger is kept); lengths, budgets: ``[B]`` int; window: static largest window;
    windows: ``[B]`` per-sequence windows ``<= window`` (default :func:`kept_window`); slots: static output size
    (>= every budget). Returns ``idx [B, Hkv, slots]`` int32 positions in increasing order and
    ``ok [B, Hkv, slots]`` marking real entries. A sequence with ``length <= budget`` keeps every token.
    """
    b, h, t = scores.shape
    windows = kept_window(budgets, window) if windows is None else windows
    kmax = min(max(slots - window, 0), t)
    prefix = (lengths - windows)[:, None, None]  # [B,1,1]
    pos = jnp.arange(t)
    cand = pos[None, None, :] < prefix
    masked = jnp.where(cand, scores, NEG_INF)
    if kmax:
        val, top = top_k(masked, kmax)  # [B, H, kmax]
        keep = (jnp.arange(kmax)[None, None, :] < (budgets - windows)[:, None, None]) & (val > NEG_INF / 2)
        top = jnp.sort(jnp.where(keep, top, t + slots), axis=-1)
        keep = top < t
    else:
        top = jnp.zeros((b, h, 0), jnp.int32)
        keep = jnp.zeros((b, h, 0), bool)
    return append_window(jnp.where(keep, top, -1), keep, lengths, budgets, window, slots, windows)


def append_window(idx, ok, lengths, budgets, window: int, slots: int, windows=None):
    """Selected positions plus the last ``w`` prompt tokens, compacted to ``slots`` entries.

    idx, ok: ``[B, Hkv, N]`` selected positions (in position order) and their validity; lengths, budgets:
    ``[B]``; window: static largest window; windows: ``[B]`` per-sequence windows (default
    :func:`kept_window`). Returns ``idx [B, Hkv, slots]`` int32 (-1 for empty slots) and ``ok``: real entries
    first, in position order (the selected prefix tokens precede the window). A sequence with
    ``length <= budget`` keeps every token (no compression).
    """
    b, h = idx.shape[:2]
    windows = kept_window(budgets, window) if windows is None else windows
    off = jnp.arange(window)
    win = jnp.broadcast_to((lengths - window)[:, None, None] + off, (b, h, window))
    win_ok = (win >= 0) & (off[None, None, :] >= (window - windows)[:, None, None])
    idx = jnp.concatenate([idx, win], axis=-1)
    ok = jnp.concatenate([ok, win_ok], axis=-1)
    order = jnp.argsort(~ok, axis=-1, stable=True)  # real entries first, relative order kept
    idx = jnp.take_along_axis(idx, order, axis=-1)
    ok = jnp.take_along_axis(ok, order, axis=-1)
    pad = slots - idx.shape[-1]
    if pad > 0:
        idx = jnp.concatenate([idx, jnp.full((b, h, pad), -1, idx.dtype)], axis=-1)
        ok = jnp.concatenate([ok, jnp.zeros((b, h, pad), bool)], axis=-1)
    idx, ok = idx[..., :slots], ok[..., :slots]
    whole = (lengths <= budgets)[:, None, None]
    every = jnp.broadcast_to(jnp.arange(slots), (b, h, slots))
    idx = jnp.where(whole, every, idx).astype(jnp.int32)
    ok = jnp.where(whole, every < lengths[:, None, None], ok)
    return jnp.where(ok, idx, -1), ok
