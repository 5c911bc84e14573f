"""``decode_attention``: one query per head over a buffer of slots, returning mergeable partials.

>>> o, m, l = decode_attention(q, k, v, valid)                     # impl chosen by backend
>>> out = normalise(merge((o, m, l), other_partial))               # exact combination, then softmax
>>> part = decode_attention(q, k, v, lengths=n, block_indices=sel, block_size=128)  # only listed blocks read

q ``[B, Hq, D]``; k, v ``[B, Hkv, S, D]`` (GQA: ``Hq`` a multiple of ``Hkv``, KV never repeated); valid
``[B, Hkv, S]`` bool; lengths ``[B]`` int (slots ``[0, lengths[b])``); bias ``[B, Hkv, S]`` float added to the
scaled scores (Chelsea's ``log N``); block_indices ``[B, Hkv, N]`` or ``[B, N]`` int: the slot blocks
``[i*block_size, (i+1)*block_size)`` to visit (``-1`` pads; repeats count once; without it, all blocks).
Returns ``(o_unnormalised [B, Hq, D], m [B, Hq], l [B, Hq])`` float32 (``reference`` has the exact contract;
a row with no taking-part slot gives ``o = 0, l = 0, m = NEG_INF``). bf16 or fp32 inputs, fp32 accumulation.

impl: ``"xla"`` (pure JAX that reads only the live chunks or the listed blocks, :mod:`.xla`; the masked
``reference`` is the spec), ``"pallas_tpu"`` (scalar-prefetched block lists), ``"pallas_gpu"``
(Triton, flash-decoding split), or None: the ``KVJAX_DECODE_ATTENTION_IMPL`` environment variable if set, else
``pallas_tpu`` on TPU, ``pallas_gpu`` on GPU, ``xla`` on CPU. A Pallas failure is raised, never replaced by the
reference silently. ``interpret=True`` runs a Pallas kernel in interpret mode (CPU tests).

block_size: slots per block; default 128 with ``block_indices`` (what the listed indices mean), else the tuning
table's (``tuning.TABLE``; only the tile size then, which slots take part does not depend on it). When ``S`` is smaller, the Pallas kernels use one block covering
every slot (the listed-block semantics do not change: every slot is in block 0). pallas_tpu needs it a multiple
of 128 (or ``>= S``) when a valid mask or bias is given, else a multiple of 8 (``tiling.check_block_shape``);
pallas_gpu a power of two.
"""

from __future__ import annotations

import jax
import numpy as np

from kernels_pallas.decode_attention.reference import (NEG_INF, decode_attention_reference, merge, normalise,
                                                       slot_mask)
from kernels_pallas.decode_attention import tuning
from kernels_pallas.decode_attention.tiling import check_block_shape
from kernels_pallas.impl_choice import env_impl

IMPLS = ("xla", "pallas_tpu", "pallas_gpu")
ENV_IMPL = "KVJAX_DECODE_ATTENTION_IMPL"


