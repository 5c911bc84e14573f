"""The decoder (Llama family, Qwen3, Gemma 3, gpt-oss) as pure functions over a params pytree.

Params layout (weights stored ``[in, out]``, i.e. transposed from PyTorch's ``[out, in]``)::

    {"embed": [V, H], "final_norm": [H], "lm_head": [H, V] (absent when embeddings are tied),
     "layers": ({"attn_norm": [H], "wq": [H, Hq*D], "wk": [H, Hkv*D], "wv": [H, Hkv*D], "wo": [Hq*D, H],
                 "bq"/"bk"/"bv": [..] and "bo": [H] when the config has biases,
                 "mlp_norm": [H], "w_gate": [H, F], "w_up": [H, F], "w_down": [F, H]}, ...)}

and, where the config asks for them: ``"q_norm"``/``"k_norm"`` ``[D]`` (``qk_norm``: Qwen3, Gemma 3),
``"post_attn_norm"``/``"post_mlp_norm"`` ``[H]`` (``post_norms``: Gemma 3, whose ``mlp_norm`` is its
``pre_feedforward_layernorm``), ``"sinks"`` ``[Hq]`` (``attention_sinks``: gpt-oss) and, for a mixture-of-experts
MLP (gpt-oss) in place of ``w_gate``/``w_up``/``w_down``: ``"router"`` ``[H, E]``, ``"b_router"`` ``[E]``,
``"experts_gate_up"`` ``[E, H, 2F]`` (gate and up interleaved, as the checkpoint has them),
``"experts_b_gate_up"`` ``[E, 2F]``, ``"experts_down"`` ``[E, F, H]``, ``"experts_b_down"`` ``[E, H]``.

A layer is split in two halves so that a KV-cache method can sit between them (docs/architecture.md#the-model):
``layer_qkv`` gives post-RoPE ``q [B, Hq, T, D]``, ``k, v [B, Hkv, T, D]``; the method attends; and
``layer_finish`` applies the output projection, residuals and the MLP. ``forward`` composes them with dense
causal attention and is the full-attention reference the engine and tests compare against.

Einsum axes: b batch, t query position, s key position/slot, h KV head, g query head within its group,
d head dim.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp

from kvjax.config import ModelConfig
from kvjax.model.prefill_attention import ATTENTION_CHUNK, prefill_attention
from kvjax.model.rope import apply_rope, cos_sin
from kvjax.model.sinks import current as current_sinks, layer_sinks

Params = dict[str, Any]
_CURRENT = object()


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float, style: str = "llama") -> jnp.ndarray:
    """RMSNorm computed in float32. ``style="llama"``: cast back to ``x.dtype`` before the weight (as transformers'
    Llama does); ``"gemma"``: times ``1 + weight`` in float32, then cast (Gemma 3)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if style == "gemma":
        return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * xf.astype(x.dtype)


def _norm(cfg: ModelConfig, x, weight):
    return rms_norm(x, weight, cfg.rms_norm_eps, cfg.norm_style)


def _linear(x, w, b=None):
    y = x @ w
    return y if b is None else y + b


def embed(params: Params, tokens: jnp.ndarray, cfg: ModelConfig | None = None) -> jnp.ndarray:
    """Token embeddings ``[B, T, H]`` for ``tokens [B, T]``, times sqrt(hidden_size) (in the weights' dtype) where
    ``cfg.embed_scale`` (Gemma 3). Pass the model's ``cfg``: without it no scale is applied (right for every family
    but Gemma 3)."""
    x = jnp.take(params["embed"], tokens, axis=0)
    if cfg is not None and cfg.embed_scale:
        x = x * jnp.asarray(cfg.hidden_size**0.5, x.dtype)
    return x


def _static_layer(cfg: ModelConfig, layer) -> int:
    """A layer index usable for the per-layer config (RoPE): a static int, or any layer of a model whose layers are
    alike (a traced index from a scanned loop)."""
    if isinstance(layer, int):
        return layer
    if layer is not None and cfg.layers_differ:
        raise ValueError(
            "a scanned layer loop (scan_layers=True) needs layers alike, but this model's layers differ in "
            f"window/RoPE (sliding_windows={cfg.sliding_windows}); load it with scan_layers=False"
        )
    return 0


