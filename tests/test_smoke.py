"""The fast first check: ``python3 -m pytest -m smoke`` (under 2 minutes on 2 cores; the README gives the measured
time). Every command line's ``--help``, every registered method through ``engine.generate``, one ``kvjax
generate`` and one ``kvjax-eval`` cell, all on a tiny random Llama saved as a local HF folder with the embedded
SmolLM2 tokenizer (built here, no downloads). Tests marked ``smoke`` elsewhere join it.

The references are independent of the code under test: argparse's own exit code and the registry's names for
the help pages; for the methods, the budget's ``ceil(b n)`` computed here by hand; for the eval cell, the option
given on the command line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re

import numpy as np
import pytest

import kvjax
from kvjax import engine, methods
from kvjax.methods.base import Capacity, LayerContext
from tiny_models import save_tiny_llama
from methods_table import small_at_budget

pytestmark = pytest.mark.smoke
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    """A tiny random Llama (2 layers, GQA 4/2) with the embedded SmolLM2 tokenizer, as a local HF folder."""
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny-smoke"),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return kvjax.load_model(tiny_path, dtype="float32")


def _parsers():
    from eval import cli as eval_cli
    from kvjax import cli as kvjax_cli
    from train_less import cli as train_cli

    yield "kvjax", kvjax_cli.build_parser, [[], ["generate"], ["demo"], ["calibrate-chelsea"], ["install-assets"]]
    yield (
        "kvjax-eval",
        eval_cli.build_parser,
        [[], ["main"], ["needle"], ["perplexity"], ["ruler"], ["fidelity"], ["longbench"], ["leaderboard"], ["plot"]],
    )
    yield "kvjax-train-less", train_cli.build_parser, [[]]


def _help(build, argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        build().parse_args([*argv, "--help"])
    assert e.value.code == 0
    return out.getvalue()


def test_every_help_shows_defaults_and_method_names():
    names = ", ".join(methods.names())
    for prog, build, commands in _parsers():
        for argv in commands:
            text = _help(build, argv)
            flat = " ".join(text.split())
            shown = " ".join([prog, *argv])
            assert f"usage: {shown}" in flat, shown
            if argv or prog == "kvjax-train-less":  # a command's own options: their defaults are shown
                assert "(default:" in flat or argv == ["install-assets"], f"{shown} --help shows no defaults"
            if re.search(r"^\s+--methods? ", text, re.M):  # an option taking method names
                assert names in flat, f"{shown} --help does not list the method names"
                assert re.search(r"^\s+--plugin MODULE_OR_FILE", text, re.M), f"{shown} --help has no --plugin"
    top = " ".join(_help(next(_parsers())[1], []).split())
    assert "main job" not in top  # kvjax demo is not the main job (kvjax-eval main is)
    from kvjax.cli import method_names

    with pytest.raises(argparse.ArgumentTypeError, match="--plugin"):  # an unknown name points to --plugin
        method_names()("nope")
    with pytest.raises(ValueError, match="--plugin"):
        methods.get("nope")
    eval_top = _help(dict((p, b) for p, b, _ in _parsers())["kvjax-eval"], [])
    assert eval_top.count("compare KV-cache methods") == 1  # the description once, not again in the epilog


@pytest.mark.filterwarnings("ignore::kvjax.budget.BudgetWarning")  # 0.5 of 40 tokens is below Chelsea's windows
@pytest.mark.parametrize("name", methods.names())
def test_every_method_generates(tiny, name):
    """Each method at budget 0.5 and its small options (``methods_table.small``: its own code runs on a two-layer model
    and a 40-token prompt) generates the tokens asked for, reports its bytes, and after prefill holds at most what
    its budget contract says (``held(n, 0)`` of each layer's method, averaged over the layers as the stats are).
    (That a method keeping every token generates what ``full`` does is tests/kvjax/test_engine.py's, for every
    method.)"""
    rng = np.random.RandomState(0)
    prompt = [int(t) for t in rng.randint(3, 2000, size=40)]
    method = small_at_budget(name, 0.5)
    out = engine.generate(tiny, [prompt], method, max_new_tokens=4, stop_at_eos=False)
    s = out.stats[0]
    assert len(out.tokens[0]) == 4 and s["cache_bytes"] > 0 and s["bytes_read_per_step"] > 0
    layers, cap = tiny.config.num_layers, Capacity(engine.bucket_length(len(prompt)), 4)  # generate's capacity
    ctx = [LayerContext(layer, layers, cap, tiny.config) for layer in range(layers)]
    contract = sum(method.at(c.layer).held(len(prompt), 0, c) for c in ctx) / layers
    assert s["tokens_held_prefill"] <= contract + 1e-6, (name, s, contract)
    if not method.recalls and methods.takes_budget(name):
        assert contract < len(prompt)  # it compresses here


def test_generate_cli(tiny_path, capsys):
    from kvjax import cli

    code = cli.main(
        [
            "generate",
            "--model",
            str(tiny_path),
            "--method",
            "snapkv",
            "--budget",
            "0.5",
            "--prompt",
            "Where is the Eiffel Tower? " * 4,
            "--max-new-tokens",
            "4",
        ]
    )
    err = capsys.readouterr().err
    assert code == 0, err
    assert "error:" not in err and "snapkv:" in err


def test_generate_cli_full_layers_option(tiny_path, capsys, monkeypatch):
    """``--option full_layers=N`` (any method): the first N layers run ``full`` (``methods.layers.FullFirst``), as
    ``methods.get(name, full_layers=N)``; the generation runs through it."""
    from kvjax import cli, engine

    seen = []
    stream = engine.stream

    def spy(model, prompt, method, *a, **kw):
        seen.append(method)
        return stream(model, prompt, method, *a, **kw)

    monkeypatch.setattr(engine, "stream", spy)
    argv = ["generate", "--model", str(tiny_path), "--method", "snapkv", "--budget", "0.5"]
    argv += ["--option", "full_layers=1", "--prompt", "Where is the Eiffel Tower? " * 4, "--max-new-tokens", "2"]
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 0, err
    (m,) = seen
    assert type(m).__name__ == "FullFirst" and m.at(0).name == "full" and m.at(1).name == "snapkv"
    assert m.at(1).budget == 0.5


def test_eval_cell_with_a_method_option(tiny_path, tmp_path, monkeypatch):
    from eval import cli, harness

    built = []
    make = harness.make_method

    def spy(name, budget=None, options=None):
        built.append(make(name, budget, options))
        return built[-1]

    monkeypatch.setattr(harness, "make_method", spy)
    out = tmp_path / "eval"
    code = cli.main(
        [
            "needle",
            "--model",
            str(tiny_path),
            "--methods",
            "snapkv",
            "--budgets",
            "0.5",
            "--lengths",
            "128",
            "--depths",
            "0.5",
            "--batch",
            "1",
            "--max-new-tokens",
            "4",
            "--option",
            "snapkv.window=4",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["method"] == "snapkv" and rows[0]["budget"] == 0.5
    assert built and all(m.window == 4 for m in built)  # --option reached every config the run built


def test_model_repr_is_one_short_line(tiny, tiny_path):
    """``print(model)`` is one line of family, sizes, dtype and parameter count (the count as transformers gives
    it for the same checkpoint), not the weights."""
    text = repr(tiny)
    assert "\n" not in text and len(text) < 300, text
    for part in ("llama", "layers=2", "heads=4", "kv_heads=2", "head_dim=8", "hidden=32", "dtype=float32"):
        assert part in text, (part, text)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_path)
    assert tiny.num_parameters == hf.num_parameters()
    assert f"params={hf.num_parameters() / 1e6:.1f}M" in text
