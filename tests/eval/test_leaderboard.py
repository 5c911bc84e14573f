"""``kvjax-eval leaderboard`` (eval.leaderboard): plain-text RULER contexts, one prefill for every method, a killed
run that resumes to the same rows, and the average's interval against an independent computation."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

import kvjax
from kvjax.loading import assets
from eval import harness, leaderboard, ruler


@pytest.fixture(scope="module")
def smol():
    return kvjax.load_model("smollm2-135m-instruct")


def test_plain_contexts_hold_their_answers(smol):
    """``chat=False`` (a base model): the context is BOS + plain text with every expected answer in it, the question
    plain text ending with the answer prefix, no chat template anywhere; every task fits its length."""
    tok = smol.tokenizer
    examples = ruler.build(smol, leaderboard.TASKS, [512], samples=1, seed=3, chat=False)
    assert [e.task for e in examples] == list(leaderboard.TASKS)
    for e in examples:
        ctx = tok.decode(list(e.context), skip_special_tokens=False)
        q = tok.decode(list(e.question), skip_special_tokens=False)
        assert "<|im_start|>" not in ctx + q and "assistant" not in q, (ctx[:80], q)
        assert all(a in ctx for a in e.answers), (e.task, e.answers)
        assert 350 <= len(e.context) <= 512 and len(e.context) + len(e.question) <= 512 - 8, e.task
        assert q.startswith("\n") and ("What" in q or "Question" in q)
    single, multivalue = examples[0], examples[2]
    assert len(single.answers) == 1 and len(multivalue.answers) == 4
    assert len(set(multivalue.answers)) == 4


def _board(**kw):
    base = dict(
        model="smollm2-135m-instruct",
        methods=("full", "h2o"),
        ratios=(0.5,),
        tasks=("single_needle", "multikey"),
        length=512,
        contexts=1,
        batch=1,
        max_new_tokens=6,
    )
    return leaderboard.Board(**{**base, **kw})


@pytest.mark.extended  # CI's second line (.ci/run); not the default run, for time (docs/testing.md)
def test_a_killed_run_resumes_to_the_same_rows(smol, tmp_path, monkeypatch):
    """The whole run; then its rows.jsonl cut after two cells (the third written half): the rerun runs only the
    missing cells, with one model prefill per batch, and gives the same rows. Every cell's answers equal a prefill
    of its own (harness.answer_after_context without ``prefilled``)."""
    from kvjax import engine
    from kvjax.engine import prefilled as P

    board = _board()
    whole = leaderboard.run(smol, board, tmp_path / "a", progress=False)
    assert {(r["method"], r["ratio"]) for r in whole["rows"]} == {("full", 0.0), ("h2o", 0.5)}
    assert len(whole["rows"]) == 2 * 2  # 2 configs x 2 tasks x 1 context
    # the tasks alternate along the batches (here one context a batch): batch 0 single_needle, batch 1 multikey
    assert [r["subtask"] for r in whole["rows"]] == ["single_needle"] * 2 + ["multikey"] * 2

    task, prepared = leaderboard.fit_contexts(smol, board)
    bucket, cap_new = prepared[0]
    for r, e in zip([r for r in whole["rows"] if r["method"] == "h2o"], [e for b in prepared[1] for e in b]):
        (own,) = harness.answer_after_context(
            smol, kvjax.methods.get("h2o", budget=0.5), [list(e.context)], [list(e.question)], bucket, 6, cap_new
        )
        assert r["answer"] == own, (r["answer"], own)

    lines = (tmp_path / "a" / leaderboard.ROWS).read_text().splitlines()
    assert len(lines) == 1 + 2 * 2  # settings + (batch, config) records
    cut = tmp_path / "b"
    cut.mkdir()
    (cut / leaderboard.ROWS).write_text("\n".join(lines[:3]) + "\n" + lines[3][:40])
    partial = leaderboard.report_only(cut)  # the stopped run's tables, running nothing
    assert partial["partial"] == {"batches_done": 1, "batches": 2, "cells_done": 2}
    assert [r["answer"] for r in partial["rows"]] == [r["answer"] for r in whole["rows"][:2]]
    assert "partial run" in (cut / "leaderboard.md").read_text()
    prefills, own = [], []
    real, real_own = P.prefill_once, engine.prefill
    monkeypatch.setattr(P, "prefill_once", lambda *a: prefills.append(1) or real(*a))
    monkeypatch.setattr(engine, "prefill", lambda *a, **k: own.append(1) or real_own(*a, **k))
    resumed = leaderboard.run(smol, board, cut, progress=False)
    assert set(resumed["timings"]["seconds_this_run"]) == {"prefill", "full@0", "h2o@0.5"}
    assert len(prefills) == 1  # batch 0 was whole; batch 1 prefilled once for its two configurations
    assert not own  # and no configuration ran the model's prefill itself
    key = lambda r: (r["method"], r["subtask"], r["answer"], r["score"], r["context_tokens"])
    assert [key(r) for r in resumed["rows"]] == [key(r) for r in whole["rows"]]
    out = json.loads((cut / "leaderboard.json").read_text())
    assert out["summary"] == json.loads(json.dumps(resumed["summary"]))
    assert "| h2o |" in (cut / "leaderboard.md").read_text() and (cut / "leaderboard.png").stat().st_size > 0

    with pytest.raises(ValueError, match="other settings"):
        leaderboard.run(smol, _board(contexts=2), cut, progress=False)


def test_average_interval_is_stratified():
    """The average over tasks and its 95% interval against scipy: the variance of a mean of independent task means
    is the sum of their squared standard errors over T^2."""
    rng = np.random.RandomState(0)
    per_task = [list(rng.uniform(0, 1, n)) for n in (10, 10, 12)]
    got = leaderboard.average_interval(per_task)
    means = [np.mean(s) for s in per_task]
    se = math.sqrt(sum(stats.sem(s) ** 2 for s in per_task)) / 3
    half = stats.t.ppf(0.975, 32 - 3) * se
    assert got["value"] == pytest.approx(100 * np.mean(means))
    assert got["lo"] == pytest.approx(100 * (np.mean(means) - half))
    assert got["hi"] == pytest.approx(100 * (np.mean(means) + half))
    cell = leaderboard.summarise(
        [{"method": "a", "ratio": 0.5, "subtask": "t", "score": x} for x in (1.0, 0.0, 1.0, 1.0)], ["t"]
    )[0]["tasks"]["t"]
    lo, hi = stats.binomtest(3, 4).proportion_ci(method="wilson")
    assert (cell["lo"], cell["hi"]) == (pytest.approx(100 * lo), pytest.approx(100 * hi))


def test_bad_settings_name_the_option():
    with pytest.raises(ValueError, match="ratios: 1.5"):
        _board(ratios=(1.5,))
    with pytest.raises(ValueError, match="tasks: 'nope'"):
        _board(tasks=("nope",))
    with pytest.raises(ValueError, match="contexts=0"):
        _board(contexts=0)
    assert _board().configs() == [("full", None, 0.0, leaderboard.AFTER), ("h2o", 0.5, 0.5, leaderboard.AFTER)]
    assert _board(batch=10).task().batch == 2  # one context of each of 2 tasks: no prefill padded to 10
    with pytest.raises(ValueError, match="protocol: 'nope'"):
        _board(protocols=("nope",))


def test_command_line_errors_name_the_option(tmp_path, capsys):
    """Bad settings stop ``kvjax-eval leaderboard`` before the model loads, naming the option; ``--report`` on a
    folder without a run says so."""
    from eval import cli

    assert cli.main(["leaderboard", "--ratios", "0.5,1.5", "--out", str(tmp_path)]) == 2
    assert "ratios: 1.5" in capsys.readouterr().err
    assert cli.main(["leaderboard", "--methods", "full,nope", "--out", str(tmp_path)]) == 2
    assert "nope" in capsys.readouterr().err
    assert cli.main(["leaderboard", "--report", "--out", str(tmp_path / "none")]) == 2
    assert "holds no leaderboard run" in capsys.readouterr().err


def test_needle_failures_classify_each_expected_number():
    rows = [
        {
            "method": "a",
            "ratio": 0.5,
            "subtask": "multivalue",
            "answer": ": 1234567, 321 and 99",
            "expected": ["1234567", "3210000", "4444444", "9"],
        },
        {"method": "a", "ratio": 0.5, "subtask": "single_needle", "answer": "the the", "expected": ["5555555"]},
        {"method": "a", "ratio": 0.5, "subtask": "common_words", "answer": "x", "expected": ["y"]},
    ]
    got = leaderboard.needle_failures(rows)
    assert got == {("a", 0.5): {"found": 2, "cut short": 1, "another number": 1, "no number": 1}}


def test_compile_cache_is_on_unless_told_otherwise(tmp_path, monkeypatch):
    """``--compile-cache DIR`` turns on JAX's persistent compilation cache there (a resumed run loads what it
    compiled); ``off`` leaves it alone, and ``$JAX_COMPILATION_CACHE_DIR`` wins over the option."""
    import jax

    from eval import cli

    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_compilation_cache_max_size)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    try:
        assert cli.persistent_compile_cache("off") is None and jax.config.jax_compilation_cache_dir == before[0]
        where = tmp_path / "jax-compile"
        assert cli.persistent_compile_cache(str(where)) == str(where) and where.is_dir()
        assert jax.config.jax_compilation_cache_dir == str(where)
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
        assert cli.persistent_compile_cache(str(tmp_path / "other")) == str(tmp_path / "env")
        assert not (tmp_path / "other").exists()
        args = cli.build_parser().parse_args(["leaderboard"])
        assert Path(args.compile_cache) == assets.cache_dir() / "jax-compile"
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_compilation_cache_max_size", before[1])


@pytest.mark.extended  # CI's second line (.ci/run); not the default run, for time (docs/testing.md)
def test_a_folder_grows_by_methods_and_the_papers_protocol(smol, tmp_path, monkeypatch):
    """A run of full and H2O, then one adding SnapKV and the question-in-context protocol into the same folder: only
    the new cells run, the old rows stay and the header holds the union. In the papers' protocol each answer equals
    ``engine.generate`` on the whole prompt (context and question compressed together by the engine's own prefill, no
    shared prefill), and full answers alike in both protocols (its cache is every token either way)."""
    from kvjax import engine, methods

    small = dict(contexts=1, tasks=("single_needle",))
    first = leaderboard.run(smol, _board(**small), tmp_path, progress=False)
    ran = []
    real = ruler.RulerTask.run_batch
    monkeypatch.setattr(
        ruler.RulerTask,
        "run_batch",
        lambda self, m, method, *a, **k: ran.append((method.name, self.in_context)) or real(self, m, method, *a, **k),
    )
    both = (leaderboard.AFTER, leaderboard.IN_CONTEXT)
    grown = _board(**small, methods=("full", "h2o", "snapkv"), protocols=both)
    res = leaderboard.run(smol, grown, tmp_path, progress=False)
    assert sorted(ran) == sorted([("snapkv", False), ("full", True), ("h2o", True), ("snapkv", True)])
    settings = leaderboard.read_settings(tmp_path)
    assert settings["methods"] == ("full", "h2o", "snapkv") and settings["protocols"] == both
    after = [r for r in res["rows"] if r["protocol"] == leaderboard.AFTER]
    assert [r["answer"] for r in after if r["method"] in ("full", "h2o")] == [r["answer"] for r in first["rows"]]

    _, prepared = leaderboard.fit_contexts(smol, grown, leaderboard.IN_CONTEXT)
    (e,) = prepared[1][0]
    assert e.question == () and len(e.context) <= grown.length
    inside = {r["method"]: r for r in res["rows"] if r["protocol"] == leaderboard.IN_CONTEXT}
    for name, budget in (("full", None), ("h2o", 0.5), ("snapkv", 0.5)):
        method = methods.get(name) if budget is None else methods.get(name, budget=budget)
        own = engine.generate(smol, [list(e.context)], method, 6, driver="python", prompt_len=prepared[0][0])
        assert inside[name]["answer"] == own.text[0], (name, inside[name]["answer"], own.text[0])
    assert inside["full"]["answer"] == next(r["answer"] for r in after if r["method"] == "full")
    md = (tmp_path / "leaderboard.md").read_text()
    assert "| snapkv (question in context) |" in md and "| h2o |" in md and "full, question in context" in md
    with pytest.raises(ValueError, match="max_new_tokens: 6 there, 7 here"):
        leaderboard.run(smol, _board(**small, max_new_tokens=7), tmp_path, progress=False)


def test_protocol_differences_pair_the_same_contexts():
    """By hand: two contexts under both protocols (differences +1 and 0), one context under one protocol only (left
    out); the interval is Student's t over the pairs (scipy)."""
    a, i = leaderboard.AFTER, leaderboard.IN_CONTEXT
    row = lambda p, sub, exp, score: {
        "method": "snapkv",
        "ratio": 0.5,
        "subtask": sub,
        "expected": [exp],
        "score": score,
        "protocol": p,
    }
    rows = [row(a, "t", "1", 0.0), row(i, "t", "1", 1.0), row(a, "t", "2", 1.0), row(i, "t", "2", 1.0)]
    rows += [row(a, "u", "3", 0.0), row(a, "t", "4", 1.0), row(i, "t", "4", 0.0)]
    got = leaderboard.protocol_differences(rows)[("snapkv", 0.5)]
    xs = [100.0, 0.0, -100.0]
    lo, hi = stats.t.interval(0.95, 2, loc=np.mean(xs), scale=stats.sem(xs))
    assert got["n"] == 3 and got["value"] == pytest.approx(0.0)
    assert (got["lo"], got["hi"]) == (pytest.approx(lo), pytest.approx(hi))
