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

On a sharded model (``model.mesh``) both protocols run sharded: ``engine.generate`` uses the mesh itself, and
``answer_after_context`` creates its states on the mesh and places every batch array over ``data``. The
equal-bytes sizing (:func:`held_at_end`, :func:`bytes_per_seq`) reads state shapes only, the same with or without a
mesh.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from kvjax import engine, methods
from kvjax import model as M
from kvjax import sharding as S
from kvjax.budget import check_budget, check_distinct
from kvjax.methods.base import Capacity


def check_methods(names: Sequence[str]) -> list[str]:
    """Registered method names, in order; a ValueError naming the unknown one otherwise."""
    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise ValueError("methods is empty; pass e.g. --methods full,snapkv")
    for n in names:
        if n not in methods.REGISTRY:
            raise ValueError(
                f"method={n!r} is not registered; choose from {', '.join(methods.names())}, or load your own "
                "with --plugin MODULE_OR_FILE"
            )
    return names


def check_budgets(budgets: Sequence, max_tokens: int | None = None) -> list:
    """Budgets as :func:`kvjax.budget.check_budget` defines them: a fraction of each prompt in (0, 1] (a float)
    or a token count >= 1 (an int; at most ``max_tokens``, the model context, when given), each once
    (:func:`kvjax.budget.check_distinct`). Anything else is a ValueError naming ``--budgets`` (nothing is clipped)."""
    out = [check_budget(b, "--budgets", max_tokens=max_tokens) for b in budgets]
    if not out:
        raise ValueError("budgets is empty; pass e.g. --budgets 0.2,0.5 or 0.2,256")
    check_distinct(out, "--budgets")
    return out


def method_grid(names: Sequence[str], budgets: Sequence, max_tokens: int | None = None) -> list[tuple[str, Any]]:
    """(method, budget) pairs: ``full`` once (budget None), every other method at every budget."""
    names, budgets = check_methods(names), check_budgets(budgets, max_tokens)
    grid = []
    for n in names:
        grid.extend([(n, b) for b in budgets] if methods.takes_budget(n) else [(n, None)])
    return grid


def make_method(name: str, budget=None, options: dict | None = None):
    """The registered method ``name`` at ``budget`` (a fraction or a token count; None: its default), with its
    other config ``options`` (``kvjax-eval --option``; None: the defaults)."""
    if budget is None:
        return methods.get(name, **(options or {}))
    return methods.get(name, **(options or {}), budget=check_budget(budget, "--budgets"))


def memory_rows(method, states, batch: int | None = None, num_heads: int | None = None) -> list[dict]:
    """Per sequence, measured on ``states``: ``tokens_held`` (mean over layers and KV heads), ``held_bytes``
    (:func:`kvjax.engine.held_bytes`: what the sequence holds now), ``cache_bytes`` (the batch's allocated
    :func:`kvjax.engine.memory_bytes` / B), ``kib_per_seq`` (the allocated size in KiB) and, with ``num_heads``,
    ``bytes_read_per_step`` (the next decode step's reads / B). The first ``batch`` sequences (default all)."""
    held, held_b, allocated, read = engine.measure(method, states, num_heads)
    b = len(held)
    per_seq = allocated // b
    read = None if read is None else read // b
    return [
        {
            "tokens_held": float(h),
            "held_bytes": int(hb),
            "cache_bytes": per_seq,
            "kib_per_seq": per_seq / 1024,
            "bytes_read_per_step": read,
        }
        for h, hb in zip(held[: batch or b], held_b)
    ]


def memory_from_stats(stats: dict) -> dict:
    """The same fields from one ``engine.generate`` stats dict."""
    return {
        "tokens_held": float(stats["tokens_held"]),
        "held_bytes": stats.get("held_bytes"),
        "cache_bytes": int(stats["cache_bytes"]),
        "kib_per_seq": stats["cache_bytes"] / 1024,
        "bytes_read_per_step": stats.get("bytes_read_per_step"),
    }


def check_context(model, length: int, extra: int, what: str = "lengths"):
    """A context of ``length`` tokens plus ``extra`` decode tokens must fit the model's context."""
    limit = model.config.max_position_embeddings
    if length + extra > limit:
        raise ValueError(
            f"{what}: a context of {length} tokens (+{extra} question/answer tokens) is longer than "
            f"the model's context of {limit} tokens; use shorter {what}"
        )


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


