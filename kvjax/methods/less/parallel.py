"""The parallel (masked) form of LESS attention and the eviction masks of its policies, as training uses them
(:mod:`train_less`; :mod:`kvjax.methods.less` is the decode-time method).

``parallel_attention`` with ``h2o_mask`` / ``lambda_mask`` is the parallel (masked) form used for training
(§2.9 of the note); optionally in query blocks (``chunk``: memory linear in S, gradient included). The masks
replicate *kvjax's* decode semantics (H2O scores = sparse-renormalised probabilities, group mean; one token
evicted per step once over budget), so that feeding a sequence token by token through ``decode`` equals row
``i`` of the parallel form; ``h2o_paper_evictions`` is the paper's parallel H2O mask (full-attention scores).
Every policy evicts for good, so a mask is given by each token's eviction time (``[B, Hkv, S]`` int,
``mask_from_evictions``), which is what training stores.

Einsum axes: b batch, h KV head, g query head within its group, i query position, j/s key position/slot,
r rank, d head dim.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from kernels_pallas.checks import check_int
from kvjax.model import attention
from kvjax.model.attention import NEG_INF
from kvjax.model.sinks import current as current_sinks, sink_lse


def _safe_log(x):
    """``log x`` with ``log 0 = -inf`` and finite gradients (x >= 0)."""
    pos = x > 0
    return jnp.where(pos, jnp.log(jnp.where(pos, x, 1.0)), -jnp.inf)


def synthesize(part, phq, H, z):
    """Eq. (3) from the sparse partials, in log space. part = ``(o [B,Hq,D], m [B,Hq], l [B,Hq])`` over the
    cached tokens (the current one included); ``phq [B, Hq, R]``; ``H [B, Hkv, R, D]``; ``z [B, Hkv, R]``.
    Returns ``[B, Hq, D]`` float32. ``lse = logaddexp(m + log l, log φ·z)``; output
    ``= (o/l)·exp(m + log l - lse) + exp(log φ - lse)·H``."""
    o, m, l = part
    b, hq, r = phq.shape
    hkv, d = H.shape[1], H.shape[-1]
    phg = phq.reshape(b, hkv, hq // hkv, r).astype(jnp.float32)
    # the sparse part's log-sum-exp, with the layer's attention sinks (kvjax.model.sinks) where the model has them: the
    # sink is one more term of the shared denominator, and normalise(part) below divides by it too
    lse_sp = sink_lse(m, l, current_sinks())
    log_lr = _safe_log(jnp.einsum("bhgr,bhr->bhg", phg, z).reshape(b, hq))
    lse = jnp.logaddexp(lse_sp, log_lr)
    w = jnp.exp(_safe_log(phg) - lse.reshape(b, hkv, -1)[..., None])
    low = jnp.einsum("bhgr,bhrd->bhgd", w, H).reshape(b, hq, d)
    return attention.normalise(part) * jnp.exp(lse_sp - lse)[..., None] + low


def _rows_attention(q, k, v, sm, ev, phq, psk):
    """Parallel LESS attention of a block of query rows: q ``[B, Hq, C, D]``, sm / ev ``[B, Hkv, C, S]`` (bool
    sparse set / float evicted set of each row), phq ``[B, Hq, C, R]`` -> ``[B, Hq, C, D]`` float32."""
    b, hq, c, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    r = phq.shape[-1]
    qg = q.reshape(b, hkv, g, c, d)
    sc = jnp.einsum("bhgid,bhjd->bhgij", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(d))
    sc = jnp.where(sm[:, :, None], sc, NEG_INF)
    m = jnp.max(sc, axis=-1)
    p = jnp.where(sm[:, :, None], jnp.exp(sc - m[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum("bhgij,bhjd->bhgid", p, v.astype(jnp.float32))
    lse_sp = m + jnp.log(l)
    phg = phq.reshape(b, hkv, g, c, r).astype(jnp.float32)
    psk = psk.astype(jnp.float32)
    zrow = jnp.einsum("bhij,bhjr->bhir", ev, psk)  # [B, Hkv, C, R]: Σ ψ(k_j) over the evicted j
    lse = jnp.logaddexp(lse_sp, _safe_log(jnp.einsum("bhgir,bhir->bhgi", phg, zrow)))
    w = jnp.exp(_safe_log(phg) - lse[..., None])
    a = jnp.einsum("bhgir,bhjr->bhgij", w, psk) * ev[:, :, None]
    low = jnp.einsum("bhgij,bhjd->bhgid", a, v.astype(jnp.float32))
    out = o / l[..., None] * jnp.exp(lse_sp - lse)[..., None] + low
    return out.reshape(b, hq, c, d)


def _mask_rows(mask, rows, s: int):
    """``(sparse [B, Hkv, C, S] bool, evicted [B, Hkv, C, S] float32)`` of query ``rows [C]`` from a bool mask
    ``[B, Hkv, S, S]`` or eviction times ``[B, Hkv, S]`` (rows past ``S``, padding, repeat the last row)."""
    rows = jnp.minimum(rows, s - 1)
    causal = jnp.arange(s)[None, :] <= rows[:, None]
    if mask.ndim == 3:
        keep = rows[None, None, :, None] < mask[:, :, None, :]
    else:
        keep = jnp.take(mask, rows, axis=2)
    return keep & causal, (~keep & causal).astype(jnp.float32)


def parallel_attention(q, k, v, mask, phq, psk, chunk: int | None = None):
    """Parallel LESS attention (the training form, method note §2.9 / §8.3a).

    q ``[B, Hq, S, D]``; k, v ``[B, Hkv, S, D]``; mask: ``[B, Hkv, S, S]`` bool, row ``i`` attends exactly to
    keys ``mask[i]`` (``i`` itself included), or the policy's eviction times ``[B, Hkv, S]`` int (``mask[i, j] =
    j <= i < evict[j]``, :func:`mask_from_evictions`); every other causal key ``j <= i`` is reached through the
    kernel ``φ(q_i)·ψ(k_j)`` (``phq [B, Hq, S, R]``, ``psk [B, Hkv, S, R]``). Returns ``[B, Hq, S, D]`` f32.

    chunk: query rows per block (``None``: all at once). With a chunk the rows run block by block
    (``lax.map``), each block rematerialised in the backward pass (``jax.checkpoint``), so memory is
    ``O(chunk · S)`` instead of ``O(S²)``, forward and gradient; the result is the same up to float rounding.
    """
    b, hq, s, d = q.shape
    if chunk is None or chunk >= s:
        return _rows_attention(q, k, v, *_mask_rows(mask, jnp.arange(s), s), phq, psk)
    check_int("chunk", chunk, "query rows per block", none_ok=True, numpy_ok=True)
    n = -(-s // chunk)
    pad = ((0, 0), (0, 0), (0, n * chunk - s), (0, 0))
    blocks = lambda x: jnp.moveaxis(jnp.pad(x, pad).reshape(b, x.shape[1], n, chunk, x.shape[-1]), 2, 0)

    @jax.checkpoint
    def block(args):
        qc, pc, start = args
        return _rows_attention(qc, k, v, *_mask_rows(mask, start + jnp.arange(chunk), s), pc, psk)

    out = jax.lax.map(block, (blocks(q), blocks(phq), jnp.arange(n) * chunk))  # [n, B, Hq, C, D]
    return jnp.moveaxis(out, 0, 2).reshape(b, hq, n * chunk, d)[:, :, :s]


def mask_from_evictions(evict, s: int | None = None):
    """The bool mask ``[..., S, S]`` of eviction times ``evict [..., S]``: ``mask[i, j] = j <= i < evict[j]``.
    Every policy here evicts for good (a token never comes back), so its mask is fully given by when each
    token leaves (``S``: never) — ``S`` integers per head instead of ``S²`` bits."""
    s = evict.shape[-1] if s is None else s
    i = jnp.arange(s)[:, None]
    return (jnp.arange(s)[None, :] <= i) & (i < evict[..., None, :])


def _group_probs(qg, kf, i, keys, scale):
    """Softmax over ``keys [B, Hkv, S]`` of query row ``i``, averaged over each KV group -> ``[B, Hkv, S]``."""
    qi = jax.lax.dynamic_index_in_dim(qg, i, axis=3, keepdims=False)  # [B, Hkv, G, D]
    sc = jnp.einsum("bhgd,bhsd->bhgs", qi, kf) * scale
    sc = jnp.where(keys[:, :, None], sc, NEG_INF)
    p = jnp.where(keys[:, :, None], jnp.exp(sc - jnp.max(sc, axis=-1, keepdims=True)), 0.0)
    return (p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)).mean(axis=2)


def h2o_evictions(q, k, budget: int, recent: int):
    """kvjax's H2O decode, run token by token from an empty cache: eviction times ``[B, Hkv, S]`` int32
    (:func:`mask_from_evictions`; row ``i`` = the cache before step ``i`` plus token ``i``, what step ``i``
    attends). Scores: the step's softmax over those keys (mean over each KV group's query heads),
    accumulated. Once more than ``budget`` tokens are held, the lowest-scoring one at position
    ``<= i - recent`` is evicted (H2O §3, kvjax's ``H2O.decode``). A ``lax.scan`` over rows: O(S²) time,
    O(S) state; no S×S tensor.
    """
    j = jnp.arange(q.shape[2])

    def row(carry, i, probs):
        keep, acc, evict = carry
        m = keep | (j == i)[None, None]
        acc = acc + probs(i, m)
        cand = m & (j <= i - recent)[None, None]
        victim = jnp.argmin(jnp.where(cand, acc, jnp.inf), axis=-1)
        over = (m.sum(-1) > budget) & cand.any(-1)
        gone = over[..., None] & (j[None, None] == victim[..., None])
        return m & ~gone, jnp.where(gone, 0.0, acc), jnp.where(gone, i + 1, evict)

    return _scan_evictions(q, k, row)


def _scan_evictions(q, k, row):
    """Eviction times ``[B, Hkv, S]`` int32 of a policy run row by row (a ``lax.scan``; O(S) state).
    ``row((keep, acc, evict), i, probs) -> (keep, acc, evict)``: ``keep [B, Hkv, S]`` bool (the previous row's
    kept keys), ``acc`` float32 scores, ``evict`` int32 times (``S``: never); ``probs(i, keys)`` is
    :func:`_group_probs` of query row ``i`` over ``keys``."""
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, s, d).astype(jnp.float32)
    kf = k.astype(jnp.float32)
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    probs = lambda i, keys: _group_probs(qg, kf, i, keys, scale)
    init = (jnp.zeros((b, hkv, s), bool), jnp.zeros((b, hkv, s), jnp.float32), jnp.full((b, hkv, s), s, jnp.int32))
    return jax.lax.scan(lambda c, i: (row(c, i, probs), None), init, jnp.arange(s))[0][2]


def h2o_mask(q, k, budget: int, recent: int):
    """:func:`h2o_evictions` as a bool mask ``[B, Hkv, S, S]``."""
    return mask_from_evictions(h2o_evictions(q, k, budget, recent))


def h2o_paper_evictions(q, k, budget: int, recent: int):
    """The paper's parallel H2O mask (authors' ``local_heavy_hitter_mask_nonoverlap``; method note §2.7.1) as
    eviction times ``[B, Hkv, S]`` int32. ``r = recent``, ``h = budget - r`` heavy hitters, scores from the
    **full**-attention probabilities ``P`` (mean over each KV group's query heads): rows ``i < h + r`` attend
    causally; from row ``h + r`` on, row ``i`` = the ``h`` highest-scoring kept tokens before ``i - r`` plus
    the band ``i - r .. i``, then ``acc = (acc + P[i]) ⊙ row``. Differs from :func:`h2o_evictions` (kvjax's
    decode: sparse-renormalised scores, evict one when over budget) in its scores only; both attend
    ``budget + 1`` keys per full row. Heavy hitters are chosen among kept tokens, so an evicted token never
    returns (the paper's zeroed score does the same up to exact-zero ties)."""
    b, hkv, s = k.shape[:3]
    j = jnp.arange(s)
    heavy_n = budget - recent
    bi, hi = jnp.arange(b)[:, None, None], jnp.arange(hkv)[None, :, None]

    def row(carry, i, probs):
        keep, acc, evict = carry  # keep: the previous row's mask
        causal = jnp.broadcast_to((j <= i)[None, None], keep.shape)
        p = probs(i, causal)
        band = causal & (j >= i - recent)[None, None]
        if heavy_n > 0:
            cand = jnp.where(keep & (j < i - recent)[None, None], acc, -jnp.inf)
            idx = jax.lax.top_k(cand, heavy_n)[1]
            band = band | jnp.zeros_like(keep).at[bi, hi, idx].set(True)
        mrow = jnp.where(i < budget, causal, band)
        gone = keep & ~mrow
        return mrow, (acc + p) * mrow, jnp.where(gone, i, evict)

    return _scan_evictions(q, k, row)


def lambda_evictions(s: int, slots: int, sinks: int):
    """Λ-masking / StreamingLLM eviction times ``[S]`` int32: sinks stay, token ``j`` leaves at row
    ``j + slots - sinks``."""
    j = jnp.arange(s)
    return jnp.where(j < sinks, s, jnp.minimum(j + slots - sinks, s)).astype(jnp.int32)


def lambda_mask(s: int, slots: int, sinks: int):
    """Λ-masking / StreamingLLM with ``slots`` slots: row ``i`` keeps ``j < sinks`` and the last
    ``slots - sinks`` positions up to ``i`` (method note §2.7.2). ``[S, S]`` bool."""
    i = jnp.arange(s)[:, None]
    j = jnp.arange(s)[None, :]
    return (j <= i) & ((j < sinks) | (j > i - (slots - sinks)))
