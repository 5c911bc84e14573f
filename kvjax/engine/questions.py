"""One compressed context, many questions.

A compressed context is a value (the method's per-layer states: fixed-shape pytrees), so several questions can
continue from the same one. kvpress's pipeline answers every question of a context from one compression; here:

    ctx = kvjax.engine.questions.compress_context(model, context, method, max_new_tokens=80)  # prefill + compress, once
    res = kvjax.engine.questions.answer(model, ctx, ["Q1 ...", "Q2 ..."], max_new_tokens=32)   # every question, batched

:func:`compress_context` runs the model's prefill of the context (batch 1) and the method's compression, once.
:func:`answer` repeats those states over the questions' batch (an array copy per question: each question then
appends its own tokens) and runs one compiled loop (``lax.while_loop``) over the jitted decode step that first
teacher-forces each question's tokens (uncompressed, appended as decode tokens, kvpress's protocol: the
prompt-compressing methods keep them whole, the evicting ones treat them as any new token) and then samples its
answer, each sequence on its own schedule: questions of different lengths share the batch, a short one starts
answering while a long one is still being read. The context itself is never donated, so it answers any number of
batches. The tokens are those of compressing the context for each question separately
(:func:`eval.harness.answer_after_context` per question; tests/kvjax/test_questions.py).

``max_new_tokens`` of :func:`compress_context` is the decode capacity the states are built for: the longest question
plus the longest answer must fit it (a method under a decode budget holds the same whatever it is).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.engine import core
from kvjax import engine
from kvjax import model as M
from kvjax.methods.base import Capacity
from kvjax.engine.sampling import Greedy
from kvjax.sharding import BATCH


@struct.dataclass
class Context:
    """A compressed context: the method's per-layer states of one sequence (batch 1) and the prefill's last-token
    logits ``[1, V]``. Static: the method (as planned for the model), the context length, the capacity the states
    were built for, the prefill seconds."""

    states: Any
    logits: jnp.ndarray
    method: Any = struct.field(pytree_node=False)
    length: int = struct.field(pytree_node=False)
    capacity: Capacity = struct.field(pytree_node=False)
    prefill_seconds: float = struct.field(pytree_node=False, default=0.0)


def compress_context(model, context, method=None, *, max_new_tokens: int = 256, prompt_len: int | None = None):
    """Prefill and compress ``context`` (a string, tokenized without a chat template, or token ids) once with
    ``method`` (a config or a registered name; default ``full``), for questions and answers of up to
    ``max_new_tokens`` tokens together. Returns a :class:`Context`."""
    if model.mesh is not None:
        raise ValueError("compress_context runs on one device; load the model without a mesh")
    cfg = model.config
    method = core.as_run(cfg, method)  # normalised once: what follows runs it as planned
    ids = engine.prepare_prompts(model, [context] if isinstance(context, str) else [list(context)])
    n = len(ids[0])
    bucket = prompt_len or engine.bucket_length(n)
    engine.check_capacity(cfg, [n], bucket, max_new_tokens)
    engine.check_method(cfg, method)
    tokens, lengths = engine.pad_prompts(ids, bucket)
    capacity = Capacity(bucket, max_new_tokens)
    states = engine.init_states(cfg, method, 1, capacity, model.dtype, scan_layers=M.is_stacked(model.params))
    t0 = time.perf_counter()
    states, logits = engine.prefill(cfg, method, model.params, jnp.asarray(tokens), jnp.asarray(lengths), states)
    jax.block_until_ready(logits)
    return Context(states, logits, method, n, capacity, time.perf_counter() - t0)


def repeat_states(method, states, count: int):
    """``states`` of one sequence repeated to ``count`` sequences along each leaf's batch axis (the method's
    ``state_axes``; a leaf without one, such as ClusterKV's window count, is shared). New arrays: the result can be
    donated while ``states`` stays valid."""
    out = []
    for layer_state, (start, m) in zip(states, _segment_methods(method, states)):
        stacked = isinstance(layer_state, core.Stacked)
        st = layer_state.state if stacked else layer_state
        one = jax.tree.map(lambda a: a[0], st) if stacked else st
        axes = m.state_axes(one)
        lead = 1 if stacked else 0

        def rep(x, names, lead=lead):
            if tuple(names)[:1] == (BATCH,) and count > 1:
                return jnp.repeat(x, count, axis=lead)
            return jnp.array(x, copy=True)  # a new buffer, donated in place of the context's

        new = jax.tree.map(rep, st, axes, is_leaf=lambda x: isinstance(x, tuple) and not hasattr(x, "shape"))
        out.append(layer_state.replace(state=new) if stacked else new)
    return tuple(out)


def _segment_methods(method, states):
    layer = 0
    for st in states:
        yield layer, method.at(layer)
        layer = st.stop if isinstance(st, core.Stacked) else layer + 1


@dataclasses.dataclass(frozen=True)
class AnswerLoop:
    """Static description of :func:`answer_loop` (hashable: part of the jit cache key)."""

    cfg: Any
    method: Any
    sampling: Any
    max_new_tokens: int
    eos: tuple[int, ...]


@functools.partial(jax.jit, static_argnames=("loop",), donate_argnames=("states",))
def answer_loop(loop: AnswerLoop, params, states, questions, qlen, pos, key):
    """Teacher-force ``questions [Q, F]`` (``qlen [Q]`` tokens each, from position ``pos [Q]``), then sample up to
    ``max_new_tokens`` per sequence: ``(answers [Q, max_new_tokens], answered [Q], steps, states)``. Step ``t`` feeds
    token ``t`` of the question while ``t < qlen``, else the last sampled token; the logits of step ``t >= qlen - 1``
    give answer token ``t - qlen + 1``."""
    core.TRACE_COUNTS["answer_loop"] += 1
    q, f = questions.shape
    n = loop.max_new_tokens
    limit = f + n - 1
    rows = jnp.arange(q)

    def body(c):
        states, tok, pos, t, done, key, out, count = c
        logits, states = core.decode_step(loop.cfg, loop.method, params, states, tok, pos)
        key, sub = jax.random.split(key)
        sampled = loop.sampling(logits, sub)
        g = t - (qlen - 1)  # the answer token these logits give (negative: still reading the question)
        write = (g >= 0) & ~done
        out = out.at[rows, jnp.where(write, g, n)].set(sampled, mode="drop")
        count = count + write.astype(jnp.int32)
        eos = jnp.isin(sampled, jnp.asarray(loop.eos, jnp.int32)) if loop.eos else jnp.zeros_like(done)
        done = done | (write & (eos | (count >= n)))
        nxt = jnp.where(t + 1 < qlen, questions[rows, jnp.minimum(t + 1, f - 1)], sampled)
        return states, nxt, pos + 1, t + 1, done, key, out, count

    init = (
        states,
        questions[:, 0],
        pos,
        jnp.int32(0),
        jnp.zeros((q,), bool),
        key,
        jnp.zeros((q, n), jnp.int32),
        jnp.zeros((q,), jnp.int32),
    )
    states, _, _, t, _, _, out, count = jax.lax.while_loop(lambda c: (c[3] < limit) & ~jnp.all(c[4]), body, init)
    return out, count, t, states


def answer(
    model,
    ctx: Context,
    questions,
    max_new_tokens: int = 64,
    sampling=None,
    *,
    chat: bool | None = None,
    stop_at_eos: bool = True,
    seed: int = 0,
) -> engine.Result:
    """Answers to ``questions`` (strings, tokenized with the chat template if ``chat`` and without special tokens
    otherwise, or token id lists, at least one token each) continuing from the compressed context ``ctx``, all in one
    batch: the question's tokens are teacher-forced after the context, then up to ``max_new_tokens`` are sampled
    (greedy by default). Returns an :class:`kvjax.engine.Result` (``stats``: per question, as ``generate``'s;
    ``prompt_tokens`` the context's plus the question's, ``prefill_seconds`` the context's compression, shared).
    ``chat=None`` (the default) follows the model: the chat template where its tokenizer has one (an instruct
    model), raw text otherwise; with ``chat=False`` on a model that has one, an empty answer warns
    (:class:`kvjax.engine.ChatTemplateWarning`)."""
    cfg = model.config
    if chat is None:
        chat = model.tokenizer is not None and model.tokenizer.chat_template is not None
    sampling = sampling or Greedy()
    if isinstance(questions, str) or (questions and isinstance(questions[0], int)):
        questions = [questions]
    ids = []
    for qs in questions:
        if isinstance(qs, str):
            if model.tokenizer is None:
                raise ValueError("questions are strings but this model has no tokenizer; pass token id lists")
            ids.append(
                model.tokenizer.encode_chat([{"role": "user", "content": qs}])
                if chat
                else model.tokenizer.encode(qs, add_special_tokens=False)
            )
        else:
            ids.append([int(i) for i in qs])
        if not ids[-1]:
            raise ValueError("an empty question: give each question at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    longest = max(len(x) for x in ids)
    if longest + max_new_tokens > ctx.capacity.max_new_tokens:
        raise ValueError(
            f"the longest question ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceed the context's "
            f"capacity of {ctx.capacity.max_new_tokens} decode tokens; pass compress_context(..., "
            f"max_new_tokens={longest + max_new_tokens}) or shorter questions"
        )
    q = len(ids)
    qtok = np.zeros((q, longest), np.int32)
    for i, x in enumerate(ids):
        qtok[i, : len(x)] = x
    qlen = np.asarray([len(x) for x in ids], np.int32)
    method = ctx.method
    states = repeat_states(method, ctx.states, q)
    eos = engine.eos_ids(model) if stop_at_eos else ()
    loop = AnswerLoop(cfg, method, sampling, max_new_tokens, eos)
    held_prefill = np.repeat(engine.tokens_held(method, ctx.states), q)
    t1 = time.perf_counter()
    out, count, steps, states = answer_loop(
        loop,
        model.params,
        states,
        jnp.asarray(qtok),
        jnp.asarray(qlen),
        jnp.full((q,), ctx.length, jnp.int32),
        jax.random.PRNGKey(seed),
    )
    out, count, steps = np.asarray(out), np.asarray(count), int(steps)
    t2 = time.perf_counter()
    seconds = dict(prefill_seconds=ctx.prefill_seconds, decode_seconds=t2 - t1)
    lengths = [ctx.length + len(x) for x in ids]
    end = engine.measure(method, states, cfg.num_heads)
    res = engine.make_result(model, method, out, max_new_tokens, eos, lengths, held_prefill, end, seconds)
    for st, c in zip(res.stats, count):
        st["decode_steps"] = steps
        st["question_tokens"] = st["prompt_tokens"] - ctx.length
    engine.warn_without_chat(model, questions, chat, res.text)
    return res
