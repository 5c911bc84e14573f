"""Pallas GPU (Triton lowering) prompt pass: the causal attention and H2O's accumulated scores in two kernels.

Backend: ``compiler_params=jax.experimental.pallas.triton.CompilerParams(...)`` selects the Triton lowering (as
``decode_attention``'s GPU kernel; jax 0.10-0.11 would otherwise take Mosaic GPU).

1. ``prompt_forward_gpu``, grid ``(B, Hq, Tp / bq)`` (FlashAttention-2, Dao 2023, Alg. 1): a ``[bq, D]`` query
   block against its KV head's keys (GQA: KV head ``= query head // G``, never repeated), key blocks of ``bk`` up
   to the block's diagonal and its sequence's length only: first the blocks every row sees whole (no mask), then
   the ones crossing the diagonal (causal mask); online max and sum, ``P v`` accumulated in float32. Writes the
   output (rows of padded queries 0) and each row's log-sum-exp ``lse = m + log l``.
2. ``prompt_columns_gpu``, grid ``(B, Hkv, Tp / bk)``: a ``[bk, D]`` key block; for the query blocks from the one
   holding its first key's diagonal to its sequence's length, and for each of the group's ``G`` query heads,
   ``exp(q·k scale - lse)`` (the softmax weights, recomputed: one more ``q·k`` per causal score) summed over the
   rows into the block's column scores (causal and padded rows masked only in the blocks that need it), divided by
   ``G``. No atomics: each program owns its key block.

The sequence is padded to ``Tp``, a multiple of both blocks, and the padding zeroed (NaN or inf there is never
read). Triton needs power-of-two tiles: ``bq``, ``bk`` and ``D >= 16`` (checked). float32 inputs use ``HIGHEST``
dots (no TF32); bf16 inputs round ``p`` to bf16 before ``P v``, as the XLA paths do.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas.checks import is_pow2
from kernels_pallas.accumulated_attention.reference import NEG_INF

_NT = (((1,), (1,)), ((), ()))  # a @ b^T
_NN = (((1,), (0,)), ((), ()))  # a @ b
#: (block_q, block_k, num_warps, num_stages) by input dtype: bf16 tiles as FlashAttention-2's Triton kernel;
#: float32 tiles halved (shared memory).
DEFAULTS = {"bfloat16": (128, 64, 8, 2), "float16": (128, 64, 8, 2), "float32": (64, 32, 4, 1)}
#: Shared memory the column kernel's tiles may take (the H200 gives a block 227 KiB; Triton adds its own): its query
#: block is halved until the ``G`` query heads' ``[bq, D]`` tiles (one per pipeline stage) and the key block fit.
#: At Llama-3.1-8B's heads (G = 4, D = 128) in bf16 the forward's 128-row block asked 273 KiB on the H200
#: (2026-11-27: "Shared memory size limit exceeded: requested 279552, available: 232448"); it takes 64 rows.
COLUMNS_SMEM = 160 << 10


def columns_block_q(bq: int, bk: int, g: int, d: int, itemsize: int, stages: int) -> int:
    """The column kernel's query block: ``bq`` halved (not below 16) while ``g`` heads' ``[bq, d]`` tiles per
    pipeline stage plus the ``[bk, d]`` key block exceed :data:`COLUMNS_SMEM`."""
    while bq > 16 and (g * bq * max(stages, 1) + bk) * d * itemsize > COLUMNS_SMEM:
        bq //= 2
    return bq


def _prec(dtype):
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _forward_kernel(q_ref, k_ref, *rest, bq: int, bk: int, scale: float, has_v: bool):
    if has_v:
        v_ref, len_ref, o_ref, lse_ref = rest
    else:
        len_ref, lse_ref = rest
    q0 = pl.program_id(2) * bq
    n = len_ref[0]
    q = q_ref[...]  # [bq, D]
    prec = _prec(q.dtype)
    rows = q0 + jnp.arange(bq, dtype=jnp.int32)
    offs = jnp.arange(bk, dtype=jnp.int32)
    nk = jnp.where(q0 < n, (jnp.minimum(q0 + bq, n) + bk - 1) // bk, 0)  # key blocks up to the diagonal / length
    whole = jnp.minimum((q0 + 1) // bk, nk)  # blocks every row of this block sees whole

    def body(j, carry, masked: bool):
        o, m, l = carry
        start = j * bk
        k = k_ref[pl.ds(start, bk), :]
        s = jax.lax.dot_general(q, k, _NT, precision=prec, preferred_element_type=jnp.float32) * scale  # [bq, bk]
        if masked:
            ok = (start + offs)[None, :] <= rows[:, None]
            s = jnp.where(ok, s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        if masked:
            p = jnp.where(ok, p, 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=1)
        if has_v:
            v = v_ref[pl.ds(start, bk), :]
            pv = jax.lax.dot_general(p.astype(v.dtype), v, _NN, precision=prec, preferred_element_type=jnp.float32)
            o = alpha[:, None] * o + pv
        return o, m_new, l

    d = q.shape[1]
    init = (
        jnp.zeros((bq, d), jnp.float32) if has_v else jnp.zeros((), jnp.float32),
        jnp.full((bq,), NEG_INF, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
    )
    carry = jax.lax.fori_loop(0, whole, functools.partial(body, masked=False), init)
    o, m, l = jax.lax.fori_loop(whole, nk, functools.partial(body, masked=True), carry)
    seen = l > 0
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
    if has_v:
        real = (rows < n) & seen
        o_ref[...] = jnp.where(real[:, None], o / jnp.where(real, l, 1.0)[:, None], 0.0).astype(o_ref.dtype)


def _columns_kernel(q_ref, lse_ref, k_ref, len_ref, acc_ref, *, g: int, bq: int, bk: int, scale: float):
    k0 = pl.program_id(2) * bk
    n = len_ref[0]
    k = k_ref[...]  # [bk, D]
    prec = _prec(k.dtype)
    kpos = k0 + jnp.arange(bk, dtype=jnp.int32)
    offs = jnp.arange(bq, dtype=jnp.int32)
    nq = jnp.where(k0 < n, (n + bq - 1) // bq, 0)  # query blocks holding a real row
    first = jnp.minimum(k0 // bq, nq)  # the block holding the first key's diagonal
    causal_whole = jnp.clip((k0 + bk - 1 + bq - 1) // bq, first, nq)  # first block whose rows see every key
    length_whole = jnp.maximum(n // bq, causal_whole)  # blocks past it hold padded rows

    def body(i, col, masked: bool):
        start = i * bq
        rows = start + offs
        if masked:
            ok = (kpos[None, :] <= rows[:, None]) & (rows < n)[:, None]
        for gi in range(g):  # the group's query heads, K read once
            q = q_ref[gi, pl.ds(start, bq), :]  # [bq, D]
            lse = lse_ref[gi, pl.ds(start, bq)]  # [bq]
            s = jax.lax.dot_general(q, k, _NT, precision=prec, preferred_element_type=jnp.float32) * scale
            p = jnp.exp(s - lse[:, None])
            if masked:
                p = jnp.where(ok, p, 0.0)
            col = col + jnp.sum(p, axis=0)
        return col

    col = jnp.zeros((bk,), jnp.float32)
    col = jax.lax.fori_loop(first, causal_whole, functools.partial(body, masked=True), col)
    col = jax.lax.fori_loop(causal_whole, jnp.minimum(length_whole, nq), functools.partial(body, masked=False), col)
    col = jax.lax.fori_loop(jnp.minimum(length_whole, nq), nq, functools.partial(body, masked=True), col)
    acc_ref[...] = col / g


def _params(interpret: bool, num_warps: int, num_stages: int) -> dict:
    return {} if interpret else {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)}


@functools.partial(
    jax.jit, static_argnames=("interpret", "block_q", "block_k", "num_warps", "num_stages", "has_v", "t_real")
)
def _call(q, k, v, lengths, *, interpret, block_q, block_k, num_warps, num_stages, has_v, t_real):
    b, hq, tp, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d)
    lens = lengths.astype(jnp.int32)
    fwd_in = [
        pl.BlockSpec((None, None, block_q, d), lambda bi, hi, i: (bi, hi, i, 0)),
        pl.BlockSpec((None, None, tp, d), lambda bi, hi, i: (bi, hi // g, 0, 0)),
    ]
    args = [q, k]
    if has_v:
        fwd_in.append(pl.BlockSpec((None, None, tp, d), lambda bi, hi, i: (bi, hi // g, 0, 0)))
        args.append(v)
    fwd_in.append(pl.BlockSpec((1,), lambda bi, hi, i: (bi,)))
    lse_spec = pl.BlockSpec((None, None, block_q), lambda bi, hi, i: (bi, hi, i))
    lse_shape = jax.ShapeDtypeStruct((b, hq, tp), jnp.float32)
    if has_v:
        out_specs = [pl.BlockSpec((None, None, block_q, d), lambda bi, hi, i: (bi, hi, i, 0)), lse_spec]
        out_shape = [jax.ShapeDtypeStruct((b, hq, tp, d), q.dtype), lse_shape]
    else:
        out_specs, out_shape = [lse_spec], [lse_shape]
    res = pl.pallas_call(
        functools.partial(_forward_kernel, bq=block_q, bk=block_k, scale=scale, has_v=has_v),
        grid=(b, hq, tp // block_q),
        in_specs=fwd_in,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        name="prompt_forward_gpu",
        **_params(interpret, num_warps, num_stages),
    )(*args, lens)
    out, lse = (res[0], res[1]) if has_v else (None, res[0])
    cbq = columns_block_q(block_q, block_k, g, d, jnp.dtype(q.dtype).itemsize, num_stages)
    acc = pl.pallas_call(
        functools.partial(_columns_kernel, g=g, bq=cbq, bk=block_k, scale=scale),
        grid=(b, hkv, tp // block_k),
        in_specs=[
            pl.BlockSpec((None, g, tp, d), lambda bi, hi, j: (bi, hi, 0, 0)),
            pl.BlockSpec((None, g, tp), lambda bi, hi, j: (bi, hi, 0)),
            pl.BlockSpec((None, None, block_k, d), lambda bi, hi, j: (bi, hi, j, 0)),
            pl.BlockSpec((1,), lambda bi, hi, j: (bi,)),
        ],
        out_specs=pl.BlockSpec((None, None, block_k), lambda bi, hi, j: (bi, hi, j)),
        out_shape=jax.ShapeDtypeStruct((b, hkv, tp), jnp.float32),
        interpret=interpret,
        name="prompt_columns_gpu",
        **_params(interpret, num_warps, num_stages),
    )(q, lse, k, lens)
    acc = acc[:, :, :t_real]
    return (None if out is None else out[:, :, :t_real]), acc


def accumulated_attention_gpu(
    q,
    k,
    v,
    lengths,
    *,
    interpret: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
):
    """``(out or None, scores)``: the contract of ``reference.accumulated_attention_reference``. Block sizes and
    Triton's knobs default by dtype (:data:`DEFAULTS`)."""
    b, hq, t, d = q.shape
    dq, dk, dw, ds = DEFAULTS.get(jnp.dtype(q.dtype).name, DEFAULTS["float32"])
    bq, bk = block_q or dq, block_k or dk
    if not (is_pow2(bq) and is_pow2(bk) and is_pow2(d) and bq >= 16 and bk >= 16 and d >= 16):
        raise ValueError(
            f"pallas_gpu needs power-of-two tiles of at least 16: block_q={bq}, block_k={bk}, head_dim={d}; "
            "use impl='xla' or power-of-two blocks"
        )
    tp = -(-max(t, 1) // max(bq, bk)) * max(bq, bk)
    lengths = jnp.minimum(jnp.asarray(lengths, jnp.int32), t)
    real = (jnp.arange(t)[None, :] < lengths[:, None])[:, None, :, None]
    pad = lambda x: jnp.pad(jnp.where(real, x, 0), ((0, 0), (0, 0), (0, tp - t), (0, 0)))  # noqa: E731
    return _call(
        pad(q),
        pad(k),
        None if v is None else pad(v),
        lengths,
        interpret=interpret,
        block_q=bq,
        block_k=bk,
        num_warps=num_warps or dw,
        num_stages=num_stages or ds,
        has_v=v is not None,
        t_real=t,
    )
