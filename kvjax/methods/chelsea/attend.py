"""What a Chelsea decode step attends and reads (Hu et al., 2025, §3 Eq. 1-2, §5.4, Alg. 1; spec §2.2, §2.7-2.8):
the new token appended with count 1, attention over the live merged slots with the ``log N`` bias of a slot that
stands for ``N`` tokens, ``softmax(q K^T / sqrt(d) + log N) V`` (Eq. 2), and over the outlier heads' full caches
without it; :func:`read_bytes` counts what that reads, under the decode-attention kernel's block plan.

Shapes: q4 ``[B, Hkv, G, D]`` (a KV head's ``G`` query heads); k, v ``[B, Hkv, D]`` (the new token); the
compressed heads' k, v ``[B, Hc, S, D]``, n ``[B, Hc, S]`` float32 counts (0 = empty), length ``[B]`` int32; the
outlier heads' ko, vo ``[B, O, F, D]`` (``F = n + Gamma``); pos ``[B]`` int32 (the new token's position);
``comp``/``out``: the static head tuples of :func:`kvjax.methods.chelsea.outliers.layer_heads`. Outputs ``[B, H,
G, D]`` float32 over the heads given.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kernels_pallas.decode_attention import block_plan_bytes
from kvjax.model import attention
from kvjax.methods.base import rows_at
from kvjax.methods.chelsea.outliers import head_sinks, select_heads


def append(kc, vc, nc, length, k, v, comp: tuple):
    """Write the new token ``k, v [B, Hkv, D]`` (its ``comp`` heads) at slot ``length [B]`` of each compressed
    head, with count 1 (Alg. 1, in place): ``(k, v, n, length + 1)``."""
    b = k.shape[0]
    slot = jnp.broadcast_to(length[:, None], (b, len(comp)))
    kk = rows_at(kc, slot, select_heads(k, comp))
    vv = rows_at(vc, slot, select_heads(v, comp))
    n = rows_at(nc, slot, 1.0)
    return kk, vv, n, length + 1


def attend_merged(q4, k, v, n, length, comp: tuple):
    """Attention of the ``comp`` heads' query heads over the live merged slots ``[0, length)`` with the ``log N``
    bias (Eq. 2): ``(out [B, Hc, G, D], partial)`` (the partial ``(o, m, l)`` orders the compression after the
    reads, :func:`kvjax.methods.chelsea.merge.after`; None when ``comp`` is empty)."""
    b, _, g, d = q4.shape
    valid = n > 0
    bias = jnp.log(jnp.where(valid, n, 1.0))
    qc = select_heads(q4, comp).reshape(b, len(comp) * g, d)
    if not comp:  # every KV head of this layer is an outlier head
        return jnp.zeros((b, 0, g, d), jnp.float32), None
    part = attention.attend(qc, k, v, valid, bias=bias, lengths=length)
    return attention.normalise(part, sinks=head_sinks(comp, g)).reshape(b, len(comp), g, d), part


def attend_outliers(q4, ko, vo, k, v, pos, out: tuple):
    """The outlier heads (§5.4): write the new token at ``pos`` of their full caches and attend ``[0, pos]``
    without a bias: ``(out [B, O, G, D], ko, vo)``."""
    b, _, g, d = q4.shape
    p = jnp.broadcast_to(pos[:, None], (b, len(out)))
    ko = rows_at(ko, p, select_heads(k, out))
    vo = rows_at(vo, p, select_heads(v, out))
    ovalid = jnp.broadcast_to(jnp.arange(ko.shape[2])[None, None, :] <= pos[:, None, None], ko.shape[:3])
    qo = select_heads(q4, out).reshape(b, len(out) * g, d)
    o_o = attention.attend(qo, ko, vo, ovalid, lengths=(pos + 1).astype(jnp.int32))
    o_o = attention.normalise(o_o, sinks=head_sinks(out, g))
    return o_o.reshape(b, len(out), g, d), ko, vo


def join_heads(o_c, o_o, comp: tuple, out: tuple):
    """The compressed heads' ``o_c`` and the outlier heads' ``o_o`` back in the layer's KV-head order."""
    inv = np.argsort(np.asarray(comp + out))
    return jnp.concatenate([o_c, o_o], axis=1)[:, inv]


def read_bytes(k, length, ko, seen, num_heads: int) -> int:
    """Bytes one decode step of a layer reads under the decode-attention kernel's block plan: the live compressed
    slots ``[0, length)`` of ``k [B, Hc, S, D]`` (K, V and the float32 additive mask carrying ``log N``) and the
    live prefix ``[0, seen)`` of the outlier heads' ``ko [B, O, F, D]`` (K, V, mask), plus queries and outputs.
    ``num_heads``: the model's query heads (split between the compressed and the outlier KV heads by GQA group)."""
    hc, ho = k.shape[1], ko.shape[1]
    g = num_heads // (hc + ho)
    total = 0
    if hc:
        total += block_plan_bytes(k, length, num_heads=hc * g, with_mask=True)
    if ho:
        total += block_plan_bytes(ko, seen, num_heads=ho * g, with_mask=True)
    return int(total)
