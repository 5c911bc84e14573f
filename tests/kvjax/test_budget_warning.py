"""A budget below what its method can use warns once (``kvjax.budget.warn_small_budget``, ``BudgetWarning``) and
the command lines print it as one ``warning:`` line.

The expected numbers are worked out here by hand from the method notes: ``ceil(0.2 * 37) = 8`` tokens, SnapKV's
observation window of 8 plus one selected token = 9, StreamingLLM's 4 sinks plus one recent token = 5, ChunkKV's
window plus one chunk = 8 + 10."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

from kvjax import budget, engine, methods
from kvjax.budget import BudgetWarning, warn_small_budget

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(budget, "_warned", set())  # each test starts with nothing warned yet


def _caught(fn):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in got if issubclass(w.category, BudgetWarning)]


def test_the_readme_case_warns_with_the_numbers():
    got = _caught(lambda: warn_small_budget(methods.get("snapkv", budget=0.2), [37]))
    assert len(got) == 1
    assert "budget=0.2 (a fraction) keeps 8 tokens of a 37-token prompt, fewer than the 9" in got[0]
    assert "1.0 to keep the whole prompt" in got[0] and "window=8" in got[0]


@pytest.mark.parametrize(
    "name,options,n,warns",
    [
        ("snapkv", {"budget": 0.2}, 45, False),  # ceil(9.0) = 9 = window + 1
        ("snapkv", {"budget": 0.2}, 40, True),  # 8
        ("snapkv", {"budget": 1.0}, 37, False),  # the whole prompt never warns
        ("snapkv", {"budget": 8}, 8, False),  # a prompt no longer than the budget keeps everything
        ("h2o", {"budget": 1}, 37, True),  # the issue's `--budget 1`: one token
        ("h2o", {"budget": 2}, 37, True),
        ("h2o", {"budget": 3}, 37, False),
        ("streaming_llm", {"budget": 4}, 100, True),  # 4 sinks, no recent token
        ("streaming_llm", {"budget": 5}, 100, False),
        ("chunkkv", {"budget": 17}, 100, True),
        ("chunkkv", {"budget": 18}, 100, False),
        ("less", {"budget": 2}, 100, True),  # its sparse policy's minimum
        ("full", {}, 100, False),
    ],
)
def test_who_warns(name, options, n, warns):
    assert bool(_caught(lambda: warn_small_budget(methods.get(name, **options), [n]))) == warns


def test_warns_once_per_config_and_names_the_shortest_prompt():
    m = methods.get("snapkv", budget=0.2)
    first = _caught(lambda: warn_small_budget(m, [100, 20, 30]))
    assert len(first) == 1 and "keeps 4 tokens of a 20-token prompt" in first[0]  # ceil(0.2 * 20) = 4
    assert _caught(lambda: warn_small_budget(m, [20])) == []
    assert len(_caught(lambda: warn_small_budget(methods.get("snapkv", budget=0.2, window=4), [20]))) == 1


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    """A tiny random Llama with a word-level tokenizer (``t0`` ... ``t127``) as a local HF folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("tiny-warn")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
    ).save_pretrained(path)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", eos_token="t1").save_pretrained(path)
    return path


def test_generate_warns_once_outside_jit(tiny_path):
    import kvjax

    model = kvjax.load_model(tiny_path, dtype="float32")
    ids = [list(np.random.RandomState(0).randint(2, 128, size=37))]
    method = methods.get("snapkv", budget=0.2)

    def twice():
        for _ in range(2):
            engine.generate(model, ids, method, max_new_tokens=3)

    got = _caught(twice)
    assert len(got) == 1 and "8 tokens of a 37-token prompt" in got[0]


def test_cli_prints_one_warning_line(tiny_path, capsys):
    from kvjax import cli

    prompt = " ".join(f"t{i}" for i in range(2, 40))
    code = cli.main(
        [
            "generate",
            "--model",
            str(tiny_path),
            "--method",
            "h2o",
            "--budget",
            "1",
            "--prompt",
            prompt,
            "--max-new-tokens",
            "3",
        ]
    )
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "warning:" in line]
    assert code == 0 and len(lines) == 1, err
    assert re.match(
        r"kvjax: warning: h2o: budget=1 \(an int: a token count\) keeps 1 token of a \d+-token prompt, "
        r"fewer than the 3 h2o can use",
        lines[0],
    ), lines[0]


def test_chelsea_counts_the_tokens_to_come():
    """Chelsea's budget is ``floor(R (n + max_new_tokens))``: 0.2 * (256 + 48) = 60.8 -> 60 < 16 + 64 + 1."""
    got = _caught(lambda: warn_small_budget(methods.get("chelsea", budget=0.2), [256], 48))
    assert len(got) == 1 and "keeps 60 tokens of a 256-token prompt, fewer than the 81" in got[0]
    assert _caught(lambda: warn_small_budget(methods.get("chelsea", budget=0.2), [400], 48)) == []  # 89.6 -> 89
