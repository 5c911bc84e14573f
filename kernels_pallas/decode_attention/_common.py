"""Input preparation shared by the Pallas decode-attention kernels (plain XLA on small arrays).

- ``plan_blocks``: the list of slot blocks each ``(b, h)`` visits, as the kernels want it: ``idx [B, Hkv, N]``
  int32 sorted ascending with the ``count [B, Hkv]`` visited entries first; the remaining entries repeat the
  last visited block (a TPU pipeline then issues no new DMA for them) and are skipped by the kernels. Entries
  outside ``[0, n_blocks)``, repeats, and blocks starting at or past ``lengths[b]`` are dropped here, so only
  blocks holding a slot that may take part are ever read.
- ``additive_mask``: ``valid`` and ``bias`` folded into one float32 ``[B, Hkv, S]`` array: the bias where the
  slot is valid, ``NEG_INF`` where not (a slot takes part iff its entry is > ``NEG_INF / 2``). None when both
  are None, so a lengths-only call reads nothing but K and V.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.decode_attention.reference import NEG_INF


def n_blocks(s: int, block_size: int) -> int:
    return -(-s // block_size)


def plan_blocks(block_indices, lengths, b: int, hkv: int, s: int, block_size: int):
    """Returns ``(idx [B, Hkv, N] int32, count [B, Hkv] int32)`` (see the module docstring)."""
    nb = n_blocks(s, block_size)
    if block_indices is None:
        idx = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), (b, hkv, nb))
    else:
        idx = jnp.asarray(block_indices, jnp.int32)
        if idx.ndim == 2:
            idx = jnp.broadcast_to(idx[:, None, :], (b, hkv, idx.shape[-1]))
    ok = (idx >= 0) & (idx < nb)
    if lengths is not None:
        ok = ok & (idx * block_size < jnp.asarray(lengths, jnp.int32)[:, None, None])
    key = jnp.sort(jnp.where(ok, idx, nb), axis=-1)
    dup = jnp.concatenate([jnp.zeros_like(key[..., :1], bool), key[..., 1:] == key[..., :-1]], axis=-1)
    key = jnp.sort(jnp.where(dup, nb, key), axis=-1)
    count = jnp.sum(key < nb, axis=-1).astype(jnp.int32)
    last = jnp.take_along_axis(key, jnp.maximum(count - 1, 0)[..., None], axis=-1)
    last = jnp.where(count[..., None] > 0, last, 0)
    idx = jnp.where(key < nb, key, last).astype(jnp.int32)
    return idx, count


def additive_mask(valid, bias):
    """float32 ``[B, Hkv, S]`` or None (see the module docstring)."""
    if valid is None and bias is None:
        return None
    add = jnp.zeros(valid.shape if bias is None else bias.shape, jnp.float32)
    if bias is not None:
        add = bias.astype(jnp.float32)
    if valid is not None:
        add = jnp.where(valid.astype(bool), add, NEG_INF)
    return add


def effective_lengths(lengths, b: int, s: int):
    """int32 ``[B]``: ``lengths`` or ``S`` for every row."""
    if lengths is None:
        return jnp.full((b,), s, jnp.int32)
    return jnp.asarray(lengths, jnp.int32)
