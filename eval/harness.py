"""Running a method on a batch of examples through the engine's public API, and the harness's input checks.

Two protocols, both greedy:

- ``generate_answers`` (question inside the compressed prompt, the SnapKV/PyramidKV needle protocol):
  ``kvjax.engine.generate`` with the Python driver, i.e. ``engine.prefill`` then the jitted
  ``engine.decode_step`` -- the same compiled functions the other tasks use when shapes agree.
- ``answer_after_context`` (kvpress's protocol, used by the RULER tasks: the context is compressed, the
  question is not): ``engine.prefill`` on the context only, then the question tokens are teacher-forced
  through ``engine.decode_step`` (appended as decode tokens: the prompt-compressing methods keep them whole,
  the evicting ones treat them like any generated token), then greedy decoding.

Shapes are fixed per (method, batch, bucket, ``Capacity``): the runner pads every batch to the same size and
uses one bucket per task, so each (method, bucket) compiles ``prefill`` and ``decode_step`` once.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np

from kvjax import engine, methods
from kvjax.methods.base import Capacity


def check_methods(names: Sequence[str]) -> list[str]:
    """Registered method names, in order; a ValueError naming the unknown one otherwise."""
    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise ValueError("methods is empty; pass e.g. --methods full,snapkv")
    for n in names:
        if n not in methods.REGISTRY:
            raise ValueError(f"method={n!r} is not registered; choose from {', '.join(methods.names())}")
    return names


def check_budgets(budgets: Sequence[float]) -> list[float]:
    """Budgets as fractions of each prompt in (0, 1]; anything else is a ValueError (nothing is clipped)."""
    out = []
    for b in budgets:
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 < float(b) <= 1.0:
            raise ValueError(f"budget={b!r} must be a fraction of the context in (0, 1], e.g. --budgets 0.2,0.5")
        out.append(float(b))
    if not out:
        raise ValueError("budgets is empty; pass e.g. --budgets 0.2,0.5")
    return out


def method_grid(names: Sequence[str], budgets: Sequence[float]) -> list[tuple[str, float | None]]:
    """(method, budget) pairs: ``full`` once (budget None), every other method at every budget."""
    names, budgets = check_methods(names), check_budgets(budgets)
    grid = []
    for n in names:
        grid.extend([(n, None)] if n == "full" else [(n, b) for b in budgets])
    return grid


def make_method(name: str, budget: float | None):
    return methods.get(name) if budget is None else methods.get(name, budget=budget)


def check_context(model, length: int, extra: int, what: str = "lengths"):
    """A context of ``length`` tokens plus ``extra`` decode tokens must fit the model's context."""
    limit = model.config.max_position_embeddings
    if length + extra > limit:
        raise ValueError(f"{what}: a context of {length} tokens (+{extra} question/answer tokens) is longer than "
                         f"the model's context of {limit} tokens; use shorter {what}")


def pad_batch(items: list, batch: int) -> tuple[list, int]:
    """Pad ``items`` to ``batch`` by repeating the last one (fixed batch shape); returns (padded, real count)."""
    if not items or len(items) > batch:
        raise ValueError(f"a batch must hold 1..{batch} items, got {len(items)}")
    return items + [items[-1]] * (batch - len(items)), len(items)


def _eos(model) -> set[int]:
    ids = set(model.config.eos_token_ids)
    if model.tokenizer is not None:
        ids |= set(model.tokenizer.eos_token_ids)
    return ids


def generate_answers(model, method, prompts: list[list[int]], bucket: int, max_new_tokens: int) -> list[str]:
    """Greedy answers to whole prompts (token ids), each compressed by ``method`` at prefill."""
    out = engine.generate(model, prompts, method, max_new_tokens, driver="python", prompt_len=bucket)
    return [t or "" for t in out.text]


def answer_after_context(model, method, contexts: list[list[int]], questions: list[list[int]], bucket: int,
                         max_new_tokens: int, capacity_new: int | None = None) -> list[str]:
    """kvpress protocol: compress ``contexts`` at prefill, then feed ``questions`` uncompressed, then answer.

    contexts, questions: token ids per sequence (same count). ``capacity_new`` (default: longest question +
    ``max_new_tokens``) is the decode capacity; pass a fixed value to share compiled shapes across batches.
    Returns the decoded answers (up to EOS or ``max_new_tokens`` tokens); token id lists for a model loaded
    without a tokenizer.
    """
    cfg = model.config
    b = len(contexts)
    longest_q = max(len(q) for q in questions)
    cap_new = capacity_new or longest_q + max_new_tokens
    if longest_q + max_new_tokens > cap_new:
        raise ValueError(f"capacity_new={cap_new} is smaller than the longest question ({longest_q}) + "
                         f"max_new_tokens ({max_new_tokens})")
    lengths = [len(c) for c in contexts]
    if max(lengths) > bucket:
        raise ValueError(f"a context of {max(lengths)} tokens is longer than bucket={bucket}; raise the bucket")
    check_context(model, max(lengths), cap_new)
    tokens = np.zeros((b, bucket), np.int32)
    for i, c in enumerate(contexts):
        tokens[i, : len(c)] = c
    states = engine.init_states(cfg, method, b, Capacity(bucket, cap_new), model.dtype)
    states, logits = engine.prefill(cfg, method, model.params, jnp.asarray(tokens), jnp.asarray(lengths), states)
    eos = _eos(model)
    answers: list[list[int]] = [[] for _ in range(b)]
    done = [False] * b
    pos = np.asarray(lengths, np.int32)
    for step in range(cap_new):
        greedy = np.asarray(jnp.argmax(logits, axis=-1))
        feed = np.zeros(b, np.int32)
        for i in range(b):
            if step < len(questions[i]):
                feed[i] = questions[i][step]
                continue
            tok = int(greedy[i])
            if not done[i]:
                if tok in eos or len(answers[i]) >= max_new_tokens:
                    done[i] = True
                else:
                    answers[i].append(tok)
            feed[i] = tok
        if all(done) or step == cap_new - 1:
            break
        logits, states = engine.decode_step(cfg, method, model.params, states, jnp.asarray(feed), jnp.asarray(pos))
        pos = pos + 1
    return answers if model.tokenizer is None else [model.tokenizer.decode(a) for a in answers]
