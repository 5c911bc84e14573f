"""What a ClusterKV decode step attends and reads (Liu et al., DAC'25, §III-C, §IV-C; spec §2.6, §7.5, §7.8; method
note ``docs/notes/clusterkv.md`` §7.5): attention over the recalled runs of slots
(:func:`kvjax.methods.clusterkv.recall.runs`), each run read once per KV head, from device memory or, with
``offload``, gathered from the ``pinned_host`` K/V (:mod:`kvjax.methods.core.offload`) and attended on the device; and
:func:`read_bytes`, what such a step reads, by part.

Shapes: q ``[B, Hq, D]``; k, v ``[B, Hkv, S, D]``; starts ``[B, Hkv, R]``, lens ``[B, Hkv, R]`` or ``[B, Hkv, G,
R]``; the partial ``(o [B, Hq, D], m [B, Hq], l [B, Hq])`` float32 (:mod:`kvjax.model.attention`); rows read ``[B,
Hkv]`` int32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.decode_attention import gather_runs
from kvjax.model import attention
from kvjax.methods.core.offload import device_sharding

#: Rows per window of the decode step's run reads (``kernels_pallas.decode_attention.decode_attention_runs``).
RUN_BLOCK = 16


def run_block(s: int) -> int:
    """Rows per window of the run reads (``decode_attention_runs``' ``block_size``) over ``s`` slots."""
    return min(RUN_BLOCK, s)


def attend(q, k, v, starts, lens, *, max_rows: int, offload: bool):
    """Attend the runs ``(starts, lens)`` of ``k, v`` (at most ``max_rows`` rows per KV head): ``(partial, rows
    read [B, Hkv])``, a run shorter than a window counted as the whole window (what the run reads touch). With
    ``offload`` the runs' windows are gathered from host memory and attended on the device."""
    bs = run_block(k.shape[2])
    if offload:  # gather the windows from host memory, attend them on the device
        kk, vv, valid = gather_runs(k, v, starts, lens, max_rows=max_rows, block_size=bs)
        dev = device_sharding()
        part = attention.attend(q, jax.device_put(kk, dev), jax.device_put(vv, dev), valid)
    else:
        part = attention.attend_runs(q, k, v, starts, lens, max_rows=max_rows, block_size=bs)
    span = lens if lens.ndim == 3 else jnp.max(lens, axis=2)
    read = jnp.sum(jnp.where(span > 0, jnp.maximum(span, bs), 0), axis=-1).astype(jnp.int32)  # [B, Hkv]
    return part, read


def read_bytes(k, csize, lengths, filled, clustered, sinks, bsel, rows_read, *, num_heads: int, g: int):
    """Bytes one decode step of a compressed layer reads, by part (concrete arrays; call outside ``jit``); ``g``:
    selecting heads per KV head (1 for ``group_mean``), ``num_heads`` the model's query heads:

    - ``centroids``: ``mu`` (float32), ``csize`` and ``cstart`` of the live clusters per KV head;
    - ``ranking``: the float32 score and the size of each live cluster, per selecting head (the size-weighted
      bisection, :func:`kvjax.methods.clusterkv.recall.take_lengths`, passes over these small arrays 32 times, in
      cache). The scoring einsum and the bisection run over the static ``C``-cluster buffers (the bucket's
      ``C0_max`` prompt clusters and every decode window's slots); the slots no cluster of the sequence uses are
      not counted (at most ``bucket / tokens_per_cluster`` centroids of ``4 D`` bytes per KV head, well under 1% of
      a step's reads at the budgets of the paper);
    - ``runs``: the K and V rows the run reads touch (:func:`~kernels_pallas.decode_attention.runs_plan_bytes`:
      every listed run's rows, a run shorter than ``RUN_BLOCK`` rows a whole window): the sinks, the unclustered
      window and the selected clusters, read once per KV head (``gqa="query"``: the union of the group's
      selections). The rows depend on the query: after a decode step, the rows that step read (``rows_read``,
      :func:`attend`); before the first, the bound ``bsel`` per selecting head plus the sink and window runs.
      Plus the query and the partial outputs;
    - ``full_kv``, not in ``total``: full attention over the same live slots."""
    b, h, s, d = k.shape
    item = np.dtype(k.dtype).itemsize
    bs = run_block(s)
    live = int(np.sum(np.asarray(csize) > 0))
    filled, clustered = np.asarray(filled), np.asarray(clustered)
    if np.any(filled > np.asarray(lengths)):  # a decode step has run: what it read
        rows = int(np.sum(np.asarray(rows_read)))
    else:  # the next step's bound: bsel per selecting head (at most the clustered tokens), sinks, window
        sinks, bsel = np.asarray(sinks), np.asarray(bsel)
        run = lambda n: np.where(n > 0, np.maximum(n, bs), 0)  # noqa: E731
        sel = np.minimum(g * bsel, clustered - sinks)
        rows = int(h * np.sum(run(sinks) + run(filled + 1 - clustered) + sel))
    out = {
        "centroids": live * (d * 4 + 8),
        "ranking": live * g * 8,
        "runs": rows * 2 * d * item + b * num_heads * d * item + b * num_heads * (d + 2) * 4,
    }
    out["total"] = sum(out.values())
    out["full_kv"] = int(h * np.sum(filled + 1) * 2 * d * item + b * num_heads * (2 * d * item + (d + 2) * 4))
    return out
