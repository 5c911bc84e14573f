"""``less`` (Dong et al., 2024, "Get More with LESS", §3): a learned constant-size low-rank state beside a
sparse eviction policy (H2O or Λ-masking = StreamingLLM).

The sparse policy (:class:`~kvjax.methods.h2o.H2O` or :class:`~kvjax.methods.streaming.StreamingLLM`,
wrapped, not copied) keeps and evicts tokens exactly as on its own, in its fixed slot buffer. Every KV pair
it evicts is folded into a per-KV-head state ``H = Σ ψ(k)ᵀ v`` ``[R, D]`` and ``z = Σ ψ(k)`` ``[R]``
(Eqs. 4-5) before its slot is reused, and each query attends exactly to the cached tokens and through the
learned kernel ``φ(q)·ψ(k)`` to every evicted one, with one shared normaliser (Eq. 3)::

    â = (φ(q) H + Σ_cache exp(q·k/√D) v) / (φ(q) zᵀ + Σ_cache exp(q·k/√D))

computed from the sparse cache's flash partials ``(o, m, l)`` in log space (never overflows; with ``H = 0,
z = 0`` it is bit-for-bit the sparse policy's output). After the full-attention prefill, every prompt token
the policy did not keep goes into ``H, z`` at once (method note ``docs/notes/less.md`` §2.8), ``fold_chunk``
prompt tokens at a time (memory linear in the prompt; the sum is the same up to float rounding). The fold is
linear in the prompt and small beside the prefill attention: ψ of every prompt token (one MLP per token and KV
head, about ``2 D hidden`` multiply-adds) and one rank-``R`` outer product.

A decode step is the wrapped policy's step (H2O: one pass over the live slots' K and V, ``h2o`` module docstring)
plus, once per step and never per slot, ``φ(q)`` of the ``Hq`` query heads, ``ψ(k)`` of the one evicted key per
KV head and the ``H, z`` update: it reads the policy's bytes, ``H, z`` and the kernel weights (``bytes_read_per_step``).

Kernels φ (per query head) and ψ (per KV head) are :class:`LessKernels`: the method note's §2.3/§8.2 "code"
form — φ(q) = |gelu(gelu(q W1) W2)|, ψ(k) = |u + (u W3) ⊙ s2| with u = |s1| ⊙ gelu(gelu(k W1) W2), exact
(erf) GELU, no biases, dropout on the first pre-activation (training only), scales ``s1, s2 [Hkv, R]``
initialised at 1e-4 (the paper's warm start, §3.2). Rank ``R`` (default 8), hidden width (default 512).

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

import dataclasses
import functools
import json
import warnings
from pathlib import Path
from typing import Any, Callable, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax import attention
from kvjax.methods.base import LayerContext, Capacity, Method, SlotCache, tree_bytes
from kvjax.methods.h2o import H2O
from kvjax.methods.streaming import StreamingLLM

from kvjax.attention import NEG_INF  # noqa: E402

KERNELS_FILE = "kernels.npz"
CONFIG_FILE = "less_config.json"
FORMAT = "kvjax-less-kernels/1"
POLICIES = ("h2o", "lambda")
#: Parallel H2O masks for training: kvjax's decode semantics, or the paper's (:meth:`Less.eviction_times`).
MASKS = ("decode", "paper")
#: Fields of the model config that a kernel file must match (the head layout and the model's identity).
MODEL_KEYS = ("model_type", "num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size")


def gelu(x):
    """Exact (erf) GELU, as torch's ``F.gelu`` (the note's A5: not the tanh approximation)."""
    return jax.nn.gelu(x, approximate=False)


def _per_head(x, w):
    """``x [B, H, ..., Din] @ w [H, Din, Dout]`` per head -> ``[B, H, ..., Dout]`` (float32)."""
    b, h = x.shape[:2]
    flat = x.reshape(b, h, -1, x.shape[-1]).astype(jnp.float32)
    out = jnp.einsum("bhnd,hde->bhne", flat, w.astype(jnp.float32))
    return out.reshape(*x.shape[:-1], w.shape[-1])


def _per_head_vec(s, x):
    """Broadcast a per-head vector ``s [H, R]`` over ``x [B, H, ..., R]``."""
    return s.reshape((1, s.shape[0]) + (1,) * (x.ndim - 3) + (s.shape[1],))


class LessKernels(nn.Module):
    """φ and ψ of one attention layer (paper Eqs. 1-2 in the released code's form; method note §2.3, §8.2).

    Params: ``q_w1 [Hq, D, Rh]``, ``q_w2 [Hq, Rh, R]``, ``k_w1 [Hkv, D, Rh]``, ``k_w2 [Hkv, Rh, R]``,
    ``k_w3 [Hkv, R, R]``, ``k_s1, k_s2 [Hkv, R]`` (init ``scale_init``). Weights: Glorot-uniform per head.
    """

    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    rank: int = 8
    hidden: int = 512
    dropout: float = 0.3
    scale_init: float = 1e-4

    def setup(self):
        glorot = nn.initializers.variance_scaling(1.0, "fan_avg", "uniform", in_axis=-2, out_axis=-1, batch_axis=(0,))
        d, rh, r, hq, hk = self.head_dim, self.hidden, self.rank, self.n_q_heads, self.n_kv_heads
        self.q_w1 = self.param("q_w1", glorot, (hq, d, rh))
        self.q_w2 = self.param("q_w2", glorot, (hq, rh, r))
        self.k_w1 = self.param("k_w1", glorot, (hk, d, rh))
        self.k_w2 = self.param("k_w2", glorot, (hk, rh, r))
        self.k_w3 = self.param("k_w3", glorot, (hk, r, r))
        self.k_s1 = self.param("k_s1", nn.initializers.constant(self.scale_init), (hk, r))
        self.k_s2 = self.param("k_s2", nn.initializers.constant(self.scale_init), (hk, r))
        self.drop = nn.Dropout(self.dropout)

    def phi(self, q, deterministic: bool = True):
        """Query features ``[B, Hq, ..., R]`` (>= 0) of post-RoPE ``q [B, Hq, ..., D]``."""
        h = gelu(self.drop(_per_head(q, self.q_w1), deterministic=deterministic))
        return jnp.abs(gelu(_per_head(h, self.q_w2)))

    def psi(self, k, deterministic: bool = True):
        """Key features ``[B, Hkv, ..., R]`` (>= 0) of post-RoPE ``k [B, Hkv, ..., D]``."""
        h = gelu(self.drop(_per_head(k, self.k_w1), deterministic=deterministic))
        u = _per_head_vec(jnp.abs(self.k_s1), k) * gelu(_per_head(h, self.k_w2))
        u = u + _per_head(u, self.k_w3) * _per_head_vec(self.k_s2, k)
        return jnp.abs(u)

    def __call__(self, q, k, deterministic: bool = True):
        return self.phi(q, deterministic), self.psi(k, deterministic)


def module_for(kernels) -> LessKernels:
    """The :class:`LessKernels` module matching one layer's params (shapes read from them)."""
    hq, d, rh = kernels["q_w1"].shape
    return LessKernels(
        n_q_heads=hq, n_kv_heads=kernels["k_w1"].shape[0], head_dim=d, rank=kernels["q_w2"].shape[-1], hidden=rh
    )


def init_kernels(model_cfg, key, rank: int = 8, hidden: int = 512) -> dict:
    """Fresh params (``{"q_w1": ..., ...}``, float32) of one layer's kernels for ``model_cfg``."""
    return _init_kernels(model_cfg, key, rank, hidden)


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def _init_kernels(model_cfg, key, rank, hidden):
    mod = LessKernels(model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.head_dim, rank, hidden)
    d = model_cfg.head_dim
    q = jnp.zeros((1, model_cfg.num_heads, 1, d))
    k = jnp.zeros((1, model_cfg.num_kv_heads, 1, d))
    return dict(mod.init(key, q, k)["params"])


def mlp_phi(kernels, q):
    """Default φ hook: the MLP, deterministic. ``q [B, Hq, ..., D]`` -> ``[B, Hq, ..., R]``."""
    return module_for(kernels).apply({"params": kernels}, q, method="phi")


def mlp_psi(kernels, k):
    """Default ψ hook: the MLP, deterministic. ``k [B, Hkv, ..., D]`` -> ``[B, Hkv, ..., R]``."""
    return module_for(kernels).apply({"params": kernels}, k, method="psi")


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
    lse_sp = m + jnp.log(l)
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
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1 (query rows per block) or None")
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


@struct.dataclass
class LessState:
    """One layer's LESS state: the sparse policy's slot cache plus ``H [B, Hkv, R, D]`` and ``z [B, Hkv, R]``
    (float32), and this layer's kernel params (model weights, shared by the batch; not counted as cache)."""

    sparse: SlotCache
    H: jnp.ndarray
    z: jnp.ndarray
    kernels: Any


@functools.lru_cache(maxsize=4)
def _load_kernels(path: str, mtime: float):
    folder = Path(path)
    meta = json.loads((folder / CONFIG_FILE).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"kernels={path!r}: {CONFIG_FILE} has format {meta.get('format')!r}, expected {FORMAT!r}; "
            "train kernels with kvjax-train-less"
        )
    with np.load(folder / KERNELS_FILE) as f:
        arrays = {name: np.asarray(f[name]) for name in f.files}
    return meta, arrays


def load_kernels(path, model_cfg=None):
    """``(meta, {name: [L, ...] np.ndarray})`` from a ``kvjax-train-less`` output folder. With ``model_cfg``,
    refuses kernels trained for another model or head layout (ValueError naming each mismatch)."""
    folder = Path(path)
    for f in (CONFIG_FILE, KERNELS_FILE):
        if not (folder / f).is_file():
            raise FileNotFoundError(
                f"kernels={str(path)!r} has no {f}; pass the output folder of kvjax-train-less "
                "(it holds kernels.npz and less_config.json)"
            )
    meta, arrays = _load_kernels(str(folder.resolve()), (folder / KERNELS_FILE).stat().st_mtime)
    if model_cfg is not None:
        check_model(meta, model_cfg, f"kernels={str(path)!r}")
    return meta, arrays


def parse_layers(spec, num_layers: int) -> list[int]:
    """Layer indices from ``"0-7"``, ``"0,2,5-9"``, an int or a list (``None``: all), checked against the model."""
    if spec is None:
        return list(range(num_layers))
    given = spec
    if isinstance(spec, int):
        spec = [spec]
    if isinstance(spec, str):
        out = []
        try:
            for part in spec.split(","):
                a, _, b = part.strip().partition("-")
                out.extend(range(int(a), int(b if b else a) + 1))
        except ValueError:
            raise ValueError(f"layers={spec!r}: expected layer indices such as '0-7' or '0,2,5-9'") from None
        spec = out
    out = sorted(set(int(x) for x in spec))
    if not out or out[0] < 0 or out[-1] >= num_layers:
        raise ValueError(
            f"layers={given!r}: the model has layers 0-{num_layers - 1}; pass a non-empty subset such as '0-7'"
        )
    return out


def format_layers(layers) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out, layers = [], sorted(layers)
    for i, x in enumerate(layers):
        if i and x == layers[i - 1] + 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def model_identity(model_cfg, name: str | None = None) -> dict:
    """What a kernel file records about its model (and must match to be reused)."""
    ident = {key: getattr(model_cfg, key) for key in MODEL_KEYS}
    ident["name"] = name
    return ident


def check_model(meta: dict, model_cfg, what: str):
    want = meta.get("model", {})
    bad = [
        f"{key}: trained for {want.get(key)!r}, this model has {getattr(model_cfg, key)!r}"
        for key in MODEL_KEYS
        if want.get(key) != getattr(model_cfg, key)
    ]
    if bad:
        raise ValueError(
            f"{what} were trained for another model ({want.get('name')!r}) or head layout: "
            f"{'; '.join(bad)}. Train kernels for this model with kvjax-train-less"
        )


@dataclasses.dataclass(frozen=True)
class Less(Method):
    """LESS config (static under jit).

    policy: ``"h2o"`` (heavy hitters + recent, ``recent`` as in :class:`H2O`) or ``"lambda"`` (Λ-masking:
    ``sinks`` first tokens + recent, i.e. :class:`StreamingLLM`); budget: the sparse cache's budget (as for
    the wrapped policy). kernels: a ``kvjax-train-less`` output folder, or None for fresh kernels
    (``rank``, ``hidden``, ``seed``; warm-start scale 1e-4, so LESS starts close to the sparse policy).
    phi_fn / psi_fn: feature-map hooks ``fn(kernels, x [B, H, ..., D]) -> [B, H, ..., R]`` replacing the
    MLP (e.g. analytic kernels; ``kernels`` is then whatever pytree the state's ``kernels`` holds).
    strict: with ``kernels``, a policy, budget, recent window or sinks other than those the kernels were
    trained with (``less_config.json``) is a ValueError instead of a warning. A kernels folder whose
    ``layers_trained`` lacks a layer (a ``kvjax-train-less --layers`` run) is an error when that layer is used.
    """

    name: ClassVar[str] = "less"
    traced_layer: ClassVar[bool] = True  # scan over layers (base.Method.traced_layer)
    policy: str = "h2o"
    budget: float | int = 0.1
    recent: float | int = 0.5
    sinks: int = 4
    kernels: str | None = None
    rank: int = 8
    hidden: int = 512
    seed: int = 0
    phi_fn: Callable | None = None
    psi_fn: Callable | None = None
    fold_chunk: int = 2048  # prompt tokens per step of the prefill fold into H, z (memory, not results)
    strict: bool = False

    @classmethod
    def small_options(cls) -> dict:  # base.Method.small_options: a 16-wide kernel hidden layer
        return dict(hidden=16)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} is not a LESS sparse policy; choose 'h2o' or 'lambda'")
        if self.rank < 1 or self.hidden < 1:
            raise ValueError(f"rank={self.rank} and hidden={self.hidden} must be >= 1")
        if isinstance(self.fold_chunk, bool) or not isinstance(self.fold_chunk, int) or self.fold_chunk < 1:
            raise ValueError(f"fold_chunk={self.fold_chunk!r} must be an int >= 1 (prompt tokens per fold step)")
        if self.kernels is not None:
            meta, _ = load_kernels(self.kernels)  # fail early: missing files or another format
            self._check_trained(meta.get("policy"))
        if not self.sparse.has_decode_partial:  # the declared capability LESS needs (never getattr)
            raise ValueError(f"policy={self.policy!r} does not provide decode_partial; LESS wraps h2o or lambda")

    def _check_trained(self, trained: dict | None):
        """Warn (ValueError with ``strict``) when the policy, budget, recent window (H2O) or sinks (Λ) differ
        from those the kernels were trained with (``less_config.json``'s ``policy``)."""
        if not trained:
            return
        bad = []
        if self.policy != trained.get("policy"):
            bad.append(f"policy: trained {trained.get('policy')!r}, requested {self.policy!r}")
        elif isinstance(self.budget, float):
            bad.append(
                f"budget: trained {trained.get('budget')} tokens, requested {self.budget} (a fraction of each "
                "prompt, so the token count varies)"
            )
        elif self.budget != trained.get("budget"):
            bad.append(f"budget: trained {trained.get('budget')}, requested {self.budget}")
        if self.policy == trained.get("policy") == "h2o" and isinstance(trained.get("budget"), int):
            if self.budget == trained["budget"]:  # the same budget: compare the windows in tokens
                want = H2O(budget=trained["budget"], recent=trained.get("recent", 0.5))._recent(trained["budget"])
                have = self.sparse._recent(self.budget)
                if have != want:
                    bad.append(
                        f"recent: trained {trained.get('recent')!r} ({want} tokens), requested "
                        f"{self.recent!r} ({have} tokens)"
                    )
            elif self.recent != trained.get("recent"):
                bad.append(f"recent: trained {trained.get('recent')!r}, requested {self.recent!r}")
        if self.policy == trained.get("policy") == "lambda" and self.sinks != trained.get("sinks"):
            bad.append(f"sinks: trained {trained.get('sinks')}, requested {self.sinks}")
        if bad:
            msg = (
                f"kernels={self.kernels!r} were trained for another sparse policy setting: {'; '.join(bad)}. "
                "LESS kernels transfer across settings only approximately; use the trained values, or train "
                "kernels for these (kvjax-train-less)"
            )
            if self.strict:
                raise ValueError(msg + " (strict=True)")
            warnings.warn(msg, stacklevel=3)

    @property
    def sparse(self):
        """The wrapped sparse policy's config."""
        if self.policy == "h2o":
            return H2O(budget=self.budget, recent=self.recent)
        return StreamingLLM(budget=self.budget, sinks=self.sinks)

    @property
    def evicts_before_attending(self) -> bool:
        """Λ overwrites the oldest recent token before attending; H2O attends then evicts (Algorithm 1)."""
        return self.policy == "lambda"

    def _phi(self, kernels, q):
        return (self.phi_fn or mlp_phi)(kernels, q)

    def _psi(self, kernels, k):
        return (self.psi_fn or mlp_psi)(kernels, k)

    def layer_kernels(self, model_cfg, layer: int):
        """This layer's kernel params (loaded and checked, or fresh), as new device arrays."""
        if self.kernels is None:
            key = jax.random.fold_in(jax.random.PRNGKey(self.seed), layer)
            return init_kernels(model_cfg, key, self.rank, self.hidden)
        meta, arrays = load_kernels(self.kernels, model_cfg)
        trained = meta.get("layers_trained")
        if trained is not None and layer not in trained:
            folder = Path(self.kernels)
            hint = (
                f"this is one --layers run; use its parent {str(folder.parent)!r}, where all runs are merged"
                if folder.name.startswith("layers-")
                else f"train the missing ones with kvjax-train-less --layers A-B --out {self.kernels} (its runs merge "
                "into that folder)"
            )
            raise ValueError(
                f"kernels={self.kernels!r} have no trained kernels for layer {layer} (trained layers: "
                f"{format_layers(trained)} of {model_cfg.num_layers}); {hint}"
            )
        return {name: jnp.array(a[layer], dtype=jnp.float32) for name, a in arrays.items()}

    def init(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> LessState:
        kernels = self.layer_kernels(model_cfg, layer)
        r = kernels["q_w2"].shape[-1] if "q_w2" in kernels else self.rank
        h, d = model_cfg.num_kv_heads, model_cfg.head_dim
        return LessState(
            sparse=self.sparse.init(model_cfg, batch, capacity, layer, dtype),
            H=jnp.zeros((batch, h, r, d), jnp.float32),
            z=jnp.zeros((batch, h, r), jnp.float32),
            kernels=kernels,
        )

    @property
    def attends_prompt(self) -> bool:  # base.Method.attends_prompt: as its policy (H2O: yes)
        return self.sparse.attends_prompt

    def prefill(self, state: LessState, layer: int, q, k, v, lengths, previous=None) -> LessState:
        """Full-attention prefill is done by the engine; the policy compresses the prompt and every valid
        prompt token it did not keep is folded into ``H, z`` at once (Eqs. 4-5, note §2.8)."""
        return self._fold_evicted(state, k, v, lengths, self.sparse.prefill(state.sparse, layer, q, k, v, lengths))

    def prefill_attend(self, state: LessState, layer: int, q, k, v, lengths, previous=None):
        """The policy's :meth:`prefill_attend` (the prompt's attention and its scores in one pass), then the fold."""
        out, sparse = self.sparse.prefill_attend(state.sparse, layer, q, k, v, lengths)
        return out, self._fold_evicted(state, k, v, lengths, sparse)

    def _fold_evicted(self, state: LessState, k, v, lengths, sparse) -> LessState:
        """``state`` with the policy's prompt cache ``sparse`` and every valid prompt token it did not keep folded
        into ``H, z``."""
        t = k.shape[2]
        tpos = jnp.arange(t)
        b, h, s = sparse.pos.shape
        # kept [B, Hkv, T] by a scatter of the kept positions (O(slots + T), not an [S, T] comparison)
        kept = (
            jnp.zeros((b, h, t + 1), bool)
            .at[jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None], jnp.where(sparse.pos >= 0, sparse.pos, t)]
            .set(True)[..., :t]
        )
        ev = (tpos[None, None, :] < lengths[:, None, None]) & ~kept
        H, z = self._fold(state.kernels, k, v, ev, state.H, state.z)
        return state.replace(sparse=sparse, H=H, z=z)

    def _fold(self, kernels, k, v, ev, H, z):
        """``H + Σ_t ψ(k_t)ᵀ v_t`` and ``z + Σ_t ψ(k_t)`` over the prompt tokens with ``ev [B, Hkv, T]``
        (Eqs. 4-5), ``fold_chunk`` tokens at a time: memory linear in ``T`` with a small constant (ψ's hidden
        layer is ``[B, Hkv, fold_chunk, hidden]``, never ``[B, Hkv, T, hidden]``)."""
        b, h, t, d = k.shape
        c = min(self.fold_chunk, t)
        n = -(-t // c)
        pad = ((0, 0), (0, 0), (0, n * c - t))
        kc = jnp.pad(k, pad + ((0, 0),)).reshape(b, h, n, c, d)
        vc = jnp.pad(v, pad + ((0, 0),)).reshape(b, h, n, c, v.shape[-1])
        ec = jnp.pad(ev, pad).reshape(b, h, n, c)

        def add(i, carry):
            H, z = carry
            at = lambda x: jax.lax.dynamic_index_in_dim(x, i, axis=2, keepdims=False)  # noqa: E731
            psk = jnp.where(at(ec)[..., None], self._psi(kernels, at(kc)), 0.0)  # [B, Hkv, C, R]
            return (H + jnp.einsum("bhtr,bhtd->bhrd", psk, at(vc).astype(jnp.float32)), z + psk.sum(axis=2))

        return jax.lax.fori_loop(0, n, add, (H, z))

    def decode(self, state: LessState, layer: int, q, k, v, pos):
        """Algorithm 1: attend (Eq. 3) over the sparse cache + the new token + ``H, z``; fold the evicted
        pair into ``H, z`` (Eqs. 4-5). q ``[B, Hq, D]``; k, v ``[B, Hkv, D]``; pos ``[B]``."""
        part, sparse, (ek, evv, gone) = self.sparse.decode_partial(state.sparse, layer, q, k, v, pos)
        pe = jnp.where(gone[..., None], self._psi(state.kernels, ek[:, :, None, :])[:, :, 0], 0.0)  # [B,Hkv,R]
        dH = pe[..., :, None] * jnp.where(gone[..., None], evv.astype(jnp.float32), 0.0)[..., None, :]
        H, z = state.H + dH, state.z + pe
        if self.evicts_before_attending:
            out = synthesize(part, self._phi(state.kernels, q), H, z)
        else:
            out = synthesize(part, self._phi(state.kernels, q), state.H, state.z)
        return out, state.replace(sparse=sparse, H=H, z=z)

    def state_axes(self, state: LessState):
        """The sparse part and ``H``, ``z`` are batch- and head-major; the kernels (weights, no batch axis) are
        replicated."""
        axes = super().state_axes(state)
        return axes.replace(kernels=jax.tree.map(lambda x: (), state.kernels))

    def memory_bytes(self, state: LessState) -> int:
        """Sparse cache + ``H`` + ``z`` (the kernel weights are model weights, like the LLM's, not cache)."""
        return tree_bytes(state.sparse) + tree_bytes((state.H, state.z))

    def held_overhead_bytes(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> int:
        """The policy's overhead plus the constant-size part: ``H``, ``z`` and the kernel weights, whose size must
        not depend on the capacity (measured at the smallest one, so a state that grew with the bucket fails)."""
        small = jax.eval_shape(lambda: self.init(model_cfg, batch, Capacity(1, 1), layer, dtype))
        return self.sparse.held_overhead_bytes(model_cfg, batch, capacity, layer, dtype) + tree_bytes(
            (small.H, small.z, small.kernels)
        )

    def bytes_read_per_step(self, state: LessState, num_heads: int) -> int:
        """The sparse policy's step plus ``H, z`` (read and written) and the kernel weights (read)."""
        return (
            self.sparse.bytes_read_per_step(state.sparse, num_heads)
            + 2 * tree_bytes((state.H, state.z))
            + tree_bytes(state.kernels)
        )

    def tokens_held(self, state: LessState):
        """Tokens in the sparse cache (the constant-size ``H, z`` state is counted in bytes, not tokens)."""
        return self.sparse.tokens_held(state.sparse)

    def min_budget(self) -> tuple[int, str]:
        return self.sparse.min_budget()

    def held(self, n: int, steps: int, ctx: LayerContext = LayerContext()) -> int:
        return self.sparse.held(n, steps, ctx)

    # -- the parallel (training) form of this config ------------------------------------------------------
    def eviction_times(self, q, k, mask: str = "decode"):
        """``[B, Hkv, S]`` int32: the row at which the sparse policy, run token by token from an empty cache,
        evicts each token (``S``: never); :func:`mask_from_evictions` makes the mask. ``budget`` must be a
        token count. mask (H2O only): ``"decode"``, kvjax's decode semantics (:func:`h2o_evictions`, decode =
        the parallel form) or ``"paper"``, the paper's parallel mask (:func:`h2o_paper_evictions`)."""
        if isinstance(self.budget, float):
            raise ValueError(f"budget={self.budget} is a fraction; the parallel form needs a token count (int)")
        if mask not in MASKS:
            raise ValueError(f"mask={mask!r} is not a parallel H2O mask; choose one of {MASKS}")
        b, hkv, s = k.shape[:3]
        if self.policy == "h2o":
            fn = h2o_evictions if mask == "decode" else h2o_paper_evictions
            return fn(q, k, self.budget, self.sparse._recent(self.budget))
        if self.budget <= self.sinks:
            raise ValueError(f"budget={self.budget} must exceed sinks={self.sinks} for the lambda policy")
        return jnp.broadcast_to(lambda_evictions(s, self.budget, self.sinks), (b, hkv, s))

    def parallel_mask(self, q, k, mask: str = "decode"):
        """``[B, Hkv, S, S]`` bool mask of the sparse policy for a sequence generated token by token from an
        empty cache (:meth:`eviction_times`)."""
        return mask_from_evictions(self.eviction_times(q, k, mask))
