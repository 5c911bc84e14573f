"""Streaming perplexity of held-out text under a compressed cache (the LESS and ClusterKV papers' setting:
the cache is compressed as the text is consumed).

Each sequence is ``prefix + continuation`` tokens of a King James Bible book (held out from the needle's
essays), or of the Paul Graham essays (``book="essays"``: long-text perplexity on a second kind of text). The
prefix is prefilled through ``kvjax.engine.prefill`` (where prompt-compressing methods such as SnapKV/PyramidKV
compress it once, to ``budget`` of the prefix); the continuation is then **teacher-forced**
through the jitted, fixed-shape ``kvjax.engine.decode_step``, one token per step, so evicting methods
(StreamingLLM, H2O) keep compressing as the text streams in and appending methods keep every new token.
Each continuation token is scored by the log-probability the model gave it at the previous step (the first
one from the prefill logits). Perplexity = ``exp(mean NLL)`` over all scored tokens.

On a sharded model (``model.mesh``, :mod:`kvjax.sharding`) the sequences are split over ``data`` and the states
created on the mesh, so the same compiled steps run sharded (the batch must be a multiple of the ``data`` size).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.loading import assets
from kvjax import engine
from kvjax import model as M
from kvjax import sharding as S
from kvjax.methods.base import Capacity
from kvjax.engine.prefilled import compress, same_batch


#: ``book`` naming the Paul Graham essays (the needle task's haystack) instead of a King James book
ESSAYS = "essays"


@functools.lru_cache(maxsize=2)
def _bible_ids(tokenizer, book: str) -> tuple[int, ...]:
    """The token ids of a King James ``book``, or of every essay when ``book`` is :data:`ESSAYS`."""
    return tuple(tokenizer.encode(assets.essays_text() if book == ESSAYS else assets.bible_text(book)))


def build(model, num_sequences: int, prefix: int, continuation: int, book: str = "John") -> np.ndarray:
    """``[num_sequences, prefix + continuation]`` int32 windows of consecutive text (no overlap)."""
    if model.tokenizer is None:
        raise ValueError("the perplexity task needs a model loaded with its tokenizer")
    if prefix < 1 or continuation < 2:
        raise ValueError(f"prefix={prefix} must be >= 1 and continuation={continuation} >= 2 tokens")
    ids = _bible_ids(model.tokenizer, book)
    n = prefix + continuation
    if num_sequences * n > len(ids):
        raise ValueError(
            f"{num_sequences} sequences of {n} tokens need {num_sequences * n} tokens but book={book!r} "
            f"has {len(ids)}; use fewer/shorter sequences or a longer book (e.g. 'Genesis', or 'essays')"
        )
    return np.asarray(ids[: num_sequences * n], np.int32).reshape(num_sequences, n)


@jax.jit
def _logprob(logits, target):
    """log p(target) ``[B]`` from logits ``[B, V]``."""
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), target[:, None], axis=-1)[:, 0]


def streaming_nll(
    model, method, seqs: np.ndarray, prefix: int, memory: bool = False, prefilled=None, memory_at=(), on_phase=None
):
    """Negative log-likelihoods ``[B, N]`` of the ``N = T - prefix`` continuation tokens of ``seqs [B, T]``.

    Shapes are fixed: prefill at bucket ``prefix`` (every sequence has the same prefix length) and
    ``Capacity(prefix, N)``; ``N - 1`` decode steps, all through the same compiled ``decode_step``.
    With ``memory=True``: ``(nll, memory rows)`` (:func:`eval.harness.memory_rows` of the final states).
    ``prefilled``: the model's prefill of ``seqs[:, :prefix]`` (:func:`kvjax.engine.prefilled.prefill_once`), which the
    method then only compresses. ``memory_at`` (with ``memory=True``): continuation lengths ``L`` at which the
    memory rows are also read (after the ``L``-th token is scored, ``L - 1`` decode steps); the result is then
    ``(nll, rows, {L: rows})``. ``on_phase``: called with what runs next (``"prefill"`` or ``"compress"``, then
    ``"decode i/N"``), for a progress line inside a long continuation.
    """
    cfg = model.config
    b, t = seqs.shape
    n = t - prefix
    if n < 1:
        raise ValueError(f"sequences of {t} tokens have no continuation after prefix={prefix}")
    if t > cfg.max_position_embeddings:
        raise ValueError(
            f"prefix + continuation = {t} tokens is longer than the model's context of "
            f"{cfg.max_position_embeddings}; use a shorter prefix/continuation"
        )
    mesh = model.mesh
    if prefilled is not None and not same_batch(prefilled, np.asarray(seqs)[:, :prefix], np.full((b,), prefix)):
        raise ValueError(
            f"prefilled= is not the prefill of these sequences' {prefix}-token prefixes; pass "
            "kvjax.engine.prefilled.prefill_once(model, seqs[:, :prefix], lengths)"
        )
    seqs = S.put_batch(jnp.asarray(seqs, jnp.int32), mesh)
    method = engine.as_run(cfg, method)  # a hybrid model: ring buffers on its local layers (kvjax.methods.plans.hybrid)
    states = engine.init_states(
        cfg, method, b, Capacity(prefix, n), model.dtype, mesh, scan_layers=M.is_stacked(model.params)
    )
    lengths = S.put_batch(jnp.full((b,), prefix, jnp.int32), mesh)
    phase = on_phase or (lambda _: None)
    phase("prefill" if prefilled is None else "compress")
    if prefilled is None:
        states, logits = engine.prefill(cfg, method, model.params, seqs[:, :prefix], lengths, states, mesh=mesh)
    else:
        states, logits = compress(cfg, method, prefilled, states), prefilled.logits
    from eval.harness import memory_rows

    out = [_logprob(logits, seqs[:, prefix])]
    at = {}
    for i in range(1, n):
        if memory and i in memory_at:  # i tokens scored, i - 1 decode steps
            at[i] = memory_rows(method, states, num_heads=cfg.num_heads)
        phase(f"decode {i}/{n - 1}")
        logits, states = engine.decode_step(
            cfg, method, model.params, states, seqs[:, prefix + i - 1], lengths + i - 1, mesh=mesh
        )
        out.append(_logprob(logits, seqs[:, prefix + i]))
    nll = -S.to_host(jnp.stack(out, axis=1))
    if not memory:
        return nll
    rows = memory_rows(method, states, num_heads=cfg.num_heads)
    if memory_at:
        at[n] = rows
        return nll, rows, at
    return nll, rows


def perplexity(nll: np.ndarray) -> float:
    return float(np.exp(np.mean(nll)))
