"""``kvjax-eval niah`` (eval.niah): prompts that hold the needle at its depth with the question compressed too, whole-
answer scoring, answers equal to the engine's own generation on the same prompt, and a folder that grows."""

import pytest

import kvjax
from eval import harness, niah


@pytest.fixture(scope="module")
def smol():
    return kvjax.load_model("smollm2-135m-instruct")


def test_prompts_hold_the_needle_at_its_depth(smol):
    """Each prompt fits its length (and nearly fills it), holds its needle sentence once, at a place that moves
    down the haystack with the depth, and ends with the question and the answer's start (compressed with it)."""
    tok = smol.tokenizer
    for k in (0, 3):
        n = niah.NEEDLES[k]
        where = []
        for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
            e = niah.build_example(smol, 512, depth, k)
            text = tok.decode(list(e.prompt))
            assert 512 - 48 <= len(e.prompt) <= 512, len(e.prompt)
            assert text.count(n.sentence) == 1 and "<|im_start|>" not in text
            assert text.rstrip().endswith(n.question + "\n" + n.prefix)
            body = text[len(niah.INTRO) : text.rindex(n.question)]
            where.append(body.index(n.sentence) / len(body))
        assert where == sorted(where) and where[0] < 0.02 and where[-1] > 0.9, where
    chat = niah.build_example(smol, 512, 0.5, 1, chat=True)
    assert "<|im_start|>assistant" in tok.decode(list(chat.prompt), skip_special_tokens=False)


def test_an_answer_scores_only_whole():
    """Scored by hand: every word of the answer, in any case and punctuation, or nothing; the first word alone (which
    the uncompressed prefill gives) scores 0."""
    n = niah.NEEDLES[0]
    assert niah.score(" Eat a sandwich, and sit in Dolores Park on a SUNNY day.", n) == (1.0, 1.0)
    assert niah.score(" eat a sandwich and sit in the park on a sunny day", n) == (0.0, 11 / 12)  # "dolores" missing
    assert niah.score(" eat", n)[0] == 0.0
    assert len(n.words()) == 12 and set(n.words()) >= {"dolores", "sandwich", "sunny"}


def test_bad_settings_name_the_option(tmp_path, capsys):
    from eval import cli

    with pytest.raises(ValueError, match="needles=7"):
        niah.Grid("m", (("full", None),), needles=7)
    with pytest.raises(ValueError, match="depths: 1.5"):
        niah.Grid("m", (("full", None),), depths=(1.5,))
    with pytest.raises(ValueError, match="no paper needle budget"):
        niah.paper_configs(["knorm"])
    assert niah.paper_configs(["full", "snapkv"], {"snapkv": [64]}) == (("full", None), ("snapkv", 64))
    with pytest.raises(SystemExit) as stop:
        cli.main(["niah", "--budget", "snapkv=0", "--out", str(tmp_path)])
    assert stop.value.code == 2 and "--budget snapkv=0" in capsys.readouterr().err
    assert cli.main(["niah", "--methods", "full", "--budget", "h2o=64", "--out", str(tmp_path)]) == 2
    assert "h2o is not one of --methods" in capsys.readouterr().err
    assert cli.main(["niah", "--report", "--out", str(tmp_path / "none")]) == 2
    assert "holds no needle-in-a-haystack run" in capsys.readouterr().err


@pytest.mark.extended  # CI's second line (.ci/run); not the default run, for time (docs/testing.md)
def test_a_run_equals_the_engine_and_grows(smol, tmp_path, monkeypatch):
    """Each answer equals ``engine.generate`` on the same prompt (its own prefill, no shared one, the whole prompt
    compressed); a second run adding a budget and a depth runs only the new cells, keeps the old rows, and draws a
    heatmap per configuration."""
    from kvjax import engine, methods

    grid = niah.Grid(
        "smollm2-135m-instruct",
        (("full", None), ("snapkv", 64)),
        lengths=(512,),
        depths=(0.0, 1.0),
        needles=1,
        batch=2,
        max_new_tokens=14,
    )
    first = niah.run(smol, grid, tmp_path, progress=False)
    assert [(r["config"], r["depth"]) for r in first["rows"]] == [("full", 0.0), ("full", 1.0)] + [
        ("snapkv@64", 0.0),
        ("snapkv@64", 1.0),
    ]
    for r in first["rows"]:
        e = niah.build_example(smol, 512, r["depth"], 0)
        method = methods.get("full") if r["budget"] is None else methods.get("snapkv", budget=64)
        own = engine.generate(smol, [list(e.prompt)], method, 14, driver="python", prompt_len=512)
        assert r["answer"] == own.text[0], (r["config"], r["answer"], own.text[0])
        assert r["score"] == niah.score(own.text[0], niah.NEEDLES[0])[0]
    assert first["rows"][0]["score"] == 1.0  # full finds the needle at depth 0
    ran = []
    real = harness.answer_after_context
    monkeypatch.setattr(
        harness,
        "answer_after_context",
        lambda m, method, *a, **k: (
            ran.append((method.name, getattr(method, "budget", None), len(a[0]))) or real(m, method, *a, **k)
        ),
    )
    grown = niah.Grid(
        "smollm2-135m-instruct",
        (("full", None), ("snapkv", 64), ("snapkv", 128)),
        lengths=(512,),
        depths=(0.0, 0.5, 1.0),
        needles=1,
        batch=2,
        max_new_tokens=14,
    )
    res = niah.run(smol, grown, tmp_path, progress=False)
    # batches of the pending examples: (0.0, 0.5) and (1.0,); the first holds a new cell for all three configurations
    assert [(n, b) for n, b, _ in ran] == [("full", None), ("snapkv", 64), ("snapkv", 128), ("snapkv", 128)]
    assert len(res["rows"]) == 9 and all(r in res["rows"] for r in first["rows"])
    by = {e["config"]: e for e in res["summary"]}
    assert list(by) == ["full", "snapkv@64", "snapkv@128"] and by["full"]["score"]["n"] == 3
    mean = lambda key: 100 * sum(r["score"] for r in res["rows"] if r["config"] == key) / 3
    assert all(by[k]["score"]["value"] == pytest.approx(mean(k)) for k in by)
    assert all((tmp_path / "heatmaps" / f"{k}.png").stat().st_size > 0 for k in by)
    assert "| snapkv | 128 |" in (tmp_path / "niah.md").read_text()
    with pytest.raises(ValueError, match="max_new_tokens: 14 there, 10 here"):
        niah.run(
            smol,
            niah.Grid("smollm2-135m-instruct", (("full", None),), lengths=(512,), max_new_tokens=10),
            tmp_path,
            progress=False,
        )
