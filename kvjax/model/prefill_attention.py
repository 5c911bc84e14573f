"""Prefill attention: causal self-attention over a whole (right-padded) prompt, GQA-native, memory linear in T.

>>> out = prefill_attention(q, k, v, lengths, sliding_window=None)          # impl chosen by backend
>>> out = prefill_attention(q, k, v, lengths, impl="chunked")              # the pure-JAX reference

q ``[B, Hq, T, D]``; k, v ``[B, Hkv, T, D]`` (``Hq`` a multiple of ``Hkv``; KV never repeated); lengths ``[B]``
int: the valid prompt length of each right-padded sequence (None: all ``T``); sliding_window ``w`` (None: none).
Query ``t`` sees keys ``s`` with ``s <= t``, ``s < lengths[b]`` and, with a window, ``t - s < w`` (keys
``t-w+1 .. t``). Scale ``1/sqrt(D)``, softmax in float32. Returns ``[B, Hq, T, D]`` in ``q.dtype``; rows of
padded queries (``t >= lengths[b]``) are meaningless but finite.

Implementations (``IMPLS``), all flash-style (FlashAttention, Dao et al. 2022: tiles of keys folded into a running
max and sum, so the ``[T, T]`` score matrix is never held):

- ``"chunked"``: pure JAX, the reference and the CPU path. Dense for ``T <= chunk`` (256); above that, query
  chunks of ``chunk`` with an online softmax over the key chunks up to the diagonal (and from the window's start):
  ``O(T * chunk)`` memory, the masked upper triangle never computed, only the diagonal block masked, and only the
  query chunks that hold a real token of some sequence computed (bucket padding past the longest prompt is free).
  256 is the fastest chunk measured on the CPU (a ``[Hq, 256, 256]`` float32 score tile stays in cache; 512 costs
  about 10% more CPU time, 1024 about 20%).
- ``"cudnn"`` (GPU): ``jax.nn.dot_product_attention(implementation="cudnn")``, cuDNN's fused flash attention, in
  its ``[B, T, N, H]`` layout with ``is_causal=True``, ``key_value_seq_lengths=lengths`` (queries are not
  length-masked, so padded rows attend real keys and stay finite) and ``local_window_size=(w - 1, 0)`` (jax's
  ``(left, right)``: keys ``t-w+1 .. t``). GQA is native. Eligible (``cudnn_eligible``): q, k, v all float16 or
  all bfloat16 and ``D`` a multiple of 8, at most 128 (256 on Hopper and later). ``_cudnn_call`` holds the
  argument transformation; the tests run it with ``implementation="xla"`` on CPU against the reference (layout,
  lengths, window, GQA). The cuDNN kernel itself can only be run, and even exported, where cuDNN is installed
  (``jax.export`` from a CPU jaxlib fails with "cuDNN is not detected."), so it is checked on a GPU only
  (tests/accelerator/test_prefill.py).
- ``"splash"`` (TPU): jax's Pallas splash-attention kernel (``jax.experimental.pallas.ops.tpu.splash_attention``;
  "splash": sparse flash attention, skipping the key blocks a static mask rules out). One multi-head kernel with
  ``Hq`` query heads over ``Hkv`` KV heads (it maps query head ``h`` to KV head ``h // (Hq/Hkv)``: GQA without
  repeated KV), vmapped over the batch; ``CausalMask`` or, with a window, ``LocalMask(window_size=(w-1, 0))``;
  the lengths as segment ids (1 inside the prompt, 0 in its padding: a padded query sees only padding at or
  before it, itself included, so no row is empty); ``T`` padded up to the block size (``SPLASH_BLOCK``, or
  ``round_up(T, 128)`` when smaller). ``q`` is scaled by ``1/sqrt(D)`` (in float32) before the kernel, which has
  no scale argument. ``interpret=True`` runs it in Pallas interpret mode (CPU tests).

Under the engine's mesh (``kvjax.sharding.tracing``) the two kernels run per device on its shard of sequences and
heads (``kvjax.sharding.per_head``: XLA's partitioner would otherwise gather the whole q, k, v for an opaque
kernel); ``chunked`` is plain XLA and partitioned as such.

``impl=None``: ``$KVJAX_PREFILL_ATTENTION_IMPL`` if set (an explicit choice: ``cudnn`` with ineligible inputs is
then an error), else by backend, once that kernel has been verified there (``kernels_pallas/verified.py``;
until then ``chunked`` and a warning): ``gpu`` -> ``cudnn`` when ``cudnn_eligible`` (float32 inputs or an unsupported
head dim fall back to ``chunked``), ``tpu`` -> ``splash``, anything else -> ``chunked``. An explicit
``impl="cudnn"`` with ineligible inputs raises a ValueError; a kernel's own failure is raised, never replaced by
the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.impl_choice import choose, env_impl
from kvjax.model.attention import NEG_INF  # -1e30: finite, so fully masked rows give 0 weights instead of NaN
from kvjax.sharding import per_head

IMPLS = ("chunked", "cudnn", "splash")
ENV_IMPL = "KVJAX_PREFILL_ATTENTION_IMPL"

#: Prompts longer than this are attended by ``chunked`` in query chunks of this size.
ATTENTION_CHUNK = 256
#: splash's query and key block (tokens); T is padded up to a multiple of it.
SPLASH_BLOCK = 512


def default_impl() -> str:
    """``$KVJAX_PREFILL_ATTENTION_IMPL`` if set, else by backend where verified on the hardware
    (:mod:`kernels_pallas.impl_choice`): gpu -> cudnn, tpu -> splash, else chunked (``prefill_attention`` then
    drops ``cudnn`` for ``chunked`` when the inputs are not ``cudnn_eligible``)."""
    return choose("prefill_attention", IMPLS, "chunked")


def _cudnn_max_head_dim() -> int:
    """cuDNN's flash-attention head-dim limit on this machine: 256 on Hopper (sm_90) and later, else 128."""
    if jax.default_backend() != "gpu":
        return 128
    try:
        cc = tuple(int(x) for x in jax.devices()[0].compute_capability.split("."))
    except (AttributeError, ValueError):
        return 128
    return 256 if cc >= (9, 0) else 128


