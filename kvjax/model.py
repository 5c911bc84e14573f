"""The Llama-family decoder as pure functions over a params pytree.

Params layout (weights stored ``[in, out]``, i.e. transposed from PyTorch's ``[out, in]``)::

    {"embed": [V, H], "final_norm": [H], "lm_head": [H, V] (absent when embeddings are tied),
     "layers": ({"attn_norm": [H], "wq": [H, Hq*D], "wk": [H, Hkv*D], "wv": [H, Hkv*D], "wo": [Hq*D, H],
                 "bq"/"bk"/"bv": [..] and "bo": [H] when the config has biases,
                 "mlp_norm": [H], "w_gate": [H, F], "w_up": [H, F], "w_down": [F, H]}, ...)}

A layer is split in two halves so that a KV-cache method can sit between them (DESIGN principle 4):
``layer_qkv`` gives post-RoPE ``q [B, Hq, T, D]``, ``k, v [B, Hkv, T, D]``; the method attends; and
``layer_finish`` applies the output projection, residuals and the MLP. ``forward`` composes them with dense
causal attention and is the full-attention reference the engine and tests compare against.

Einsum axes: b batch, t query position, s key position/slot, h KV head, g query head within its group,
d head dim.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kvjax.config import ModelConfig
from kvjax.rope import apply_rope, cos_sin

Params = dict[str, Any]
NEG_INF = -1e30  # finite, so fully masked rows give 0 weights after the max-subtraction instead of NaN


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    """RMSNorm computed in float32, cast back to ``x.dtype`` before the weight (as transformers does)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def _linear(x, w, b=None):
    y = x @ w
    return y if b is None else y + b


def embed(params: Params, tokens: jnp.ndarray) -> jnp.ndarray:
    """Token embeddings ``[B, T, H]`` for ``tokens [B, T]``."""
    return jnp.take(params["embed"], tokens, axis=0)


def layer_qkv(cfg: ModelConfig, lp: Params, x: jnp.ndarray, positions: jnp.ndarray):
    """Pre-norm, projections and RoPE for one layer.

    x: residual stream ``[B, T, H]``; positions: ``[B, T]`` int. Returns post-RoPE
    ``q [B, Hq, T, D]``, ``k [B, Hkv, T, D]`` and ``v [B, Hkv, T, D]`` in ``x.dtype``.
    """
    b, t, _ = x.shape
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q = _linear(h, lp["wq"], lp.get("bq")).reshape(b, t, cfg.num_heads, cfg.head_dim).transpose(0, 2, 1, 3)
    k = _linear(h, lp["wk"], lp.get("bk")).reshape(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(0, 2, 1, 3)
    v = _linear(h, lp["wv"], lp.get("bv")).reshape(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(0, 2, 1, 3)
    cos, sin = cos_sin(cfg.rope, cfg.head_dim, positions, x.dtype)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def layer_finish(cfg: ModelConfig, lp: Params, x: jnp.ndarray, attn: jnp.ndarray) -> jnp.ndarray:
    """Output projection, residual, MLP. ``attn [B, Hq, T, D]`` (normalised) -> new residual ``[B, T, H]``."""
    b, _, t, _ = attn.shape
    o = attn.astype(x.dtype).transpose(0, 2, 1, 3).reshape(b, t, cfg.num_heads * cfg.head_dim)
    x = x + _linear(o, lp["wo"], lp.get("bo"))
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    gate = _linear(h, lp["w_gate"], lp.get("b_gate"))
    up = _linear(h, lp["w_up"], lp.get("b_up"))
    return x + _linear(jax.nn.silu(gate) * up, lp["w_down"], lp.get("b_down"))


def logits(cfg: ModelConfig, params: Params, x: jnp.ndarray) -> jnp.ndarray:
    """Final norm and LM head: ``[B, T, H]`` -> float32 logits ``[B, T, V]``."""
    h = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return (h @ w).astype(jnp.float32)


def causal_attention(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, lengths: jnp.ndarray | None = None,
                     sliding_window: int | None = None) -> jnp.ndarray:
    """Dense causal attention with GQA (no repeated KV), softmax in float32.

    q: ``[B, Hq, T, D]``; k, v: ``[B, Hkv, T, D]``; lengths: ``[B]`` valid (right-padded) prompt lengths or
    None. Query ``t`` sees keys ``s <= t`` with ``s < lengths[b]`` and, with a sliding window ``w``,
    ``t - s < w``. Returns ``[B, Hq, T, D]`` in ``q.dtype`` (rows of padded queries are meaningless).
    """
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, t, d)
    scores = jnp.einsum("bhgtd,bhsd->bhgts", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(
        jnp.float32(d))
    pos = jnp.arange(t)
    mask = pos[None, :] <= pos[:, None]  # [t, s]
    if sliding_window is not None:
        mask &= pos[:, None] - pos[None, :] < sliding_window
    mask = jnp.broadcast_to(mask, (b, t, t))
    if lengths is not None:
        mask &= pos[None, None, :] < lengths[:, None, None]
    scores = jnp.where(mask[:, None, None], scores, NEG_INF)
    w = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgts,bhsd->bhgtd", w.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, hq, t, d).astype(q.dtype)


def forward(cfg: ModelConfig, params: Params, tokens: jnp.ndarray, lengths: jnp.ndarray | None = None,
            positions: jnp.ndarray | None = None) -> jnp.ndarray:
    """Full forward pass with dense causal attention: ``tokens [B, T]`` -> float32 logits ``[B, T, V]``.

    The uncompressed reference: the engine with the ``full`` method must reproduce it.
    """
    b, t = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    x = embed(params, tokens)
    for i, lp in enumerate(params["layers"]):
        q, k, v = layer_qkv(cfg, lp, x, positions)
        x = layer_finish(cfg, lp, x, causal_attention(q, k, v, lengths, cfg.sliding_windows[i]))
    return logits(cfg, params, x)
