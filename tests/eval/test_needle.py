"""Needle and RULER tasks on the embedded SmolLM2-135M: the full cache retrieves every needle; prompts are
built as documented."""

import pytest

import kvjax
from eval import harness, needle, ruler, runner


@pytest.fixture(scope="module")
def smol():
    return kvjax.load_model("smollm2-135m-instruct")


def _run_full(model, lengths, depths):
    task = runner.NeedleTask(lengths=tuple(lengths), depths=tuple(depths), batch=len(lengths) * len(depths))
    prepared = task.prepare(model)
    rows = []
    for batch in prepared[1]:
        rows += task.run_batch(
            model, kvjax.methods.get("full"), prepared, batch, {"task": "needle", "method": "full", "budget": None}
        )
    return rows


def test_needle_prompt(smol):
    e = needle.build_example(smol, 300, 0.5, "12345")
    assert 280 <= len(e.prompt) <= 300
    text = smol.tokenizer.decode(list(e.prompt), skip_special_tokens=False)
    assert text.count("12345") == 2 and text.endswith(needle.ANSWER_PREFIX)
    with pytest.raises(ValueError, match="depth=1.5"):
        needle.build_example(smol, 300, 1.5, "1")
    with pytest.raises(ValueError, match="length=40"):
        needle.build_example(smol, 40, 0.5, "1")


def test_needle_full_short(smol):
    rows = _run_full(smol, [256], [0.0, 1.0])
    assert [r["score"] for r in rows] == [1.0, 1.0], [r["answer"] for r in rows]


@pytest.mark.extended  # CI's second line (.ci/run); not the default run, for time (docs/testing.md)
def test_needle_full_1k_scores_100(smol):
    rows = _run_full(smol, [1024], [0.0, 0.5, 1.0])
    assert all(r["score"] == 1.0 for r in rows), [(r["depth"], r["key"], r["answer"]) for r in rows]


def test_ruler_examples(smol):
    tok = smol.tokenizer
    examples = ruler.build(smol, ruler.TASKS, [400], samples=1, seed=1)
    assert [e.task for e in examples] == list(ruler.TASKS)
    for e in examples:
        ctx = tok.decode(list(e.context), skip_special_tokens=False)
        q = tok.decode(list(e.question), skip_special_tokens=False)
        assert "?" not in ctx[-5:] and ("Question" in q or "What" in q)  # the question is not in the context
        assert all(a in ctx for a in e.answers)
        assert 250 <= len(e.context) <= 420
    with pytest.raises(ValueError, match="ruler task='nope'"):
        ruler.build(smol, ["nope"], [400], 1)


@pytest.mark.extended  # CI's second line (.ci/run); not the default run, for time (docs/testing.md)
def test_ruler_questions_share_one_context(smol):
    """``questions=3``: one multikey context, three questions on distinct needles; the context compressed once
    (kvjax.engine.questions) gives the answers of compressing it for each question (harness.answer_after_context)."""
    task = ruler.RulerTask(lengths=(320,), tasks=("multikey",), samples=1, batch=1, max_new_tokens=8, questions=3)
    prepared = task.prepare(smol)
    (e,) = prepared[1][0]
    qa = e.all_questions
    assert len(qa) == 3 and len({a for _, a in qa}) == 3 and len({q for q, _ in qa}) == 3
    ctx = smol.tokenizer.decode(list(e.context), skip_special_tokens=False)
    assert all(a[0] in ctx for _, a in qa)
    method = kvjax.methods.get("snapkv", budget=0.5)
    meta = {"task": "ruler", "method": "snapkv", "budget": 0.5}
    rows = task.run_batch(smol, method, prepared, [e], meta)
    assert [r["question"] for r in rows] == [0, 1, 2] and all(r["context_tokens"] == len(e.context) for r in rows)
    bucket, cap_new = prepared[0]
    for (q, expected), row in zip(qa, rows):
        (ref,) = harness.answer_after_context(smol, method, [list(e.context)], [list(q)], bucket, 8, cap_new)
        assert row["answer"] == ref and row["expected"] == list(expected), (row["answer"], ref)
    with pytest.raises(ValueError, match="multikey task only"):
        ruler.build(smol, ruler.TASKS, [400], 1, questions=2)


def test_short_needle_lengths_warn_on_the_embedded_model(capsys):
    """Needle lengths below eval.cli.NEEDLE_SIGNAL (where even full answers in 20-60% of trials on the embedded
    model) print one ``kvjax-eval: warning:`` line naming them, before any work; --help says where the signal
    starts; another model or long enough lengths give no warning."""
    import io
    import contextlib

    from eval import cli

    assert cli.needle_length_warning("smollm2-135m-instruct", [256, 512]) is None
    assert cli.needle_length_warning("some/other-model", [128]) is None
    assert "--lengths 128,200" in cli.needle_length_warning("smollm2-135m-instruct", [128, 200, 512])
    for command in ("needle", "main"):  # a bad option stops the run right after the check: no model is loaded
        assert cli.main([command, "--lengths", "128,512", "--option", "windw=4"]) == 2
        warned = [l for l in capsys.readouterr().err.splitlines() if "warning:" in l]
        assert len(warned) == 1 and "--lengths 128:" in warned[0] and "256" in warned[0], warned
    assert cli.main(["needle", "--lengths", "256", "--option", "windw=4"]) == 2
    assert "warning:" not in capsys.readouterr().err
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main(["needle", "--help"])
    assert "passkey reliably only from 256 tokens" in " ".join(out.getvalue().split())