def cudnn_ineligible(q, k, v) -> str | None:
    """Why cuDNN's fused attention cannot take these inputs (None: it can)."""
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1 or dtypes.pop() not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        return (
            f"q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}; cuDNN needs all float16 or all bfloat16 "
            "(cast them, or use impl='chunked')"
        )
    d, limit = q.shape[-1], _cudnn_max_head_dim()
    if d % 8 or d > limit:
        return f"head_dim {d} must be a multiple of 8 and at most {limit} for cuDNN (use impl='chunked')"
    return None


def cudnn_eligible(q, k, v) -> bool:
    """Whether ``impl=None`` on a GPU takes cuDNN for these inputs (``cudnn_ineligible`` says why not)."""
    return cudnn_ineligible(q, k, v) is None


def check_inputs(q, k, v, lengths, sliding_window) -> None:
    """ValueError naming the argument for inconsistent shapes or a bad window."""
    if q.ndim != 4:
        raise ValueError(f"q has shape {q.shape}; expected [B, Hq, T, D]")
    if k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} must both have shape [B, Hkv, T, D]")
    b, hkv, t, d = k.shape
    if (q.shape[0], q.shape[2], q.shape[3]) != (b, t, d):
        raise ValueError(f"q has shape {q.shape}; expected [B={b}, Hq, T={t}, D={d}] to match k {k.shape}")
    if q.shape[1] % hkv:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the {hkv} KV heads of k (GQA)")
    if lengths is not None and tuple(np.shape(lengths)) != (b,):
        raise ValueError(f"lengths has shape {tuple(np.shape(lengths))}; expected [B] = ({b},)")
    if sliding_window is not None and (not isinstance(sliding_window, (int, np.integer)) or sliding_window < 1):
        raise ValueError(f"sliding_window={sliding_window!r} must be a positive integer or None")


