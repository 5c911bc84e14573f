"""One prefill of the model, compressed by many methods.

Every method's prefill runs the same model on the same prompt with exact causal attention; methods differ only in
what they keep of each layer's ``q, k, v`` (``Method.prefill``). A comparison of N methods on the same batch
(``kvjax-eval``) therefore needs the model's prefill once, not N times:

    pre = prefilled.prefill_once(model, tokens, lengths)     # the model: last-token logits, every layer's q, k, v
    states = prefilled.compress(cfg, method, pre, states)    # one method: its prefill of each layer, no model work
    engine.generate(model, prompts, method, prefilled=pre)   # the same, inside generate

``compress`` gives the states and logits that ``engine.prefill`` gives for the same batch (same code per layer; the
float summation order of the model's part may differ between the two compiled programs, so values agree to
rounding, not bit for bit). The price is memory: :class:`Prefilled` holds ``L x B x (Hq + 2 Hkv) x T x D``
values (:func:`nbytes`), e.g. 295 MB for SmolLM2 at 5 x 512 tokens in float32. Not for a mesh (one device).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax import model as M
from kvjax.config import ModelConfig
from kvjax.engine.core import TRACE_COUNTS, Stacked, method_prefill, plan, segment_previous, sliding_window


@struct.dataclass
class Prefilled:
    """The model's prefill of one padded batch, before any method.

    tokens ``[B, T]`` int32 (right-padded), lengths ``[B]`` int32, logits ``[B, V]`` at each last prompt token,
    q ``[L, B, Hq, T, D]`` and k, v ``[L, B, Hkv, T, D]`` every layer's projections after RoPE (rows past the
    longest prompt are zero)."""

    tokens: jnp.ndarray
    lengths: jnp.ndarray
    logits: jnp.ndarray
    q: jnp.ndarray
    k: jnp.ndarray
    v: jnp.ndarray


def nbytes(cfg: ModelConfig, batch: int, prompt_len: int, dtype) -> int:
    """Bytes a :class:`Prefilled` of ``batch`` prompts in a ``prompt_len`` bucket holds (its q, k, v)."""
    heads = cfg.num_heads + 2 * cfg.num_kv_heads
    return cfg.num_layers * batch * heads * prompt_len * cfg.head_dim * jnp.dtype(dtype).itemsize


def _capture(cfg: ModelConfig, params, tokens, lengths) -> Prefilled:
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    x = M.embed(params, tokens, cfg)
    shapes = jax.eval_shape(lambda: M.layer_qkv(cfg, M.layer_params(params, 0), x, positions))
    bufs = tuple(jnp.zeros((cfg.num_layers,) + a.shape, a.dtype) for a in shapes)

    def attend(layer, x, q, k, v, bufs):
        bufs = tuple(jax.lax.dynamic_update_index_in_dim(buf, a, layer, 0) for buf, a in zip(bufs, (q, k, v)))
        return M.causal_attention(q, k, v, lengths, sliding_window(cfg, layer)), bufs

    live = jnp.max(lengths)
    if M.is_stacked(params):
        x, bufs = M.scan_layers(cfg, params, x, positions, attend, bufs, range(cfg.num_layers), live)
    else:
        x, bufs = M.run_layers(cfg, params, x, positions, attend, bufs, None, live)
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)
    return Prefilled(tokens, lengths, M.logits(cfg, params, last)[:, 0], *bufs)


_capture_jit = jax.jit(_capture, static_argnums=0)


def prefill_once(model, tokens, lengths) -> Prefilled:
    """The model's prefill of ``tokens [B, T]`` (right-padded, ``lengths [B]``), for :func:`compress`."""
    if model.mesh is not None:
        raise ValueError(
            "prefill_once keeps every layer's q, k, v on one device; it does not take a model "
            "loaded with a mesh (use engine.prefill per method)"
        )
    return _capture_jit(model.config, model.params, jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32))


def _compress(cfg: ModelConfig, method, pre: Prefilled, states) -> tuple:
    TRACE_COUNTS["compress"] += 1
    layers = plan(cfg, method)

    def one(m, layer, st, q, k, v, previous):  # what core.prefill's step does with the layer's q, k, v
        return method_prefill(cfg, m, layer, st, q, k, v, pre.lengths, previous)[1]

    new, prev, layer = [], None, 0
    for st in states:
        m = layers.at(layer)  # the layer's method (a scanned segment's layers share it)
        reuse = m.reuses_previous_layer
        prev = prev if layers.same_as_previous(layer) else None
        if not isinstance(st, Stacked):
            prev = one(m, layer, st, pre.q[layer], pre.k[layer], pre.v[layer], prev if reuse else None)
            new.append(prev)
            layer += 1
            continue

        def body(before, xs, m=m, reuse=reuse):
            layer, one_st, q, k, v = xs
            out = one(m, layer, one_st, q, k, v, before)
            return (out if reuse else None), out

        span = slice(st.start, st.stop)
        prev, stack = jax.lax.scan(
            body,
            segment_previous(st, prev, reuse),
            (jnp.arange(st.start, st.stop), st.state, pre.q[span], pre.k[span], pre.v[span]),
        )
        new.append(st.replace(state=stack))
        layer = st.stop
    return tuple(new)


_compress_jit = jax.jit(_compress, static_argnums=(0, 1), donate_argnums=(3,))


def compress(cfg: ModelConfig, method, pre: Prefilled, states) -> tuple:
    """``method``'s states after its prefill of ``pre``'s batch: what ``engine.prefill(cfg, method, params,
    pre.tokens, pre.lengths, states)`` returns as states (its logits are ``pre.logits``). ``states`` (from
    ``engine.init_states`` for the same batch and bucket) is donated."""
    return _compress_jit(cfg, method, pre, states)


def same_batch(pre: Prefilled, tokens: np.ndarray, lengths: np.ndarray) -> bool:
    """Whether ``pre`` is the prefill of exactly this padded batch."""
    return (
        tuple(pre.tokens.shape) == tuple(tokens.shape)
        and np.array_equal(np.asarray(pre.lengths), lengths)
        and np.array_equal(np.asarray(pre.tokens), tokens)
    )
