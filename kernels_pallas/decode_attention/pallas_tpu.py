"""Pallas TPU decode attention: scalar-prefetched block lists, only the listed K/V blocks are DMA'd.

Grid ``(B, Hkv, N)``: step ``(b, h, i)`` visits the ``i``-th listed slot block of ``(b, h)``. The block list
``idx [B*Hkv*N]``, its length ``count [B*Hkv]`` and ``lengths [B]`` are scalar-prefetched into SMEM, and the
K/V ``BlockSpec`` index maps read ``idx`` to pick the block, the pattern of jax's ragged paged attention.
Entries past ``count`` repeat the last listed block (``_common.plan_blocks``), so the pipeline issues no new
DMA for them, and the kernel body skips them with ``pl.when``: the HBM traffic is the listed blocks only.

Per step: scores ``[G, bs]`` from one MXU matmul of the group's ``G`` query heads (GQA: KV read once per group,
never repeated) against the K block, online-softmax update of ``(o, m, l)`` (FlashAttention-2 §3.1) held in the
resident output blocks (their index maps ignore ``i``), float32 throughout. No in-kernel gathers.

Block shapes (checked by ``tiling.check_block_shape`` before the call, also in interpret mode): K/V
``(bs, D)`` of ``(S, D)``; the folded valid/bias mask is laid out ``[B, Hkv, 1, S]`` with block ``(1, bs)``, so
``bs`` must be a multiple of 128 or equal ``S``; q/o ``(G, D)`` and m/l ``(G, 1)`` are whole arrays.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.decode_attention import _common
from kernels_pallas.decode_attention.reference import NEG_INF
from kernels_pallas.decode_attention.tiling import check_block_shape


def _kernel(
    idx_ref, cnt_ref, len_ref, q_ref, k_ref, v_ref, *rest, hkv: int, n: int, s_total: int, bs: int, has_mask: bool
):
    if has_mask:
        add_ref, o_ref, m_ref, l_ref = rest
    else:
        add_ref = None
        o_ref, m_ref, l_ref = rest
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row = b * hkv + h

    @pl.when(i == 0)
    def _init():
        o_ref[...] = jnp.zeros(o_ref.shape, jnp.float32)
        m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)

    @pl.when(i < cnt_ref[row])
    def _visit():
        blk = idx_ref[row * n + i]
        q = q_ref[...]  # [G, D]
        k = k_ref[...]  # [bs, D]
        prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
        s = jax.lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32
        )  # [G, bs]
        s = s / np.float32(math.sqrt(q.shape[-1]))
        slot = blk * bs + jax.lax.broadcasted_iota(jnp.int32, (1, bs), 1)
        ok = slot < jnp.minimum(len_ref[b], s_total)
        if add_ref is not None:
            add = add_ref[...]  # [1, bs]
            s = s + add
            ok = ok & (add > NEG_INF / 2)
        s = jnp.where(ok, s, NEG_INF)
        m_prev = m_ref[...]  # [G, 1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.where(ok, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        v = v_ref[...]  # [bs, D]
        if s_total % bs:  # the edge block's rows past S are padding: keep NaN/inf out of p @ v
            col = blk * bs + jax.lax.broadcasted_iota(jnp.int32, (bs, 1), 0)
            v = jnp.where(col < s_total, v, jnp.zeros_like(v))
        pv = jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=prec, preferred_element_type=jnp.float32
        )  # [G, D]
        o_ref[...] = alpha * o_ref[...] + pv
        m_ref[...] = m_new


@functools.partial(jax.jit, static_argnames=("block_size", "interpret"))
def decode_attention_tpu(
    q, k, v, valid=None, lengths=None, bias=None, block_indices=None, *, block_size: int = 128, interpret: bool = False
):
    """Partials ``(o [B,Hq,D], m [B,Hq], l [B,Hq])`` float32; contract of ``reference.decode_attention_reference``."""
    b, hq, d = q.shape
    _, hkv, s, _ = k.shape
    g = hq // hkv
    bs = block_size
    idx, count = _common.plan_blocks(block_indices, lengths, b, hkv, s, bs)
    n = idx.shape[-1]
    lens = _common.effective_lengths(lengths, b, s)
    add = _common.additive_mask(valid, bias)
    q4 = q.reshape(b, hkv, g, d)

    def kv_map(bi, hi, ii, idx_ref, cnt_ref, len_ref):
        return bi, hi, idx_ref[(bi * hkv + hi) * n + ii], 0

    def add_map(bi, hi, ii, idx_ref, cnt_ref, len_ref):
        return bi, hi, 0, idx_ref[(bi * hkv + hi) * n + ii]

    def head_map(bi, hi, ii, *_):
        return bi, hi, 0, 0

    specs = [
        ("q", q4.shape, (None, None, g, d), head_map),
        ("k", k.shape, (None, None, bs, d), kv_map),
        ("v", v.shape, (None, None, bs, d), kv_map),
    ]
    args = [q4, k, v]
    if add is not None:
        add = add.reshape(b, hkv, 1, s)
        specs.append(("valid/bias", add.shape, (None, None, 1, bs), add_map))
        args.append(add)
    out_specs = [
        ("o", (b, hkv, g, d), (None, None, g, d), head_map),
        ("m", (b, hkv, g, 1), (None, None, g, 1), head_map),
        ("l", (b, hkv, g, 1), (None, None, g, 1), head_map),
    ]
    for name, shape, block, _ in specs + out_specs:
        check_block_shape(name, shape, block)

    kernel = functools.partial(_kernel, hkv=hkv, n=n, s_total=s, bs=bs, has_mask=add is not None)
    o, m, l = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(b, hkv, n),
            in_specs=[pl.BlockSpec(block, imap) for _, _, block, imap in specs],
            out_specs=[pl.BlockSpec(block, imap) for _, _, block, imap in out_specs],
        ),
        out_shape=[jax.ShapeDtypeStruct(shape, jnp.float32) for _, shape, _, _ in out_specs],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="decode_attention_tpu",
    )(idx.reshape(-1), count.reshape(-1), lens, *args)
    return o.reshape(b, hq, d), m.reshape(b, hq), l.reshape(b, hq)
