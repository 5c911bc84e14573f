"""Learned attention sinks (gpt-oss): one logit per query head that enters every attention softmax as an extra
term of its denominator, ``softmax([q·k_1/√D, ..., q·k_S/√D, sink])[:S]`` — a virtual slot with a zero value.

Because decode attention returns partials ``(o, m, l)`` (docs/architecture.md#kernels-return-partials), a sink is
one more partial, ``(0, sink, 1)``, merged before normalising: ``o / (l + exp(sink - m))``, exact whatever
kernel produced the partials (the Pallas decode kernels, their references, a method's own gathers). So no kernel
and no method changes: :func:`kvjax.model.attention.normalise` and the prefill attention take the sinks of the layer
being run.

The layer loop (:func:`kvjax.model.layer_step`) runs each layer's attention inside ``with layer_sinks(lp["sinks"])``
(``[Hq]`` float, traced; None for a model without sinks), a scope that lasts while that layer is traced: a method's
``decode`` that calls ``attention.normalise`` on its partials gets them without an argument. Code that normalises a
subset of heads passes ``sinks=`` itself (:func:`current` gives the layer's).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax.numpy as jnp

_SINKS: contextvars.ContextVar = contextvars.ContextVar("kvjax_layer_sinks", default=None)


@contextlib.contextmanager
def layer_sinks(logits):
    """Within the block, :func:`current` is ``logits`` (``[Hq]``, or None: no sinks)."""
    token = _SINKS.set(logits)
    try:
        yield
    finally:
        _SINKS.reset(token)


def current():
    """The sink logits ``[Hq]`` of the layer being traced, or None."""
    return _SINKS.get()


def normalise_with_sinks(partial, sinks) -> jnp.ndarray:
    """``o / (l + exp(sink - m))`` per query head, computed around ``max(m, sink)``: partials ``(o [B, Hq, D],
    m [B, Hq], l [B, Hq])``, sinks ``[Hq]`` -> ``[B, Hq, D]`` float32 (zero where no slot took part)."""
    o, m, l = partial
    if sinks.shape != m.shape[-1:]:
        raise ValueError(
            f"sinks of shape {tuple(sinks.shape)} do not match the partials' {m.shape[-1]} query heads; pass "
            "the sinks of the heads being normalised (sinks=kvjax.model.sinks.current()[heads])"
        )
    s = sinks.astype(jnp.float32)
    top = jnp.maximum(m, s)
    c = jnp.exp(m - top)
    denom = l * c + jnp.exp(s - top)
    return o * (c / denom)[..., None]


def sink_lse(m, l, sinks):
    """``log(l exp(m) + exp(sink))``: the log-sum-exp of the attended scores with the sink's term (``m, l [B, Hq]``;
    sinks ``[Hq]`` or None, then ``m + log l``)."""
    lse = m + jnp.log(l)
    return lse if sinks is None else jnp.logaddexp(lse, sinks.astype(jnp.float32))