def generate_answers(model, method, prompts: list[list[int]], bucket: int, max_new_tokens: int, memory: bool = False):
    """Greedy answers to whole prompts (token ids), each compressed by ``method`` at prefill. With
    ``memory=True``: ``(answers, memory rows)`` (:func:`memory_from_stats` per prompt)."""
    out = engine.generate(model, prompts, method, max_new_tokens, driver="python", prompt_len=bucket)
    answers = [t or "" for t in out.text]
    return (answers, [memory_from_stats(st) for st in out.stats]) if memory else answers


def answer_after_context(
    model,
    method,
    contexts: list[list[int]],
    questions: list[list[int]],
    bucket: int,
    max_new_tokens: int,
    capacity_new: int | None = None,
    memory: bool = False,
    prefilled=None,
    on_phase=None,
):
    """kvpress protocol: compress ``contexts`` at prefill, then feed ``questions`` uncompressed, then answer.

    contexts, questions: token ids per sequence (same count). ``capacity_new`` (default: longest question +
    ``max_new_tokens``) is the decode capacity; pass a fixed value to share compiled shapes across batches.
    Returns the decoded answers (up to EOS or ``max_new_tokens`` tokens); token id lists for a model loaded
    without a tokenizer. With ``memory=True``: ``(answers, memory rows)`` (:func:`memory_rows` of the final
    states). ``prefilled``: the model's prefill of these very contexts padded to ``bucket``
    (:func:`kvjax.engine.prefilled.prefill_once`), which ``method`` then only compresses (one prefill for many methods).
    ``on_phase``: called with what runs next (``"prefill"`` or ``"compress"``, which compile on a configuration's first
    batch, then ``"decode i/n"``), for a progress display.
    """
    cfg = model.config
    phase = on_phase or (lambda _: None)
    b = len(contexts)
    longest_q = max(len(q) for q in questions)
    cap_new = capacity_new or longest_q + max_new_tokens
    if longest_q + max_new_tokens > cap_new:
        raise ValueError(
            f"capacity_new={cap_new} is smaller than the longest question ({longest_q}) + "
            f"max_new_tokens ({max_new_tokens})"
        )
    lengths = [len(c) for c in contexts]
    if max(lengths) > bucket:
        raise ValueError(f"a context of {max(lengths)} tokens is longer than bucket={bucket}; raise the bucket")
    check_context(model, max(lengths), cap_new)
    tokens, _ = engine.pad_prompts([list(c) for c in contexts], bucket)
    method = engine.as_run(cfg, method)  # a hybrid model: ring buffers on its local layers (kvjax.methods.plans.hybrid)
    mesh = model.mesh
    put = lambda x: S.put_batch(jnp.asarray(x), mesh)
    states = engine.init_states(
        cfg, method, b, Capacity(bucket, cap_new), model.dtype, mesh, scan_layers=M.is_stacked(model.params)
    )
    phase("prefill" if prefilled is None else "compress")
    if prefilled is None:
        states, logits = engine.prefill(
            cfg, method, model.params, put(tokens), put(np.asarray(lengths, np.int32)), states, mesh=mesh
        )
    else:
        states, logits = engine.compress_prefilled(cfg, method, prefilled, states, tokens, np.asarray(lengths))
    eos = _eos(model)
    answers: list[list[int]] = [[] for _ in range(b)]
    done = [False] * b
    pos = np.asarray(lengths, np.int32)
    for step in range(cap_new):
        greedy = S.to_host(jnp.argmax(logits, axis=-1))
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
        phase(f"decode {step + 1}/{cap_new}")
        logits, states = engine.decode_step(cfg, method, model.params, states, put(feed), put(pos), mesh=mesh)
        pos = pos + 1
    answers = answers if model.tokenizer is None else [model.tokenizer.decode(a) for a in answers]
    return (answers, memory_rows(method, states, num_heads=cfg.num_heads)) if memory else answers


def bytes_per_seq(model_cfg, method, capacity: Capacity, dtype) -> int:
    """Bytes one sequence's cache of ``method`` holds at ``capacity`` (all layers), from the states' shapes
    (``jax.eval_shape`` of :func:`kvjax.engine.init_states`: nothing is allocated; every method sizes its state
    on the host)."""
    import jax

    method = engine.as_run(model_cfg, method)
    states = jax.eval_shape(lambda: engine.init_states(model_cfg, method, 1, capacity, dtype))
    return engine.memory_bytes(method, states)


#: A fraction budget is searched on this grid (``k / FRACTION_STEPS``).
FRACTION_STEPS = 10_000


