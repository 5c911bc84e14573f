"""One compressed context, many questions (kvjax.engine.questions): the context is prefilled and compressed once, the
questions (of different lengths) continue from it in one batch and one compiled loop; the tokens are those of
compressing the context for each question separately (eval.harness.answer_after_context, kvpress's protocol: the
context compressed, the question teacher-forced after it, then greedy decoding)."""

from __future__ import annotations

import numpy as np
import pytest

from eval import harness
from extended import cases
from kvjax import engine, methods
from kvjax.engine import questions


def _ids(lengths, seed):
    rng = np.random.RandomState(seed)
    return [[int(x) for x in rng.randint(2, 60, size=n)] for n in lengths]


METHODS = {
    "full": lambda: methods.get("full"),
    "snapkv": lambda: methods.get("snapkv", budget=0.3, window=4),
    "h2o": lambda: methods.get("h2o", budget=0.3),
    "snapkv-bounded": lambda: methods.get("snapkv", budget=0.5, window=4, decode_budget=20, every=4),
}


@pytest.mark.parametrize("name", cases(METHODS, {"full", "h2o", "snapkv-bounded"}))  # snapkv: in CI's second line
def test_one_context_many_questions_equals_one_compression_per_question(tiny, name):
    method = METHODS[name]()
    context = _ids([45], seed=1)[0]
    qs = _ids([5, 11, 1], seed=2)
    new = 12
    ctx = questions.compress_context(tiny, context, method, max_new_tokens=11 + new)
    before = dict(engine.TRACE_COUNTS)
    res = questions.answer(tiny, ctx, qs, max_new_tokens=new, stop_at_eos=False)
    assert engine.TRACE_COUNTS["answer_loop"] == before.get("answer_loop", 0) + 1
    assert engine.TRACE_COUNTS["prefill"] == before.get("prefill", 0)  # the context is not prefilled again
    for q, got in zip(qs, res.tokens):
        want = harness.answer_after_context(
            tiny, method, [context], [q], bucket=64, max_new_tokens=new, capacity_new=11 + new
        )[0]
        assert got == want
    assert [s["question_tokens"] for s in res.stats] == [5, 11, 1]
    assert all(len(t) == new for t in res.tokens)
    # the context is a value: a second batch of questions continues from the same compression (nothing donated)
    mid = dict(engine.TRACE_COUNTS)
    again = questions.answer(tiny, ctx, qs[:1], max_new_tokens=new, stop_at_eos=False)
    assert again.tokens[0] == res.tokens[0]
    assert engine.TRACE_COUNTS["prefill"] == mid["prefill"]


def test_held_bytes_and_errors(tiny):
    m = methods.get("snapkv", budget=0.3, window=4)
    ctx = questions.compress_context(tiny, _ids([45], 1)[0], m, max_new_tokens=16)
    res = questions.answer(tiny, ctx, _ids([3, 7], 3), max_new_tokens=6, stop_at_eos=False)
    for st in res.stats:  # 14 kept + the batch's 7 + 6 - 1 steps (a sequence done first keeps stepping, as generate's)
        assert st["tokens_held"] == 14 + 7 + 5 and st["decode_steps"] == 12
    with pytest.raises(ValueError, match="capacity"):
        questions.answer(tiny, ctx, _ids([12], 3), max_new_tokens=6)
    with pytest.raises(ValueError, match="empty question"):
        questions.answer(tiny, ctx, [[]], max_new_tokens=6)
