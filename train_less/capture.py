"""Activation capture from the frozen, full-attention model (method note ``docs/notes/less.md`` §3, §8.5 step 2).

For every sequence and layer we keep the residual stream entering the layer (``x [S, H]``, from which the
layer's post-RoPE q, k, v and its target output ``o_proj(full attention)`` are recomputed exactly during
training — 4x less memory than storing q, k, v, o) and the sparse policy's parallel masks, bit-packed
(they depend only on the frozen q, k, so they are computed once, not every epoch; note A7). All layers
come from one forward pass per batch (every layer's inputs are the *full-cache* model's, note A25).
With a mesh, each batch's tokens are split over ``data`` (the parameters as the caller placed them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from kvjax import model as M
from kvjax import sharding as S


def stack_layers(params) -> dict:
    """The model's per-layer params stacked on a leading ``[L]`` axis (either layout in)."""
    return M.stack_layers(params)["layers"]


def put_batch(x, mesh, axis: int = 0):
    """``x`` on ``mesh`` with its batch ``axis`` split over ``data`` (replicated when the batch does not divide,
    e.g. a last, smaller batch); a plain device array without a mesh."""
    if mesh is None:
        return jnp.asarray(x)
    split = x.shape[axis] % S.axis_size(mesh, S.DATA) == 0
    return jax.device_put(x, NamedSharding(mesh, P(*(None,) * axis, S.DATA) if split else P()))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _capture_batch(cfg, policies, params, tokens):
    b, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s), (b, s))

    def attend(layer, x, q, k, v, out):
        packed = tuple(jnp.packbits(p.parallel_mask(q, k), axis=-1) for p in policies)
        return M.causal_attention(q, k, v), out + ((x, packed),)

    _, out = M.run_layers(cfg, params, M.embed(params, tokens), positions, attend, ())
    xs = jnp.stack([x for x, _ in out])
    packed = tuple(jnp.stack([pk[i] for _, pk in out]) for i in range(len(policies)))
    return xs, packed  # [L, B, S, H], each [L, B, Hkv, S, ceil(S/8)]


def capture(cfg, params, tokens: np.ndarray, policies: tuple, batch: int = 4, store_dtype=None,
            progress: bool = True, mesh=None):
    """Run the frozen model over ``tokens [N, S]``.

    policies: :class:`~kvjax.methods.less.Less` configs whose ``parallel_mask`` to record. mesh: split each
    batch over ``data`` (a batch that does not divide, e.g. the last one, runs replicated). Returns
    ``(xs [N, L, S, H] np (store_dtype, default the model's), masks: tuple of [N, L, Hkv, S, ceil(S/8)] uint8)``.
    """
    if any(w is not None for w in cfg.sliding_windows):
        raise ValueError("LESS training does not support sliding-window attention layers (model has "
                         f"sliding_windows={cfg.sliding_windows}); use a model with full attention")
    n = tokens.shape[0]
    xs_out, masks_out = [], [[] for _ in policies]
    for i in tqdm(range(0, n, batch), desc="capture", disable=not progress, unit="batch"):
        xs, packed = _capture_batch(cfg, tuple(policies), params, put_batch(tokens[i:i + batch], mesh))
        xs_out.append(np.asarray(jnp.swapaxes(xs, 0, 1).astype(store_dtype or xs.dtype)))
        for out, p in zip(masks_out, packed):
            out.append(np.asarray(jnp.swapaxes(p, 0, 1)))
    return np.concatenate(xs_out), tuple(np.concatenate(m) for m in masks_out)