def layer_qkv(cfg: ModelConfig, lp: Params, x: jnp.ndarray, positions: jnp.ndarray, layer=None):
    """Pre-norm, projections, QK-norm (where the config has it) and RoPE for one layer.

    x: residual stream ``[B, T, H]``; positions: ``[B, T]`` int; layer: the layer's index (its RoPE where local
    and global layers differ, Gemma 3; None: layer 0's). Returns post-RoPE ``q [B, Hq, T, D]``, ``k [B, Hkv, T, D]``
    and ``v [B, Hkv, T, D]`` in ``x.dtype``. With ``query_pre_attn_scalar`` q comes back multiplied by
    :attr:`~kvjax.config.ModelConfig.q_scale`, so that every attention's ``1/sqrt(D)`` gives the model's scale.
    """
    b, t, _ = x.shape
    h = _norm(cfg, x, lp["attn_norm"])
    q = _linear(h, lp["wq"], lp.get("bq")).reshape(b, t, cfg.num_heads, cfg.head_dim).transpose(0, 2, 1, 3)
    k = _linear(h, lp["wk"], lp.get("bk")).reshape(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(0, 2, 1, 3)
    v = _linear(h, lp["wv"], lp.get("bv")).reshape(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(0, 2, 1, 3)
    if cfg.qk_norm:
        q, k = _norm(cfg, q, lp["q_norm"]), _norm(cfg, k, lp["k_norm"])
    rope = cfg.layer_rope(_static_layer(cfg, layer))
    cos, sin = cos_sin(rope, cfg.head_dim, positions, x.dtype)
    q = apply_rope(q, cos, sin)
    if cfg.q_scale != 1.0:
        q = q * jnp.asarray(cfg.q_scale, q.dtype)
    return q, apply_rope(k, cos, sin), v


def _act(cfg: ModelConfig, gate):
    return jax.nn.gelu(gate, approximate=True) if cfg.hidden_act == "gelu_tanh" else jax.nn.silu(gate)


def moe_mlp(cfg: ModelConfig, lp: Params, h: jnp.ndarray) -> jnp.ndarray:
    """gpt-oss's mixture-of-experts MLP of ``h [..., H]``: the router's top-k experts per token, their softmax
    weights over the k logits, each expert's clamped SwiGLU ``(clip(up, -l, l) + 1) * g * sigmoid(alpha g)`` with
    ``g = min(gate, l)`` (gate and up interleaved in ``experts_gate_up``) and biases. The tokens' (token, expert)
    pairs are sorted by expert and run as grouped matmuls (``lax.ragged_dot``): each expert's weights are read once
    and only the chosen experts compute."""
    shape = h.shape
    x = h.reshape(-1, shape[-1])  # [N, H]
    e, kk = cfg.num_experts, cfg.experts_per_token
    router = (x @ lp["router"] + lp["b_router"]).astype(jnp.float32)  # [N, E]
    top, idx = jax.lax.top_k(router, kk)  # [N, k]
    weights = jax.nn.softmax(top, axis=-1).astype(x.dtype)
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    expert = flat[order]  # [N k] sorted
    token = order // kk
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = x[token]  # [N k, H]
    gu = jax.lax.ragged_dot(xs, lp["experts_gate_up"], sizes) + lp["experts_b_gate_up"][expert]
    gate, up = gu[..., ::2], gu[..., 1::2]
    gate = jnp.minimum(gate, cfg.swiglu_limit)
    up = jnp.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
    act = (up + 1) * (gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha))
    out = jax.lax.ragged_dot(act, lp["experts_down"], sizes) + lp["experts_b_down"][expert]
    out = out * weights.reshape(-1)[order][:, None]
    y = jnp.zeros_like(x).at[token].add(out.astype(x.dtype))
    return y.reshape(shape)


def mlp(cfg: ModelConfig, lp: Params, h: jnp.ndarray) -> jnp.ndarray:
    """The layer's MLP of the normed residual ``h [..., H]``: gated (SiLU or GELU-tanh), or the experts."""
    if cfg.num_experts:
        return moe_mlp(cfg, lp, h)
    gate = _linear(h, lp["w_gate"], lp.get("b_gate"))
    up = _linear(h, lp["w_up"], lp.get("b_up"))
    return _linear(_act(cfg, gate) * up, lp["w_down"], lp.get("b_down"))


def layer_finish(cfg: ModelConfig, lp: Params, x: jnp.ndarray, attn: jnp.ndarray) -> jnp.ndarray:
    """Output projection, residual, MLP. ``attn [B, Hq, T, D]`` (normalised) -> new residual ``[B, T, H]``.
    With ``post_norms`` (Gemma 3) the attention's and the MLP's outputs are normed before their residual adds."""
    b, _, t, _ = attn.shape
    o = attn.astype(x.dtype).transpose(0, 2, 1, 3).reshape(b, t, cfg.num_heads * cfg.head_dim)
    o = _linear(o, lp["wo"], lp.get("bo"))
    x = x + (_norm(cfg, o, lp["post_attn_norm"]) if cfg.post_norms else o)
    out = mlp(cfg, lp, _norm(cfg, x, lp["mlp_norm"]))
    return x + (_norm(cfg, out, lp["post_mlp_norm"]) if cfg.post_norms else out)


def logits(cfg: ModelConfig, params: Params, x: jnp.ndarray) -> jnp.ndarray:
    """Final norm and LM head: ``[B, T, H]`` -> float32 logits ``[B, T, V]`` (soft-capped, ``c tanh(z / c)``, where
    the config has ``final_logit_softcap``)."""
    h = _norm(cfg, x, params["final_norm"])
    w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    z = (h @ w).astype(jnp.float32)
    if cfg.final_logit_softcap is not None:
        z = cfg.final_logit_softcap * jnp.tanh(z / cfg.final_logit_softcap)
    return z


def causal_attention(
    q: jnp.ndarray,
    k: jnp.ndarray,
    v: jnp.ndarray,
    lengths: jnp.ndarray | None = None,
    sliding_window: int | None = None,
    chunk: int = ATTENTION_CHUNK,
    *,
    impl: str | None = None,
    sinks=_CURRENT,
) -> jnp.ndarray:
    """Causal attention with GQA (no repeated KV), softmax in float32: the prefill attention.

    q: ``[B, Hq, T, D]``; k, v: ``[B, Hkv, T, D]``; lengths: ``[B]`` valid (right-padded) prompt lengths or
    None. Query ``t`` sees keys ``s <= t`` with ``s < lengths[b]`` and, with a sliding window ``w``,
    ``t - s < w``. Returns ``[B, Hq, T, D]`` in ``q.dtype`` (rows of padded queries are meaningless, finite).
    impl: ``"chunked"`` (pure JAX: dense for ``T <= chunk``, above that query chunks with an online softmax over
    key chunks, memory linear in T), ``"cudnn"`` (GPU), ``"splash"`` (TPU) or None: ``$KVJAX_PREFILL_ATTENTION_IMPL``,
    else by backend, cuDNN only for float16/bfloat16 inputs (:mod:`kvjax.model.prefill_attention` has the rules).
    sinks: ``[Hq]`` sink logits or None; default: the sinks of the layer being run (:mod:`kvjax.model.sinks`).
    """
    sinks = current_sinks() if sinks is _CURRENT else sinks
    return prefill_attention(q, k, v, lengths, sliding_window, impl=impl, chunk=chunk, sinks=sinks)


def is_stacked(params: Params) -> bool:
    """Whether ``params["layers"]`` is the stacked layout (one dict of ``[L, ...]`` arrays) rather than a tuple of
    per-layer dicts. Both run the same model; the stacked one is what :func:`scan_layers` reads."""
    return isinstance(params["layers"], Mapping)


def stack_layers(params: Params) -> Params:
    """``params`` with its per-layer dicts stacked on a leading ``[L]`` axis (``params["layers"]`` becomes one
    dict of ``[L, ...]`` arrays; unchanged when already stacked)."""
    if is_stacked(params):
        return params
    return {**params, "layers": jax.tree.map(lambda *a: jnp.stack(a), *params["layers"])}


def unstack_layers(params: Params) -> Params:
    """The inverse of :func:`stack_layers`: ``params["layers"]`` as a tuple of per-layer dicts."""
    if not is_stacked(params):
        return params
    stacked = params["layers"]
    n = jax.tree.leaves(stacked)[0].shape[0]
    return {**params, "layers": tuple(jax.tree.map(lambda a: a[i], stacked) for i in range(n))}


def layer_params(params: Params, layer) -> Params:
    """One layer's parameter dict from either layout; ``layer`` may be traced when the layers are stacked."""
    if is_stacked(params):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False), params["layers"])
    return params["layers"][layer]


