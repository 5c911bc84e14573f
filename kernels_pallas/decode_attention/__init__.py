"""``decode_attention``: one query per head over a buffer of slots, returning mergeable partials.

>>> o, m, l = decode_attention(q, k, v, valid)                     # impl chosen by backend
>>> out = normalise(merge((o, m, l), other_partial))               # exact combination, then softmax
>>> part = decode_attention(q, k, v, lengths=n, block_indices=sel, block_size=128)  # only listed blocks read
>>> part = decode_attention_runs(q, k, v, starts, lens, max_rows=2048)         # runs of slots (ClusterKV)

q ``[B, Hq, D]``; k, v ``[B, Hkv, S, D]`` (GQA: ``Hq`` a multiple of ``Hkv``, KV never repeated); valid
``[B, Hkv, S]`` bool; lengths ``[B]`` int (slots ``[0, lengths[b])``); bias ``[B, Hkv, S]`` float added to the
scaled scores (Chelsea's ``log N``); block_indices ``[B, Hkv, N]`` or ``[B, N]`` int: the slot blocks
``[i*block_size, (i+1)*block_size)`` to visit (``-1`` pads; repeats count once; without it, all blocks).
Returns ``(o_unnormalised [B, Hq, D], m [B, Hq], l [B, Hq])`` float32 (``reference`` has the exact contract;
a row with no taking-part slot gives ``o = 0, l = 0, m = NEG_INF``). bf16 or fp32 inputs, fp32 accumulation.

``decode_attention_runs`` attends contiguous runs of slots of any start and length (optionally a prefix per query
head): see its docstring.

impl: ``"xla"`` (pure JAX that reads only the live chunks, the listed blocks or the runs, :mod:`.xla`; the masked
``reference`` is the spec), ``"pallas_tpu"`` (scalar-prefetched block lists), ``"pallas_gpu"``
(Triton, flash-decoding split), or None: the ``KVJAX_DECODE_ATTENTION_IMPL`` environment variable if set, else
``pallas_tpu`` on TPU, ``pallas_gpu`` on GPU where that kernel has been verified on the hardware
(``kernels_pallas/verified.py``, :mod:`kernels_pallas.impl_choice`), else ``xla``. A Pallas failure is raised,
never replaced by the reference silently. ``interpret=True`` runs a Pallas kernel in interpret mode (CPU tests).

block_size: slots per block; default 128 with ``block_indices`` (what the listed indices mean), else the tuning
table's (``tuning.TABLE``; only the tile size then, which slots take part does not depend on it). When ``S`` is smaller,
the Pallas kernels use one block covering every slot (the listed-block semantics do not change: every slot is in block
0). pallas_tpu needs it a multiple
of 128 (or ``>= S``) when a valid mask or bias is given, else a multiple of 8 (``tiling.check_block_shape``);
pallas_gpu a power of two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.checks import check_int, next_pow2
from kernels_pallas.decode_attention.reference import (
    NEG_INF,
    decode_attention_reference,
    decode_attention_runs_reference,
    merge,
    normalise,
    runs_mask,
    slot_mask,
)
from kernels_pallas.decode_attention import tuning
from kernels_pallas.decode_attention.tiling import check_block_shape
from kernels_pallas.impl_choice import choose

IMPLS = ("xla", "pallas_tpu", "pallas_gpu")
ENV_IMPL = "KVJAX_DECODE_ATTENTION_IMPL"


def default_impl() -> str:
    """``$KVJAX_DECODE_ATTENTION_IMPL`` if set, else the backend's kernel (tpu -> pallas_tpu, gpu -> pallas_gpu) where
    it has been verified (:mod:`kernels_pallas.impl_choice`), else xla."""
    return choose("decode_attention", IMPLS, "xla")


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
    check_int("block_size", block_size, "e.g. 128", numpy_ok=True)
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
            raise ValueError(
                f"block_indices range [{c.min()}, {c.max()}] leaves [-1, {nb - 1}]: S={s} slots in "
                f"blocks of block_size={block_size} give {nb} blocks; use -1 for padding"
            )


def decode_attention(
    q,
    k,
    v,
    valid=None,
    lengths=None,
    bias=None,
    block_indices=None,
    *,
    impl: str | None = None,
    block_size: int | None = None,
    interpret: bool = False,
):
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

        return decode_attention_tpu(
            q, k, v, valid, lengths, bias, block_indices, block_size=int(min(block_size, s)), interpret=interpret
        )
    from kernels_pallas.decode_attention.pallas_gpu import decode_attention_gpu

    return decode_attention_gpu(
        q, k, v, valid, lengths, bias, block_indices, block_size=int(min(block_size, next_pow2(s))), interpret=interpret
    )


def check_runs(q, k, starts, lens, max_rows, block_size) -> None:
    """ValueError naming the argument for run lists of the wrong shape or (when concrete) out-of-range values."""
    b, hkv, s, d = k.shape
    g = q.shape[1] // hkv
    if starts.ndim != 3 or tuple(starts.shape[:2]) != (b, hkv):
        raise ValueError(f"starts has shape {tuple(starts.shape)}; expected [B, Hkv, R] = ({b}, {hkv}, R)")
    r = starts.shape[-1]
    if tuple(lens.shape) not in ((b, hkv, r), (b, hkv, g, r)):
        raise ValueError(
            f"lens has shape {tuple(lens.shape)}; expected [B, Hkv, R] = {(b, hkv, r)} or per query "
            f"head [B, Hkv, G, R] = {(b, hkv, g, r)}"
        )
    for name, x in (("starts", starts), ("lens", lens)):
        if not np.issubdtype(np.dtype(x.dtype), np.integer):
            raise ValueError(f"{name} has dtype {x.dtype}; expected an integer dtype")
    check_int("max_rows", max_rows, "static: a bound on the rows listed per KV head", at_least=0, numpy_ok=True)
    check_int("block_size", block_size, "e.g. 16", numpy_ok=True)
    cs, cl = _concrete(starts), _concrete(lens)
    if cs is not None and cl is not None and cs.size:
        ln = cl if cl.ndim == 3 else cl.max(axis=2)
        if cl.min() < 0 or np.any((ln > 0) & ((cs < 0) | (cs + ln > s))):
            raise ValueError(
                f"runs leave the buffer: every run [starts, starts + lens) must lie in [0, S={s}) and lens be >= 0"
            )
        if ln.sum(axis=-1).max() > max_rows:
            raise ValueError(
                f"max_rows={max_rows} is below the {int(ln.sum(axis=-1).max())} rows a (b, h) lists; "
                f"pass a bound that holds"
            )


def decode_attention_runs(
    q, k, v, starts, lens, *, max_rows: int, block_size: int = 16, impl: str | None = None, interpret: bool = False
):
    """Partials ``(o [B,Hq,D], m [B,Hq], l [B,Hq])`` float32 of attention over *runs* of slots.

    Query head ``g`` of KV head ``h`` attends the slots ``[starts[b,h,r], starts[b,h,r] + lens[b,h,r])`` of every
    run ``r`` (``lens [B, Hkv, R]``), or its own prefix of each run (``lens [B, Hkv, G, R]``: the run is read once
    per KV head and masked per query head). Runs of one ``(b, h)`` must not overlap; a length of 0 lists nothing.
    ``max_rows`` (static) bounds ``Σ_r max_g lens`` per ``(b, h)``; it sizes the window list (runs past it would
    be dropped). ``reference.decode_attention_runs_reference`` is the exact contract (a mask over all slots).

    impl ``"xla"`` (None on CPU): :func:`.xla.decode_attention_runs_xla` cuts the runs into windows of
    ``block_size`` rows and gathers and attends them chunk by chunk; a run of ``>= block_size`` rows reads no slot
    outside it (:func:`runs_plan_bytes`). ``"pallas_tpu"``/``"pallas_gpu"`` (no run kernel): the same windows
    are gathered into one compact buffer with XLA and the block kernel attends it with the window mask (per
    query head, the buffer is repeated for each of the group's heads).
    """
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {IMPLS} or None (chosen by backend)")
    impl = impl or default_impl()
    check_inputs(q, k, v, None, None, None, None, 1)
    check_runs(q, k, starts, lens, max_rows, block_size)
    if impl == "xla":
        from kernels_pallas.decode_attention import xla

        return xla.decode_attention_runs_xla(q, k, v, starts, lens, max_rows=int(max_rows), block_size=int(block_size))
    kk, vv, valid = gather_runs(k, v, starts, lens, max_rows=int(max_rows), block_size=int(block_size))
    return decode_attention(q, kk, vv, valid, impl=impl, interpret=interpret)


def gather_runs(k, v, starts, lens, *, max_rows: int, block_size: int = 16):
    """The windows :func:`decode_attention_runs` reads, gathered into a compact buffer with XLA (for the block
    kernels, or to move them to another memory): ``(kk, vv [B, H', W * bs, D], valid [B, H', W * bs])`` with ``W =
    ceil(max_rows / bs) + R`` windows and ``H' = Hkv`` for shared ``lens [B, Hkv, R]``, ``H' = Hq`` (the buffer
    repeated for each query head of a group, valid per head) for ``lens [B, Hkv, G, R]``."""
    from kernels_pallas.decode_attention import xla

    b, hkv, s, _ = k.shape
    bs = int(min(block_size, s))
    first, stop, count = xla.run_windows(starts, lens, bs, -(-int(max_rows) // bs) + starts.shape[-1])
    top = jnp.max(stop, axis=2) if stop.ndim == 4 else stop
    at = jnp.clip(jnp.minimum(first, top - bs), 0, s - bs)  # as the xla path reads them
    rows = at[..., None] + jnp.arange(bs, dtype=jnp.int32)  # [B, Hkv, W, bs]
    listed = (jnp.arange(at.shape[-1]) < count[..., None])[..., None] & (rows >= first[..., None])
    kk, vv = xla.gather_windows(k, at, bs), xla.gather_windows(v, at, bs)  # [B, Hkv, W * bs, D]
    if stop.ndim == 3:
        return kk, vv, (listed & (rows < stop[..., None])).reshape(b, hkv, -1)
    g = stop.shape[2]  # one "KV head" per query head: the buffer repeated G times
    valid = (listed[:, :, None] & (rows[:, :, None] < stop[..., None])).reshape(b, hkv * g, -1)
    rep = lambda x: jnp.broadcast_to(x[:, :, None], (b, hkv, g) + x.shape[2:]).reshape(b, hkv * g, *x.shape[2:])
    return rep(kk), rep(vv), valid


def runs_plan_bytes(k, starts, lens, *, block_size: int = 16, num_heads: int | None = None) -> int:
    """Bytes one :func:`decode_attention_runs` call reads on the xla path: per ``(b, h)`` and run of ``span = max_g
    lens > 0`` rows, ``max(span, block_size)`` K and V rows (a run shorter than a window reads a whole window), the
    query and the partial outputs. Concrete inputs only (call it outside ``jit``)."""
    b, hkv, s, d = k.shape
    bs = int(min(block_size, s))
    ln = np.asarray(lens)
    span = ln if ln.ndim == 3 else ln.max(axis=2)
    rows = int(np.sum(np.where(span > 0, np.maximum(span, bs), 0)))
    hq = num_heads or hkv
    item = np.dtype(k.dtype).itemsize
    return int(rows * 2 * d * item + b * hq * d * item + b * hq * (d + 2) * 4)


def block_plan_bytes(
    k, lengths=None, block_indices=None, *, block_size: int = 128, num_heads: int | None = None, with_mask: bool = False
) -> int:
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


__all__ = [
    "IMPLS",
    "NEG_INF",
    "block_plan_bytes",
    "check_block_shape",
    "decode_attention",
    "decode_attention_reference",
    "decode_attention_runs",
    "decode_attention_runs_reference",
    "default_impl",
    "gather_runs",
    "merge",
    "normalise",
    "runs_mask",
    "runs_plan_bytes",
    "slot_mask",
]
