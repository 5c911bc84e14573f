"""One compressed context, many questions, against compressing the context per question (kvjax.engine.questions).

On the embedded SmolLM2 (float32): a context of ``--context`` tokens (the essays), ``--questions`` questions of
different lengths, ``--new`` greedy tokens each, under ``--method`` at ``--budget``. Three ways, each timed warm
(a first run compiles; the second is timed):

- ``shared``: ``questions.compress_context`` once, ``questions.answer`` on every question in one batch;
- ``per_question_compiled``: the context repeated for every question, prefilled and compressed once per question
  in one batch (``engine.prefill``), then the same compiled loop as ``shared``: the cost of the compressions alone;
- ``per_question_batched``: ``eval.harness.answer_after_context`` with the context repeated for every question
  (its Python-driven decode steps);
- ``per_question``: ``answer_after_context`` once per question (batch 1, one after another).

Checks the three give the same tokens, writes JSON with the device and jax version."""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

import kvjax
from eval import harness
from kvjax.loading import assets
from kvjax import methods
from kvjax.engine import questions


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--method", default="snapkv")
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    model = kvjax.load_model("smollm2-135m-instruct", dtype="float32")
    tok = model.tokenizer
    ids = tok.encode(assets.essays_text(), add_special_tokens=True)[: a.context]
    rng = np.random.RandomState(0)
    words = "What does the author say about startups, money, work, schools, cities, ideas and time?".split()
    qs = [
        tok.encode(" " + " ".join(words[: 3 + rng.randint(0, len(words) - 3)]) + "\nAnswer:", add_special_tokens=False)
        for _ in range(a.questions)
    ]
    method = methods.at_budget(a.method, a.budget)
    cap = max(len(q) for q in qs) + a.new
    bucket = kvjax.engine.bucket_length(len(ids))
    out, tokens = {}, {}

    def shared():
        ctx = questions.compress_context(model, ids, method, max_new_tokens=cap)
        return questions.answer(model, ctx, qs, max_new_tokens=a.new, stop_at_eos=False).tokens

    def per_question_compiled():
        import jax.numpy as jnp

        from kvjax import engine
        from kvjax.methods.base import Capacity

        cfg, q = model.config, len(qs)
        tokens, lengths = engine.pad_prompts([ids] * q, bucket)
        states = engine.init_states(cfg, method, q, Capacity(bucket, cap), model.dtype)
        states, _ = engine.prefill(cfg, method, model.params, jnp.asarray(tokens), jnp.asarray(lengths), states)
        qtok = np.zeros((q, max(len(x) for x in qs)), np.int32)
        for i, x in enumerate(qs):
            qtok[i, : len(x)] = x
        loop = questions.AnswerLoop(cfg, method, kvjax.engine.sampling.Greedy(), a.new, ())
        out, *_ = questions.answer_loop(
            loop,
            model.params,
            states,
            jnp.asarray(qtok),
            jnp.asarray([len(x) for x in qs], jnp.int32),
            jnp.asarray(lengths),
            jax.random.PRNGKey(0),
        )
        return [list(map(int, r)) for r in np.asarray(out)]

    def per_question_batched():
        return harness.answer_after_context(model, method, [ids] * len(qs), qs, bucket, a.new, capacity_new=cap)

    def per_question():
        return [harness.answer_after_context(model, method, [ids], [q], bucket, a.new, capacity_new=cap)[0] for q in qs]

    runs = (
        ("shared", shared),
        ("per_question_compiled", per_question_compiled),
        ("per_question_batched", per_question_batched),
        ("per_question", per_question),
    )
    for name, fn in runs:
        fn()  # compile
        t = time.perf_counter()
        got = fn()
        out[name] = time.perf_counter() - t
        tokens[name] = [list(map(int, x)) if not isinstance(x, str) else x for x in got]
        print(f"{name}: {out[name]:.2f} s", flush=True)
    decode = lambda ts: [tok.decode(t) if not isinstance(t, str) else t for t in ts]  # noqa: E731
    same = (
        decode(tokens["shared"])
        == decode(tokens["per_question_compiled"])
        == tokens["per_question_batched"]
        == tokens["per_question"]
    )
    res = dict(
        seconds=out,
        same_answers=same,
        context_tokens=len(ids),
        question_tokens=[len(q) for q in qs],
        new_tokens=a.new,
        method=a.method,
        budget=a.budget,
        device=str(jax.devices()[0]),
        jax=jax.__version__,
    )
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