def default_impl() -> str:
    """``$KVJAX_DECODE_ATTENTION_IMPL`` if set, else by backend: tpu -> pallas_tpu, gpu -> pallas_gpu, else xla."""
    return env_impl(ENV_IMPL, IMPLS) or {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(jax.default_backend(), "xla")


def _concrete(x):
    """numpy value of ``x`` if it is known at trace time, else None."""
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        return np.asarray(x)
    except Exception:  # abstract values (e.g. under eval_shape)
        return None


def check_inputs(q, k, v, valid, lengths, bias, block_indices, block_size) -> None:
    """ValueError naming the argument for inconsistent shapes or (when concrete) out-of-range values."""
    if q.ndim != 3:
        raise ValueError(f"q has shape {q.shape}; expected [B, Hq, D]")
    if k.ndim != 4:
        raise ValueError(f"k has shape {k.shape}; expected [B, Hkv, S, D]")
    if v.shape != k.shape:
        raise ValueError(f"v has shape {v.shape}; expected k's shape {k.shape}")
    b, hkv, s, d = k.shape
    if q.shape[0] != b or q.shape[2] != d:
        raise ValueError(f"q has shape {q.shape}; expected [B={b}, Hq, D={d}] to match k {k.shape}")
    if q.shape[1] % hkv:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the {hkv} KV heads of k (GQA)")
    if not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be a positive integer (e.g. 128)")
    for name, x in (("valid", valid), ("bias", bias)):
        if x is not None and tuple(x.shape) != (b, hkv, s):
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected [B, Hkv, S] = {(b, hkv, s)}")
    if lengths is not None:
        if tuple(np.shape(lengths)) != (b,):
            raise ValueError(f"lengths has shape {tuple(np.shape(lengths))}; expected [B] = ({b},)")
        c = _concrete(lengths)
        if c is not None and (c.min(initial=0) < 0 or c.max(initial=0) > s):
            raise ValueError(f"lengths={c.tolist()} must lie in [0, S={s}]; the buffer holds {s} slots")
    if block_indices is not None:
        shape = tuple(np.shape(block_indices))
        if len(shape) not in (2, 3) or shape[0] != b or (len(shape) == 3 and shape[1] != hkv):
            raise ValueError(f"block_indices has shape {shape}; expected [B, Hkv, N] = ({b}, {hkv}, N) or [B, N]")
        if not np.issubdtype(np.dtype(block_indices.dtype), np.integer):
            raise ValueError(f"block_indices has dtype {block_indices.dtype}; expected an integer dtype")
        nb = -(-s // block_size)
        c = _concrete(block_indices)
        if c is not None and c.size and (c.min() < -1 or c.max() >= nb):
            raise ValueError(f"block_indices range [{c.min()}, {c.max()}] leaves [-1, {nb - 1}]: S={s} slots in "
                             f"blocks of block_size={block_size} give {nb} blocks; use -1 for padding")


def decode_attention(q, k, v, valid=None, lengths=None, bias=None, block_indices=None, *, impl: str | None = None,
                     block_size: int | None = None, interpret: bool = False):
    """Partials ``(o [B,Hq,D], m [B,Hq], l [B,Hq])`` float32 of attention over the taking-part slots.

    See the module docstring; ``reference.decode_attention_reference`` is the exact contract.
    """
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {IMPLS} or None (chosen by backend)")
    impl = impl or default_impl()
    if block_size is None:  # listed blocks keep their meaning (128 slots); else the tile is the table's
        block_size = 128 if block_indices is not None else tuning.get(impl).block_size
    check_inputs(q, k, v, valid, lengths, bias, block_indices, block_size)
    s = k.shape[2]
    if impl == "xla":
        from kernels_pallas.decode_attention.xla import decode_attention_xla
        return decode_attention_xla(q, k, v, valid, lengths, bias, block_indices, block_size)
    if block_indices is not None and np.shape(block_indices)[-1] == 0:  # nothing listed: the empty partial
        return decode_attention_reference(q, k, v, valid, lengths, bias, block_indices, block_size)
    if impl == "pallas_tpu":
        from kernels_pallas.decode_attention.pallas_tpu import decode_attention_tpu
        return decode_attention_tpu(q, k, v, valid, lengths, bias, block_indices,
                                    block_size=int(min(block_size, s)), interpret=interpret)
    from kernels_pallas.decode_attention.pallas_gpu import _pow2, decode_attention_gpu
    return decode_attention_gpu(q, k, v, valid, lengths, bias, block_indices,
                                block_size=int(min(block_size, _pow2(s))), interpret=interpret)


def block_plan_bytes(k, lengths=None, block_indices=None, *, block_size: int = 128, num_heads: int | None = None,
                     with_mask: bool = False) -> int:
    """Bytes one ``decode_attention`` call reads under the kernels' block plan (``_common.plan_blocks``): for
    every ``(b, h)`` the K and V rows of each visited block (blocks listed in ``block_indices`` and starting
    below ``lengths[b]``; a partial last block counts its real rows), the float32 additive mask of those slots
    when a ``valid``/``bias`` is passed (``with_mask``), the query and the partial outputs (``num_heads`` query
    heads, default ``Hkv``). Concrete inputs only (call it outside ``jit``)."""
    from kernels_pallas.decode_attention import _common

    b, hkv, s, d = k.shape
    bs = int(min(block_size, s))
    idx, count = _common.plan_blocks(block_indices, lengths, b, hkv, s, bs)
    idx, count = np.asarray(idx), np.asarray(count)
    rows = 0
    for bi in range(b):
        for hi in range(hkv):
            starts = idx[bi, hi, : count[bi, hi]] * bs
            rows += int(np.sum(np.minimum(bs, s - starts)))
    hq = num_heads or hkv
    item = np.dtype(k.dtype).itemsize
    total = rows * 2 * d * item + (rows * 4 if with_mask else 0)
    return int(total + b * hq * d * item + b * hq * (d + 2) * 4)


__all__ = ["IMPLS", "NEG_INF", "block_plan_bytes", "check_block_shape", "decode_attention", "decode_attention_reference",
           "default_impl", "merge", "normalise", "slot_mask"]
