"""Which prompt tokens a selection method keeps, layer by layer, and how similar adjacent layers' choices are.

The ChunkKV paper's Table 2 / Table 12 measure (arXiv 2502.00299, §3.3 and App. B.1.2): the Jaccard similarity
``|A ∩ B| / |A ∪ B|`` of the kept prompt positions of adjacent layers, averaged over the layer pairs. The paper
logs only the first head of one prompt; here every (batch element, KV head) is measured and averaged, and the
window positions (kept by every layer of every method) can be left out (method note ``docs/notes/chunkkv.md`` §6 A18).

Works for any method whose per-layer state has a ``pos`` leaf ``[B, Hkv, S]`` of original token positions with
-1 for empty slots (``SlotCache``: full, streaming_llm, h2o, snapkv, pyramidkv, chunkkv, ...).

>>> kept = kept_prompt_positions(model, methods.get("chunkkv", budget=0.2), [ids_a, ids_b])
>>> adjacent_layer_jaccard(kept)                       # [num_layers - 1] mean Jaccard per adjacent pair
>>> adjacent_layer_jaccard(kept, exclude_last=8).mean()  # window positions left out, averaged over layers
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from kvjax import engine
from kvjax.methods.base import Capacity


@dataclasses.dataclass(frozen=True)
class KeptPositions:
    """Kept prompt positions after prefill.

    mask: ``[L, B, Hkv, T]`` bool, ``mask[l, b, h, t]`` is True when layer ``l`` keeps prompt position ``t`` of
    sequence ``b`` in KV head ``h`` (``T`` is the prompt bucket; positions ``>= lengths[b]`` are always False).
    lengths: ``[B]`` int, the real prompt lengths.
    """

    mask: np.ndarray
    lengths: np.ndarray

    @property
    def num_layers(self) -> int:
        return self.mask.shape[0]

    def indices(self, layer: int, b: int, h: int) -> np.ndarray:
        """Sorted kept positions (int) of ``layer``, sequence ``b``, KV head ``h``."""
        return np.nonzero(self.mask[layer, b, h])[0]

    def counts(self) -> np.ndarray:
        """Kept tokens per (layer, sequence, KV head): ``[L, B, Hkv]`` int."""
        return self.mask.sum(-1)


def mask_from_states(states: Sequence, lengths, prompt_len: int) -> KeptPositions:
    """:class:`KeptPositions` from per-layer prefill states (each with ``pos [B, Hkv, S]``, -1 = empty).

    Only prompt positions count: ``0 <= pos < lengths[b]``. A position held twice (ChunkKV's
    ``paper_literal`` mode) counts once.
    """
    lengths = np.asarray(lengths)
    masks = []
    for layer, st in enumerate(states):
        if not hasattr(st, "pos"):
            raise ValueError(
                f"the layer-{layer} state ({type(st).__name__}) has no `pos` leaf of kept token "
                "positions; kept_prompt_positions works for slot-cache methods (SlotCache states)"
            )
        pos = np.asarray(st.pos)  # [B, Hkv, S]
        b, h, _ = pos.shape
        m = np.zeros((b, h, prompt_len), bool)
        real = (pos >= 0) & (pos < lengths[:, None, None])
        bi, hi, si = np.nonzero(real)
        m[bi, hi, pos[bi, hi, si]] = True
        masks.append(m)
    return KeptPositions(np.stack(masks), lengths)


def kept_prompt_positions(
    model, method, prompts, *, prompt_len: int | None = None, max_new_tokens: int = 1
) -> KeptPositions:
    """Run the engine's (jitted) prefill of ``model`` with ``method`` and read each layer's kept positions.

    model: a :class:`kvjax.Model` (``.config``, ``.params``, ``.dtype``); method: a method config
    (``kvjax.methods.get(...)``) or a registered name; prompts: token ids, one list (one sequence) or a list of
    lists / a 2-D array (a batch, right padded to ``prompt_len``, default the engine's power-of-two bucket).
    ``max_new_tokens`` only sizes the decode region (nothing is decoded). Returns :class:`KeptPositions`
    (mask ``[L, B, Hkv, prompt_len]``).
    """
    from kvjax import methods as methods_lib

    if isinstance(method, str):
        method = methods_lib.get(method)
    if len(prompts) and isinstance(prompts[0], (int, np.integer)):
        prompts = [prompts]
    ids = [[int(t) for t in p] for p in prompts]
    if not ids or not all(ids):
        raise ValueError("prompts must be one or more non-empty lists of token ids")
    lengths_list = [len(p) for p in ids]
    bucket = prompt_len or engine.bucket_length(max(lengths_list))
    if max(lengths_list) > bucket:
        raise ValueError(
            f"prompt of {max(lengths_list)} tokens is longer than prompt_len={bucket}; raise "
            "prompt_len (prompts are never truncated)"
        )
    cfg = model.config
    tokens, lengths = engine.pad_prompts(ids, bucket)
    states = engine.init_states(cfg, method, len(ids), Capacity(bucket, max_new_tokens), model.dtype)
    states, _ = engine.prefill(cfg, method, model.params, jnp.asarray(tokens), jnp.asarray(lengths), states)
    return mask_from_states(states, lengths, bucket)


def _as_mask(kept) -> np.ndarray:
    mask = kept.mask if isinstance(kept, KeptPositions) else np.asarray(kept, bool)
    if mask.ndim != 4:
        raise ValueError(f"kept has shape {mask.shape}; pass a KeptPositions or a bool mask [L, B, Hkv, T]")
    return mask


def _drop_last(mask: np.ndarray, lengths, exclude_last: int) -> np.ndarray:
    if exclude_last < 0:
        raise ValueError(f"exclude_last={exclude_last} must be >= 0 (the number of final prompt positions to drop)")
    if exclude_last == 0:
        return mask
    if lengths is None:
        raise ValueError("exclude_last > 0 needs the prompt lengths; pass a KeptPositions or lengths=")
    t = np.arange(mask.shape[-1])
    keep = t[None, :] < (np.asarray(lengths) - exclude_last)[:, None]  # [B, T]
    return mask & keep[None, :, None, :]


def jaccard(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``|A ∩ B| / |A ∪ B|`` over the last axis of two bool masks (1.0 where both sets are empty)."""
    inter = (a & b).sum(-1)
    union = (a | b).sum(-1)
    return np.where(union > 0, inter / np.maximum(union, 1), 1.0)


def adjacent_layer_jaccard(kept, *, exclude_last: int = 0, lengths=None) -> np.ndarray:
    """Mean Jaccard similarity of layer ``l``'s and layer ``l + 1``'s kept positions, for each ``l``.

    kept: :class:`KeptPositions` or a bool mask ``[L, B, Hkv, T]``. The Jaccard index is computed per
    (sequence, KV head) and averaged over both (ChunkKV paper, Table 2). ``exclude_last=w`` leaves out the last
    ``w`` prompt positions of each sequence (the observation window, kept everywhere; needs the lengths, taken
    from ``kept`` or ``lengths=``). Returns ``[L - 1]`` float64; ``.mean()`` is the paper's single number.
    """
    mask = _as_mask(kept)
    if lengths is None and isinstance(kept, KeptPositions):
        lengths = kept.lengths
    mask = _drop_last(mask, lengths, exclude_last)
    return jaccard(mask[:-1], mask[1:]).mean(axis=(1, 2))


def layer_jaccard_matrix(kept, *, exclude_last: int = 0, lengths=None) -> np.ndarray:
    """``[L, L]`` mean Jaccard similarity between every pair of layers (the paper's Fig. 2 heatmaps)."""
    mask = _as_mask(kept)
    if lengths is None and isinstance(kept, KeptPositions):
        lengths = kept.lengths
    mask = _drop_last(mask, lengths, exclude_last)
    n = mask.shape[0]
    out = np.ones((n, n))
    for i in range(n):
        for j in range(i + 1, n):
            out[i, j] = out[j, i] = jaccard(mask[i], mask[j]).mean()
    return out
