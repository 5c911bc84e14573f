"""LongBench protocol (eval/longbench.py) on fixture jsonl files the tests write: loader and its errors, the
official prompt, middle truncation, the chat-template rule, scoring rules against hand-computed values, and
an end-to-end run of the task on a tiny random model with a whitespace tokenizer."""

import json

import jax
import pytest

from eval import longbench as lb
from eval import runner
from kvjax.loading import Model
from kvjax.model import random_params
from tiny_models import tiny_config


class WordTokenizer:
    """Whitespace tokenizer over a growing vocabulary (ids < 60), with a marker chat template."""

    eos_token_ids = [0]

    def __init__(self):
        self.vocab = {"<chat>": 1}
        self.inv = {1: "<chat>"}

    def encode(self, text, add_special_tokens=False):
        ids = []
        for w in text.split():
            if w not in self.vocab:
                i = 2 + len(self.vocab) % 58
                self.vocab[w], self.inv[i] = i, w
            ids.append(self.vocab[w])
        return ids

    def decode(self, ids):
        return " ".join(self.inv.get(int(i), "?") for i in ids) + " "

    def encode_chat(self, messages, add_generation_prompt=True):
        return [1] + self.encode(messages[-1]["content"])


def record(
    i, dataset="hotpotqa", context="alpha beta gamma", question="what is alpha", answers=("beta",), classes=None
):
    return {
        "input": question,
        "context": context,
        "answers": list(answers),
        "length": 3,
        "dataset": dataset,
        "language": "en",
        "all_classes": classes,
        "_id": f"id{i}",
    }


def write(folder, dataset, records):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{dataset}.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")


def test_loader_reads_fixture_and_subfolder(tmp_path):
    write(tmp_path, "hotpotqa", [record(0), record(1)])
    write(tmp_path / "data", "trec", [record(2, "trec")])
    assert [r["_id"] for r in lb.load(tmp_path, "hotpotqa")] == ["id0", "id1"]
    assert [r["_id"] for r in lb.load(tmp_path, "hotpotqa", limit=1)] == ["id0"]
    assert lb.load(tmp_path, "trec")[0]["dataset"] == "trec"


def test_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="qasper.jsonl"):
        lb.load(tmp_path, "qasper")
    bad = record(0)
    del bad["answers"]
    write(tmp_path, "musique", [bad])
    with pytest.raises(ValueError, match="answers"):
        lb.load(tmp_path, "musique")
    with pytest.raises(ValueError, match="not a LongBench dataset"):
        lb.load(tmp_path, "squad")
    with pytest.raises(FileNotFoundError, match="not a folder"):
        lb.load(tmp_path / "missing.txt", "qasper")


def test_official_prompt_and_generation_lengths():
    assert lb.PROMPTS["trec"].format(context="C", input="Q") == (
        "Please determine the type of the question below. Here are some examples of questions.\n\nC\nQ"
    )
    assert lb.PROMPTS["lcc"].format(context="def f():\n", input="") == (
        "Please complete the code given below. \ndef f():\nNext line of code:\n"
    )
    assert lb.MAX_NEW_TOKENS["hotpotqa"] == 32 and lb.MAX_NEW_TOKENS["gov_report"] == 512
    assert set(lb.PROMPTS) == set(lb.MAX_NEW_TOKENS) == set(lb.METRICS) and len(lb.PROMPTS) == 21


def test_middle_truncation_and_chat_rule():
    tok = WordTokenizer()
    r = record(0, "triviaqa", context=" ".join(f"w{i}" for i in range(40)), question="Q: x? A:")
    full, cut, n = lb.build_prompt(tok, "triviaqa", r, 1000)
    assert not cut and n == len(full) and full[0] != 1  # triviaqa: no chat template
    ids, cut, n2 = lb.build_prompt(tok, "triviaqa", r, 10)
    assert cut and n2 == n and len(ids) == 10
    assert ids == full[:5] + full[-5:]  # first and last max_length // 2 tokens
    chat, cut, _ = lb.build_prompt(tok, "hotpotqa", record(1), 1000)
    assert chat[0] == 1 and not cut  # hotpotqa: chat template applied


def test_scores_hand_computed():
    # qa-F1: "the cat sat" vs "a cat sat down" -> normalised [cat, sat] vs [cat, sat, down]: P=1, R=2/3, F1=0.8
    assert lb.score("hotpotqa", "the cat sat", ["a cat sat down"]) == pytest.approx(0.8)
    assert lb.score("hotpotqa", "the cat sat", ["dog", "cat sat"]) == pytest.approx(1.0)  # max over answers
    # first-line rule (triviaqa): only "Paris" is scored
    assert lb.score("triviaqa", "\nParis\nLondon is big", ["Paris"]) == 1.0
    assert lb.score("hotpotqa", "Paris\nLondon", ["Paris"]) == pytest.approx(2 / 3)  # no cut: P=1/2, R=1
    # classification: both "Location" and "Loc" named; "Loc" is a proper substring of the truth -> dropped
    assert lb.score("trec", "Location or Loc", ["Location"], ["Location", "Loc", "Person"]) == 1.0
    assert lb.score("trec", "Location or Person", ["Location"], ["Location", "Person"]) == 0.5
    assert lb.score("passage_retrieval_en", "Paragraph 3, not 4", ["Paragraph 3"]) == 0.5
    assert lb.score("passage_count", "7", ["7"]) == 1.0
    # code: first line without a comment/fence; "x = 1" vs "x = 2": LCS 4 of 5+5 chars -> 0.8
    assert lb.score("lcc", "```\n# c\nx = 1\n", ["x = 2"]) == pytest.approx(0.8)
    # ROUGE-L: "a b c d" vs "a c d e": LCS 3, P = R = 3/4
    assert lb.score("gov_report", "a b c d", ["a c d e"]) == pytest.approx(0.75)


def test_task_runs_end_to_end_on_a_tiny_model(tmp_path):
    cfg = tiny_config(hidden_size=32, intermediate_size=48, head_dim=8, max_position_embeddings=256)
    model = Model(cfg, random_params(cfg, jax.random.PRNGKey(0), scale=0.3), WordTokenizer(), "tiny")
    write(tmp_path, "hotpotqa", [record(i, context=" ".join(f"c{i}{j}" for j in range(30))) for i in range(2)])
    write(tmp_path, "trec", [record(9, "trec", answers=("Loc",), classes=["Loc", "Hum"])])
    task = lb.LongBenchTask(str(tmp_path), ("hotpotqa", "trec"), samples=2, max_length=24)
    res = runner.run(model, [task], ["full", "snapkv"], [0.5], progress=False)
    rows = res["rows"]
    assert len(rows) == 6 and {r["dataset"] for r in rows} == {"hotpotqa", "trec"}
    assert all(r["truncated"] for r in rows if r["dataset"] == "hotpotqa")
    for r in rows:
        src = {"hotpotqa": (["beta"], None), "trec": (["Loc"], ["Loc", "Hum"])}[r["dataset"]]
        assert r["score"] == lb.score(r["dataset"], r["answer"], *src)