def _held_per_end(model_cfg, method, capacity: Capacity, dtype, ends: Sequence[tuple[int, int]]) -> np.ndarray:
    """``[len(ends)]``: the bytes a sequence holds at each end ``(prompt tokens, decode steps)``
    (:func:`kvjax.engine.expected_held_bytes`, once per distinct step count)."""
    out = np.zeros(len(ends), np.int64)
    for steps in sorted({s for _, s in ends}):
        at = [i for i, (_, s) in enumerate(ends) if s == steps]
        out[at] = engine.expected_held_bytes(model_cfg, method, capacity, dtype, [ends[i][0] for i in at], steps)
    return out


def held_at_end(model_cfg, method, capacity: Capacity, dtype, ends: Sequence[tuple[int, int]]) -> float:
    """Mean bytes a sequence of ``method`` holds at the end of its generation over ``ends``, the ``(prompt
    tokens, decode steps)`` of each example (:func:`kvjax.engine.expected_held_bytes`: the budget contract and the
    state's shapes; nothing runs)."""
    return float(_held_per_end(model_cfg, method, capacity, dtype, ends).mean())


def same_footprint(model_cfg, a, b, capacity: Capacity, dtype, ends: Sequence[tuple[int, int]]) -> bool:
    """Whether methods ``a`` and ``b`` (two budgets of one method) allocate the same bytes at ``capacity`` and hold
    the same bytes at the end of every example of ``ends``: then they keep the same token counts everywhere, and
    one run stands for both."""
    if bytes_per_seq(model_cfg, a, capacity, dtype) != bytes_per_seq(model_cfg, b, capacity, dtype):
        return False
    ends = sorted(set(ends))
    return bool(
        np.array_equal(
            _held_per_end(model_cfg, a, capacity, dtype, ends), _held_per_end(model_cfg, b, capacity, dtype, ends)
        )
    )


def equal_bytes_budget(
    model_cfg,
    name: str,
    ref_bytes: float,
    capacity: Capacity,
    dtype,
    ends: Sequence[tuple[int, int]],
    fraction: bool = False,
    options: dict | None = None,
) -> tuple[float | int, float]:
    """The largest budget of method ``name`` whose sequences hold at most ``ref_bytes`` at the end of generation,
    on average over ``ends`` (:func:`held_at_end`): ``(budget, its mean bytes)``. A token count, or with
    ``fraction=True`` a fraction of each prompt on a grid of ``1 / FRACTION_STEPS`` (a fraction keeps the
    comparison per prompt length: a method that keeps its decoded tokens gets a smaller share of every prompt, not
    the same count for short and long ones). Bytes grow with the budget; budgets ``init`` refuses (too few slots
    for the method's structure, e.g. Chelsea's sink + recent) are below every legal one. A ValueError when no
    legal budget fits (e.g. PQCache, which keeps every token's K/V whatever the budget)."""
    hi = FRACTION_STEPS if fraction else capacity.prompt_len + capacity.max_new_tokens
    budget = (lambda t: t / FRACTION_STEPS) if fraction else (lambda t: t)

    def size(t):
        try:
            return held_at_end(model_cfg, make_method(name, budget(t), options), capacity, dtype, ends)
        except ValueError:
            return None

    lo = 1
    if size(lo) is None:  # find the smallest legal budget (legality is monotone in t)
        if size(hi) is None:
            raise ValueError(f"--equal-bytes: method {name} refuses every budget at {capacity}")
        a, b = 1, hi  # size(a) illegal, size(b) legal
        while b - a > 1:
            mid = (a + b) // 2
            a, b = (a, mid) if size(mid) is not None else (mid, b)
        lo = b
    if size(lo) > ref_bytes:
        raise ValueError(
            f"--equal-bytes: method {name} holds {size(lo):.0f} bytes per sequence at the end of "
            f"generation at its smallest budget ({budget(lo)}), more than the reference's "
            f"{ref_bytes:.0f}"
        )
    if size(hi) <= ref_bytes:
        return budget(hi), size(hi)
    a, b = lo, hi  # size(a) <= ref < size(b)
    while b - a > 1:
        mid = (a + b) // 2
        a, b = (mid, b) if size(mid) <= ref_bytes else (a, mid)
    return budget(a), size(a)


def throttled(show, seconds: float = 2.0):
    """``show`` called at most once every ``seconds`` (a phase shown each decode step would flood a log file)."""
    last = [-seconds]

    def call(text: str) -> None:
        now = time.perf_counter()
        if now - last[0] >= seconds:
            last[0] = now
            show(text)

    return call