def prefill_attention(
    q,
    k,
    v,
    lengths=None,
    sliding_window: int | None = None,
    *,
    impl: str | None = None,
    chunk: int = ATTENTION_CHUNK,
    block_size: int = SPLASH_BLOCK,
    interpret: bool = False,
    sinks=None,
):
    """Causal GQA attention over a right-padded prompt: ``[B, Hq, T, D]`` in ``q.dtype`` (module docstring).

    chunk: ``chunked``'s query/key chunk; block_size: ``splash``'s block (a multiple of 128); interpret: run
    ``splash`` in Pallas interpret mode. sinks: ``[Hq]`` sink logits (gpt-oss, :mod:`kvjax.model.sinks`) that join
    every row's softmax denominator, or None; attention with sinks runs the pure-JAX ``chunked`` path (cuDNN's and
    splash's kernels take no sink term: naming one of them with sinks is a ValueError).
    """
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {IMPLS} or None (chosen by backend)")
    check_inputs(q, k, v, lengths, sliding_window)
    source = "impl='cudnn'" if impl is not None else f"{ENV_IMPL}=cudnn"
    explicit = impl or env_impl(ENV_IMPL, IMPLS)
    if sinks is not None:
        if explicit not in (None, "chunked"):
            raise ValueError(
                f"prefill attention impl={explicit!r} takes no attention sinks; use impl='chunked' (or None) for a "
                "model with sinks (gpt-oss)"
            )
        explicit = "chunked"
    impl = explicit or default_impl()
    if impl == "cudnn":
        why = cudnn_ineligible(q, k, v)
        if why is not None:
            if explicit:
                raise ValueError(f"{source}: {why}")
            impl = "chunked"
    if impl in ("cudnn", "splash"):  # a fused kernel: run per device shard under the engine's mesh
        n = jnp.full((q.shape[0],), q.shape[2], jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
        if impl == "cudnn":
            kernel = functools.partial(cudnn_attention, sliding_window=sliding_window)
        else:
            kernel = functools.partial(
                splash_attention, sliding_window=sliding_window, block_size=block_size, interpret=interpret
            )
        return per_head(kernel, q, k, v, n, batch_only=(3,))
    if q.shape[2] <= chunk:
        return dense_attention(q, k, v, lengths, sliding_window, sinks)
    return chunked_attention(q, k, v, lengths, sliding_window, chunk, sinks)


# ----------------------------------------------------------------------------------------- chunked (reference)
# Einsum axes: b batch, h KV head, g query head within its group, t query position, s key position, d head dim.


def _causal_mask(qpos, kpos, lengths, sliding_window):
    """``[B, Tq, Tk]`` bool: causal, inside the window, and keys inside each sequence's length."""
    mask = kpos[None, :] <= qpos[:, None]
    if sliding_window is not None:
        mask &= qpos[:, None] - kpos[None, :] < sliding_window
    return mask[None] & (kpos[None, None, :] < lengths[:, None, None])


def dense_attention(q, k, v, lengths=None, sliding_window=None, sinks=None):
    """The whole ``[T, T]`` score matrix at once (``chunked`` below ``chunk`` tokens); ``sinks [Hq]``: an extra
    logit per query head in every row's softmax (its value zero)."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    lengths = jnp.full((b,), t) if lengths is None else lengths
    qg = q.reshape(b, hkv, hq // hkv, t, d)
    scores = jnp.einsum("bhgtd,bhsd->bhgts", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(d))
    pos = jnp.arange(t)
    mask = _causal_mask(pos, pos, lengths, sliding_window)
    scores = jnp.where(mask[:, None, None], scores, NEG_INF)
    if sinks is None:
        w = jax.nn.softmax(scores, axis=-1)
    else:
        sk = sinks.astype(jnp.float32).reshape(1, hkv, hq // hkv, 1, 1)
        top = jnp.maximum(scores.max(axis=-1, keepdims=True), sk)
        e = jnp.exp(scores - top)
        w = e / (e.sum(axis=-1, keepdims=True) + jnp.exp(sk - top))
    out = jnp.einsum("bhgts,bhsd->bhgtd", w.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, hq, t, d).astype(q.dtype)


def live_chunks(lengths, t: int, chunk: int):
    """How many ``chunk``-token blocks of a ``t``-token bucket hold a real token of some sequence (traced int32
    scalar; ``ceil(t / chunk)`` when ``lengths`` is None)."""
    n = -(-t // chunk)
    if lengths is None:
        return jnp.int32(n)
    longest = jnp.max(jnp.asarray(lengths, jnp.int32))
    return jnp.clip((longest + chunk - 1) // chunk, 0, n).astype(jnp.int32)


def chunked_attention(q, k, v, lengths=None, sliding_window=None, chunk: int = ATTENTION_CHUNK, sinks=None):
    """Flash-style causal attention in ``chunk``-token blocks; memory ``O(B * Hq * chunk * (chunk + D))`` beyond
    the output, which takes the place of q.

    Query block ``i`` (a ``fori_loop`` over the blocks that hold a real token of some sequence, ``live_chunks``:
    bucket padding past the longest prompt costs nothing) starts its running max and sum on its diagonal key block
    (the only block with a causal mask; every row sees at least itself there), then folds in the key blocks
    ``[lo, i)`` unmasked (``lo``: the window's first block; with a window those blocks are masked to it).
    Keys past a sequence's length are not masked: by causality only that sequence's padded queries see them.
    The output is written block by block over a copy of q, so no separate ``[B, Hq, T, D]`` buffer lives beside
    it; rows of query blocks past the longest prompt keep q's values (meaningless, finite). ``sinks [Hq]``: a
    sink logit per query head joins each row's denominator at the end (:mod:`kvjax.model.sinks`)."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    n = -(-t // chunk)
    live = live_chunks(lengths, t, chunk)
    pad = ((0, 0), (0, 0), (0, n * chunk - t), (0, 0))
    qc = jnp.pad(q, pad).reshape(b, hkv, g, n, chunk, d)
    kc = jnp.pad(k, pad).reshape(b, hkv, n, chunk, d)
    vc = jnp.pad(v, pad).reshape(b, hkv, n, chunk, d)
    scale = 1.0 / np.sqrt(d)  # applied inside exp: (s - max) * scale, scores stay unscaled
    offs = np.arange(chunk)
    diagonal = offs[:, None] >= offs[None, :]  # [C, C] causal inside a block
    if sliding_window is not None:
        diagonal &= offs[:, None] - offs[None, :] < sliding_window

    def scores(qi, j):  # [B, Hkv, G, C, D] x key block j -> [B, Hkv, G, C, C] float32 (unscaled), v block j
        kj = jax.lax.dynamic_index_in_dim(kc, j, axis=2, keepdims=False)  # [B, Hkv, C, D]
        vj = jax.lax.dynamic_index_in_dim(vc, j, axis=2, keepdims=False)
        return jnp.einsum("bhgtd,bhsd->bhgts", qi, kj, preferred_element_type=jnp.float32), vj

    def pv(p, vj):
        return jnp.einsum("bhgts,bhsd->bhgtd", p.astype(v.dtype), vj, preferred_element_type=jnp.float32)

    def query_block(i, out):
        qi = jax.lax.dynamic_index_in_dim(out, i, axis=3, keepdims=False)  # still q: block i is written last
        s, vi = scores(qi, i)
        s = jnp.where(diagonal, s, NEG_INF)
        m = s.max(axis=-1)
        p = jnp.exp((s - m[..., None]) * scale)
        o, l = pv(p, vi), p.sum(axis=-1)

        def key_block(j, carry):
            o, m, l = carry
            s, vj = scores(qi, j)
            if sliding_window is not None:  # keys t-w+1 .. t
                inside = (i - j) * chunk + offs[:, None] - offs[None, :] < sliding_window
                s = jnp.where(inside, s, NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.exp((s - m_new[..., None]) * scale)
            c = jnp.exp((m - m_new) * scale)
            return o * c[..., None] + pv(p, vj), m_new, l * c + p.sum(axis=-1)

        lo = 0 if sliding_window is None else jnp.maximum(0, (i * chunk - sliding_window + 1) // chunk)
        o, m, l = jax.lax.fori_loop(lo, i, key_block, (o, m, l))
        if sinks is None:
            o = o / l[..., None]
        else:  # scores are unscaled here: the running max in the softmax's units is m * scale
            sk = sinks.astype(jnp.float32).reshape(1, hkv, g, 1)
            top = jnp.maximum(m * scale, sk)
            c = jnp.exp(m * scale - top)
            o = o * (c / (l * c + jnp.exp(sk - top)))[..., None]
        return jax.lax.dynamic_update_index_in_dim(out, o.astype(out.dtype), i, axis=3)

    out = jax.lax.fori_loop(0, live, query_block, qc)  # [B, Hkv, G, n, C, D]
    return out.reshape(b, hq, n * chunk, d)[:, :, :t]


# ----------------------------------------------------------------------------------------------------- cuDNN


def _cudnn_call(q, k, v, lengths, sliding_window, implementation: str):
    """``jax.nn.dot_product_attention`` with kvjax's arguments mapped onto it. q ``[B, Hq, T, D]``, k, v
    ``[B, Hkv, T, D]`` -> ``[B, Hq, T, D]``. ``implementation="cudnn"`` on a GPU; ``"xla"`` runs the very same
    mapping anywhere (the CPU tests)."""
    b, _, t, _ = q.shape
    to_btnh = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731  [B, N, T, H] <-> [B, T, N, H]
    # a zero-length sequence has no real query; attending its first (padding) key keeps the rows finite
    kv_len = None if lengths is None else jnp.maximum(jnp.asarray(lengths, jnp.int32), 1)
    window = None if sliding_window is None else (int(sliding_window) - 1, 0)  # (left, right): keys t-w+1 .. t
    out = jax.nn.dot_product_attention(
        to_btnh(q),
        to_btnh(k),
        to_btnh(v),
        is_causal=True,
        key_value_seq_lengths=kv_len,
        local_window_size=window,
        implementation=implementation,
    )
    return to_btnh(out).astype(q.dtype)


def cudnn_attention(q, k, v, lengths=None, sliding_window=None):
    """cuDNN's fused flash attention (GPU only; ``cudnn_eligible`` inputs, else a ValueError naming the fix)."""
    why = cudnn_ineligible(q, k, v)
    if why is not None:
        raise ValueError(f"impl='cudnn': {why}")
    return _cudnn_call(q, k, v, lengths, sliding_window, "cudnn")


# ---------------------------------------------------------------------------------------------------- splash


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@functools.lru_cache(maxsize=32)
def _splash_kernel(heads: int, t: int, block: int, sliding_window: int | None, interpret: bool):
    """A multi-head splash kernel for ``heads`` query heads over ``t`` (padded) tokens in ``block`` tiles. Cached:
    building it processes the mask block by block in numpy (seconds at 64k tokens)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    shape = (t, t)
    if sliding_window is None:
        mask = sa.CausalMask(shape)
    else:
        mask = sa.LocalMask(shape, window_size=(sliding_window - 1, 0), offset=0)
    sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block)
    with jax.ensure_compile_time_eval():  # concrete mask-info arrays even when first built inside a jit trace
        return sa.make_splash_mha(
            sa.MultiHeadMask([mask] * heads), block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
        )


def splash_attention(
    q, k, v, lengths=None, sliding_window=None, *, block_size: int = SPLASH_BLOCK, interpret: bool = False
):
    """jax's Pallas splash-attention kernel (TPU; ``interpret=True`` anywhere). Shapes as ``prefill_attention``."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    if block_size % 128:
        raise ValueError(f"block_size={block_size} must be a multiple of 128 (TPU lanes) for splash")
    b, hq, t, d = q.shape
    block = min(block_size, _round_up(t, 128))
    tp = _round_up(t, block)
    pad = ((0, 0), (0, 0), (0, tp - t), (0, 0))
    qs = (q.astype(jnp.float32) / np.sqrt(d)).astype(q.dtype)  # the kernel has no scale argument
    qs, kp, vp = (jnp.pad(x, pad) for x in (qs, k, v))
    lengths = jnp.full((b,), t, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    seg = (jnp.arange(tp)[None, :] < lengths[:, None]).astype(jnp.int32)  # [B, Tp]: 1 prompt, 0 padding
    kernel = _splash_kernel(hq, tp, block, None if sliding_window is None else int(sliding_window), interpret)
    out = jax.vmap(lambda q1, k1, v1, s1: kernel(q1, k1, v1, segment_ids=SegmentIds(s1, s1)))(qs, kp, vp, seg)
    return out[:, :, :t].astype(q.dtype)


__all__ = [
    "ATTENTION_CHUNK",
    "ENV_IMPL",
    "IMPLS",
    "SPLASH_BLOCK",
    "check_inputs",
    "chunked_attention",
    "cudnn_attention",
    "cudnn_eligible",
    "cudnn_ineligible",
    "default_impl",
    "dense_attention",
    "live_chunks",
    "prefill_attention",
    "splash_attention",
]