#: A prompt bucket longer than this (and a multiple of it) runs its position-wise work (norms, projections,
#: RoPE, output projection, MLP) in blocks of this many tokens, over the blocks that hold a real token only.
TOKEN_BLOCK = 512


def _token_blocks(t: int, live) -> int | None:
    """Token block size for a ``t``-token pass with ``live`` leading real tokens (None: one pass over all ``t``)."""
    return TOKEN_BLOCK if live is not None and t > TOKEN_BLOCK and t % TOKEN_BLOCK == 0 else None


def _live_blocks(live, c: int, t: int):
    return jnp.clip((jnp.asarray(live, jnp.int32) + c - 1) // c, 0, t // c)


def layer_qkv_blocks(cfg: ModelConfig, lp: Params, x: jnp.ndarray, positions: jnp.ndarray, live, c: int, layer=None):
    """:func:`layer_qkv` over ``c``-token blocks of ``x [B, T, H]``, only those before ``live`` (traced int: the
    longest sequence's real tokens). Returns q, k, v as ``layer_qkv`` does; rows of blocks past ``live`` are 0."""
    t = x.shape[1]

    def block(i):
        xs = jax.lax.dynamic_slice_in_dim(x, i * c, c, axis=1)
        return layer_qkv(cfg, lp, xs, jax.lax.dynamic_slice_in_dim(positions, i * c, c, axis=1), layer)

    # zero buffers made from a zero that depends on x (0 * (x != x), which XLA does not fold): plain zeros would
    # be allocated at the start of the program, for every layer at once
    x0 = x[0, 0, 0]
    zero = (x0 != x0).astype(x.dtype) * jnp.zeros((), x.dtype)
    shapes = jax.eval_shape(block, 0)
    bufs = tuple(jnp.full(a.shape[:2] + (t,) + a.shape[3:], zero, a.dtype) for a in shapes)

    def body(i, bufs):
        return tuple(jax.lax.dynamic_update_slice_in_dim(a, u, i * c, axis=2) for a, u in zip(bufs, block(i)))

    return jax.lax.fori_loop(0, _live_blocks(live, c, t), body, bufs)


def layer_finish_blocks(cfg: ModelConfig, lp: Params, x: jnp.ndarray, attn: jnp.ndarray, live, c: int):
    """:func:`layer_finish` over ``c``-token blocks, in place in ``x``; rows of blocks past ``live`` keep their
    input values."""
    t = x.shape[1]

    def body(i, x):
        xs = jax.lax.dynamic_slice_in_dim(x, i * c, c, axis=1)
        out = layer_finish(cfg, lp, xs, jax.lax.dynamic_slice_in_dim(attn, i * c, c, axis=2))
        return jax.lax.dynamic_update_slice_in_dim(x, out, i * c, axis=1)

    return jax.lax.fori_loop(0, _live_blocks(live, c, t), body, x)


def layer_step(cfg: ModelConfig, lp: Params, x: jnp.ndarray, positions: jnp.ndarray, attend, layer, carry, live=None):
    """One decoder layer: ``q, k, v = layer_qkv(...)``, ``attn, carry = attend(layer, x, q, k, v, carry)``,
    ``x = layer_finish(..., attn)``. Returns ``(x, carry)``. The body of both layer loops below.

    ``live`` (a prefill: traced int, the longest sequence's real tokens; None: every position counts): with a
    bucket longer than ``TOKEN_BLOCK`` tokens the position-wise work runs in blocks over the first ``live``
    tokens only (:func:`layer_qkv_blocks`, :func:`layer_finish_blocks`): bucket padding costs no projection or
    MLP work and no ``[T, intermediate]`` buffer is held. Rows past ``live`` are then meaningless (finite)."""
    c = _token_blocks(x.shape[1], live)
    with layer_sinks(lp.get("sinks")):  # the layer's attention (prefill and decode) takes its sinks
        if c is None:
            q, k, v = layer_qkv(cfg, lp, x, positions, layer)
            attn, carry = attend(layer, x, q, k, v, carry)
            return layer_finish(cfg, lp, x, attn), carry
        q, k, v = layer_qkv_blocks(cfg, lp, x, positions, live, c, layer)
        attn, carry = attend(layer, x, q, k, v, carry)
        return layer_finish_blocks(cfg, lp, x, attn, live, c), carry


def run_layers(
    cfg: ModelConfig,
    params: Params,
    x: jnp.ndarray,
    positions: jnp.ndarray,
    attend,
    carry=None,
    layers: range | None = None,
    live=None,
):
    """The layer loop, unrolled: for each layer ``q, k, v = layer_qkv(...)``, then
    ``attn, carry = attend(layer, x, q, k, v, carry)``, then ``x = layer_finish(..., attn)``.

    x: ``[B, T, H]`` residual stream (the embedded tokens); positions: ``[B, T]``; attend: a function of
    ``(layer, x [B,T,H] (the layer's input), q [B,Hq,T,D], k, v [B,Hkv,T,D], carry)`` returning the attention
    output ``[B, Hq, T, D]`` and the new carry (the engine's method states, a probe's records, ...). ``layers``
    runs a subset (default all). ``live``: see :func:`layer_step`. Either parameter layout (:func:`is_stacked`).
    Returns ``(x, carry)``.
    """
    for layer in range(cfg.num_layers) if layers is None else layers:
        x, carry = layer_step(cfg, layer_params(params, layer), x, positions, attend, layer, carry, live)
    return x, carry


def scan_layers(
    cfg: ModelConfig, params: Params, x: jnp.ndarray, positions: jnp.ndarray, attend, carry, layers: range, live=None
):
    """The layer loop as one compiled body: layers ``[start, stop)`` run by ``lax.fori_loop`` over stacked
    parameters (:func:`stack_layers`; a per-layer tuple is stacked here, which copies the weights on every call),
    so a deep model traces and compiles one layer instead of ``L``. ``attend`` is as in :func:`run_layers`, but
    ``layer`` is a traced int32 scalar and ``carry`` must keep its structure and shapes from layer to layer.
    ``live``: see :func:`layer_step`. Returns ``(x, carry)``."""
    params = stack_layers(params)

    def body(layer, c):
        return layer_step(cfg, layer_params(params, layer), c[0], positions, attend, layer, c[1], live)

    return jax.lax.fori_loop(layers.start, layers.stop, body, (x, carry))


def forward(
    cfg: ModelConfig,
    params: Params,
    tokens: jnp.ndarray,
    lengths: jnp.ndarray | None = None,
    positions: jnp.ndarray | None = None,
) -> jnp.ndarray:
    """Full forward pass with dense causal attention: ``tokens [B, T]`` -> float32 logits ``[B, T, V]``.

    The uncompressed reference: the engine with the ``full`` method must reproduce it.
    """
    b, t = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))

    def dense(layer, x, q, k, v, carry):
        return causal_attention(q, k, v, lengths, cfg.sliding_windows[layer]), carry

    x, _ = run_layers(cfg, params, embed(params, tokens, cfg), positions, dense)
    return logits(cfg, params, x)


