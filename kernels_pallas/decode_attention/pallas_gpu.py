"""Pallas GPU (Triton backend) decode attention: flash-decoding split over the listed slot blocks.

Backend: in jax 0.10-0.11 a GPU ``pl.pallas_call`` lowers to Mosaic GPU by default
(``jax_pallas_use_mosaic_gpu=True``, and that path is deprecated for ``pallas_call``); passing
``compiler_params=jax.experimental.pallas.triton.CompilerParams(...)`` selects the Triton lowering, which is
what this kernel is written for (masked ``plgpu.load``, ``lax.dot_general`` on ``[16+, D]`` tiles).

Grid ``(B, Hkv, splits)``: program ``(b, h, j)`` walks entries ``[j*per, (j+1)*per)`` of the block list of
``(b, h)`` (``_common.plan_blocks``: sorted, only blocks that may hold a taking-part slot, ``count`` of them),
looping only over the ``n_here`` real entries (a dynamic ``fori_loop`` bound), so skipped blocks cost no memory
traffic. Per entry: a ``[bs, D]`` K tile loaded with a row mask (ragged ``S`` needs no padding copy), scores
``[Gp, bs]`` for the group's query heads (GQA: padded to ``Gp >= 16`` rows for ``tl.dot``, K/V read once per
group), the online-softmax update (FlashAttention-2 §3.1), ``p @ V``. Each program writes its partial
``(o, m, l)``; the ``splits`` partials are merged after the call (flash-decoding, Dao et al. 2023), exact
because they cover disjoint slot sets.

Triton needs power-of-two tile dims: ``block_size`` and ``D`` must be powers of two (checked).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas.checks import next_pow2
from kernels_pallas.decode_attention import _common, tuning
from kernels_pallas.decode_attention.reference import NEG_INF


def num_splits(b: int, hkv: int, n: int, target_programs: int | None = None) -> tuple[int, int]:
    """``(splits, per)``: entries per program ``per`` (a power of two) and programs per ``(b, h)``, so that the
    grid has about ``target_programs`` programs (default: ``tuning.TABLE["pallas_gpu"]``)."""
    target = target_programs or tuning.get("pallas_gpu").target_programs
    want = max(1, min(n, -(-target // (b * hkv))))
    per = next_pow2(-(-n // want))
    return -(-n // per), per


_NT = (((1,), (1,)), ((), ()))  # a @ b^T  (pl.dot is gone from jax 0.12; lax.dot_general works in 0.10-0.11)
_NN = (((1,), (0,)), ((), ()))  # a @ b


def _kernel(q_ref, k_ref, v_ref, *rest, bs: int, per: int, s_total: int, has_mask: bool):
    if has_mask:
        add_ref, idx_ref, nh_ref, len_ref, o_ref, m_ref, l_ref = rest
    else:
        add_ref = None
        idx_ref, nh_ref, len_ref, o_ref, m_ref, l_ref = rest
    q = q_ref[...]  # [Gp, D]
    gp, d = q.shape
    prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    idx_row = idx_ref[...]  # [per]
    length = jnp.minimum(len_ref[0], s_total)
    lanes = jnp.arange(per, dtype=jnp.int32)
    offs = jnp.arange(bs, dtype=jnp.int32)
    scale = np.float32(math.sqrt(d))

    def body(e, carry):
        o, m, l = carry
        blk = jnp.sum(jnp.where(lanes == e, idx_row, 0))  # scalar without a gather
        start = blk * bs
        slot = start + offs
        ok = slot < length  # [bs]
        k = pltriton.load(k_ref.at[pl.ds(start, bs), :], mask=ok[:, None], other=0.0)
        s = jax.lax.dot_general(q, k, _NT, precision=prec, preferred_element_type=jnp.float32) / scale  # [Gp, bs]
        if add_ref is not None:
            add = pltriton.load(add_ref.at[pl.ds(start, bs)], mask=ok, other=NEG_INF)
            s = s + add[None, :]
            ok = ok & (add > NEG_INF / 2)
        s = jnp.where(ok[None, :], s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(ok[None, :], jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        v = pltriton.load(v_ref.at[pl.ds(start, bs), :], mask=ok[:, None], other=0.0)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, _NN, precision=prec, preferred_element_type=jnp.float32)
        return alpha[:, None] * o + pv, m_new, alpha * l + jnp.sum(p, axis=1)

    init = (jnp.zeros((gp, d), jnp.float32), jnp.full((gp,), NEG_INF, jnp.float32), jnp.zeros((gp,), jnp.float32))
    o, m, l = jax.lax.fori_loop(0, nh_ref[0], body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(jax.jit, static_argnames=("block_size", "interpret", "num_warps", "num_stages", "target_programs"))
def decode_attention_gpu(
    q,
    k,
    v,
    valid=None,
    lengths=None,
    bias=None,
    block_indices=None,
    *,
    block_size: int = 128,
    interpret: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
    target_programs: int | None = None,
):
    """Partials ``(o [B,Hq,D], m [B,Hq], l [B,Hq])`` float32; contract of ``reference.decode_attention_reference``.
    ``num_warps``, ``num_stages``, ``target_programs``: None takes ``tuning.TABLE["pallas_gpu"]``'s."""
    row = tuning.get("pallas_gpu")
    num_warps, num_stages = num_warps or row.num_warps, num_stages or row.num_stages
    b, hq, d = q.shape
    _, hkv, s, _ = k.shape
    g = hq // hkv
    bs = block_size
    if bs != next_pow2(bs) or d != next_pow2(d) or d < 16:
        raise ValueError(
            f"pallas_gpu needs power-of-two tiles: block_size={bs} and head_dim={d} (>= 16); "
            "use impl='xla' or a power-of-two block_size"
        )
    idx, count = _common.plan_blocks(block_indices, lengths, b, hkv, s, bs)
    n = idx.shape[-1]
    splits, per = num_splits(b, hkv, n, target_programs)
    if splits * per > n:  # pad the list; padded entries lie past count and are never visited
        idx = jnp.concatenate([idx, jnp.zeros((b, hkv, splits * per - n), jnp.int32)], axis=-1)
    idx = idx.reshape(b, hkv, splits, per)
    n_here = jnp.clip(count[..., None] - per * jnp.arange(splits, dtype=jnp.int32), 0, per).reshape(-1)
    lens = _common.effective_lengths(lengths, b, s)
    add = _common.additive_mask(valid, bias)
    gp = max(16, next_pow2(g))
    q4 = jnp.pad(q.reshape(b, hkv, g, d), ((0, 0), (0, 0), (0, gp - g), (0, 0)))

    in_specs = [
        pl.BlockSpec((None, None, gp, d), lambda bi, hi, j: (bi, hi, 0, 0)),
        pl.BlockSpec((None, None, s, d), lambda bi, hi, j: (bi, hi, 0, 0)),
        pl.BlockSpec((None, None, s, d), lambda bi, hi, j: (bi, hi, 0, 0)),
    ]
    args = [q4, k, v]
    if add is not None:
        in_specs.append(pl.BlockSpec((None, None, s), lambda bi, hi, j: (bi, hi, 0)))
        args.append(add)
    in_specs += [
        pl.BlockSpec((None, None, None, per), lambda bi, hi, j: (bi, hi, j, 0)),
        pl.BlockSpec((1,), lambda bi, hi, j: ((bi * hkv + hi) * splits + j,)),
        pl.BlockSpec((1,), lambda bi, hi, j: (bi,)),
    ]
    args += [idx, n_here, lens]
    kernel = functools.partial(_kernel, bs=bs, per=per, s_total=s, has_mask=add is not None)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(b, hkv, splits),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, gp, d), lambda bi, hi, j: (bi, hi, j, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda bi, hi, j: (bi, hi, j, 0)),
            pl.BlockSpec((None, None, None, gp), lambda bi, hi, j: (bi, hi, j, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, splits, gp, d), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, splits, gp), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, splits, gp), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="decode_attention_gpu",
    )(*args)
    # merge the split partials (disjoint slot sets): exact, float32
    mm = jnp.max(m, axis=2)  # [B, Hkv, Gp]
    c = jnp.exp(m - mm[:, :, None, :])
    o = jnp.sum(o * c[..., None], axis=2)
    l = jnp.sum(l * c, axis=2)
    return (o[:, :, :g].reshape(b, hq, d), mm[:, :, :g].reshape(b, hq), l[:, :, :g].reshape(b, hq))