def random_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> Params:
    """Random weights in the layout above (normal with std ``scale``; norms the identity, biases and sinks 0): a
    dummy model for benchmarks and tests whose cost, not output, matters."""
    h, d, f, e = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.num_experts
    shapes = {
        "wq": (h, cfg.num_heads * d),
        "wk": (h, cfg.num_kv_heads * d),
        "wv": (h, cfg.num_kv_heads * d),
        "wo": (cfg.num_heads * d, h),
    }
    if e:
        shapes.update(router=(h, e), experts_gate_up=(e, h, 2 * f), experts_down=(e, f, h))
    else:
        shapes.update(w_gate=(h, f), w_up=(h, f), w_down=(f, h))
    biases = {}
    if cfg.attention_bias:
        biases.update(bq=(cfg.num_heads * d,), bk=(cfg.num_kv_heads * d,), bv=(cfg.num_kv_heads * d,))
    if cfg.o_bias:
        biases["bo"] = (h,)
    if cfg.mlp_bias:
        biases.update(b_gate=(f,), b_up=(f,), b_down=(h,))
    if cfg.attention_sinks:
        biases["sinks"] = (cfg.num_heads,)
    if e:
        biases.update(b_router=(e,), experts_b_gate_up=(e, 2 * f), experts_b_down=(e, h))
    norms = {"attn_norm": h, "mlp_norm": h}
    if cfg.qk_norm:
        norms.update(q_norm=d, k_norm=d)
    if cfg.post_norms:
        norms.update(post_attn_norm=h, post_mlp_norm=h)
    identity = 0.0 if cfg.norm_style == "gemma" else 1.0  # gemma norms scale by (1 + w)
    keys = iter(jax.random.split(key, cfg.num_layers * len(shapes) + 2))

    def normal(shape):
        return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    layers = []
    for _ in range(cfg.num_layers):
        lp = {name: normal(shape) for name, shape in shapes.items()}
        lp.update({name: jnp.zeros(shape, dtype) for name, shape in biases.items()})
        lp.update({name: jnp.full((n,), identity, dtype) for name, n in norms.items()})
        layers.append(lp)
    params = {
        "embed": normal((cfg.vocab_size, h)),
        "final_norm": jnp.full((h,), identity, dtype),
        "layers": tuple(layers),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = normal((h, cfg.vocab_size))
    return params
