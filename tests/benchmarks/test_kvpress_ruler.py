"""benchmarks/kvpress_ruler.py and the leaderboard's side of it: the papers' protocol on the torch side against
transformers' own greedy ``generate`` on a tiny random Llama (no press: the same tokens), the press held for the
prefill only, jobs per protocol (the question inside the context in the papers' protocol, keys that keep a folder's
earlier answers), the peer's rows by protocol, and the agreement table counted by hand. kvpress itself is not
installed here (its own venv); its presses are what the script passes in."""

from __future__ import annotations

import contextlib
import json

import pytest
from repo_scripts import ROOT, load_script

from eval import leaderboard


@pytest.fixture(scope="module")
def kr():
    return load_script("benchmarks/kvpress_ruler.py", "bench_kvpress_ruler", beside=True)


@pytest.fixture(scope="module")
def tiny_llama():
    pytest.importorskip("transformers")
    from tiny_models import random_hf

    hf = random_hf("LlamaForCausalLM", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    hf.generation_config.eos_token_id = 96
    hf.generation_config.pad_token_id = 0

    class Tok:  # token ids as text, so the answer shows every id
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(str(int(i)) for i in ids if not (skip_special_tokens and int(i) == 96))

    return hf, Tok()


def test_in_context_answers_are_greedy_generation_without_a_press(kr, tiny_llama):
    """No press: the prompt prefilled in one pass, then decoded at positions T, T + 1, ... equals transformers'
    greedy ``generate`` on the whole prompt, token for token (positions off by one give other tokens)."""
    import torch

    hf, tok = tiny_llama
    for seed in range(3):
        prompt = torch.randint(1, 96, (1, 23 + 7 * seed), generator=torch.Generator().manual_seed(seed))
        with torch.inference_mode():
            want = hf.generate(prompt, max_new_tokens=9, do_sample=False, min_new_tokens=9)[0, prompt.shape[1] :]
            got = kr.generate_in_context(hf, tok, prompt, 9)
        assert got == tok.decode(want), (seed, got, tok.decode(want))


def test_the_press_holds_the_prefill_only(kr, tiny_llama):
    """The press is entered once, around the one forward pass of the whole prompt (kvpress compresses the cache in
    that pass's hooks); decoding runs outside it."""
    import torch

    hf, tok = tiny_llama
    calls = []
    original = hf.forward

    def forward(*a, **kw):
        calls.append((len(entered) - len(left), kw["input_ids"].shape[1]))
        return original(*a, **kw)

    entered, left = [], []

    @contextlib.contextmanager
    def press(model):
        entered.append(model)
        yield
        left.append(model)

    hf.forward = forward
    try:
        with torch.inference_mode():
            kr.generate_in_context(hf, tok, torch.arange(1, 31).view(1, 30), 5, press=press)
    finally:
        del hf.forward
    assert entered == [hf] and left == [hf]
    assert calls[0] == (1, 30) and all(c == (0, 1) for c in calls[1:]) and len(calls) <= 5


class _Example:
    def __init__(self, task, context, question, answers):
        self.task, self.context, self.question, self.answers = task, context, question, answers


def test_jobs_per_protocol(kr):
    """kvpress's protocol keeps the keys a folder already holds (``index|press|ratio``); the papers' protocol tags
    its keys and records the protocol; no press runs once per context."""
    after = kr._jobs([_Example("single_needle", (1, 2), (3,), ("7",))], ["none", "SnapKVPress"], [0.5, 0.75])
    assert [j["key"] for j in after] == ["0|none|0", "0|SnapKVPress|0.5", "0|SnapKVPress|0.75"]
    assert {j["protocol"] for j in after} == {kr.AFTER}
    inside = kr._jobs([_Example("single_needle", (1, 2, 3), (), ("7",))], ["SnapKVPress"], [0.5], kr.IN_CONTEXT)
    assert inside[0]["key"] == "0|SnapKVPress|0.5|question-in-context" and inside[0]["question"] == []
    assert inside[0]["protocol"] == kr.IN_CONTEXT == leaderboard.IN_CONTEXT and kr.AFTER == leaderboard.AFTER


def test_in_context_jobs_hold_the_question_in_the_context(kr):
    """The leaderboard's contexts in the papers' protocol: the question ends the context (compressed with it)."""
    import kvjax

    model = kvjax.load_model("smollm2-135m-instruct")
    board = leaderboard.Board(
        model="smollm2-135m-instruct", methods=("full",), ratios=(0.5,), tasks=("single_needle",), length=512,
        contexts=1, batch=1, max_new_tokens=4,
    )  # fmt: skip
    (_, after), (_, inside) = (leaderboard.fit_contexts(model, board, p) for p in leaderboard.PROTOCOLS)
    a, i = after[1][0][0], inside[1][0][0]
    job = kr._jobs([i], ["none"], [], kr.IN_CONTEXT)[0]
    assert job["context"] == list(a.context + a.question) and job["question"] == []
    assert kr.gguf_of("smollm2-135m-instruct").suffix == ".gguf"
    with pytest.raises(ValueError, match="GGUF"):
        kr.gguf_of("/some/hf-folder")


def _row(method, ratio, answer, score, protocol=leaderboard.AFTER, expected=("7",)):
    return {
        "method": method, "ratio": ratio, "subtask": "single_needle", "expected": list(expected), "answer": answer,
        "score": score, "protocol": protocol,
    }  # fmt: skip


def test_agreement_counts_identical_answers_by_hand():
    """Two contexts under SnapKV at 0.5 after the context: one identical answer (white space aside), both scoring
    the same; a context only one side ran is not counted; the papers' protocol is its own cell; methods kvpress
    does not run (H2O) have none."""
    ours = [
        _row("snapkv", 0.5, " 7 is it", 1.0),
        _row("snapkv", 0.5, "8", 0.0, expected=("9",)),
        _row("snapkv", 0.5, "x", 0.0, expected=("5",)),
        _row("snapkv", 0.5, "7", 1.0, leaderboard.IN_CONTEXT),
        _row("h2o", 0.5, "7", 1.0),
        _row("full", 0.0, "7", 1.0),
    ]
    theirs = [
        _row("kvpress SnapKVPress", 0.5, "7 is it\n", 1.0),
        _row("kvpress SnapKVPress", 0.5, "6", 0.0, expected=("9",)),
        _row("kvpress SnapKVPress", 0.5, "3", 0.0, leaderboard.IN_CONTEXT),
        _row("transformers full", 0.0, "7", 1.0),
    ]
    got = leaderboard.agreement(ours, theirs)
    after, inside = ("snapkv", 0.5, leaderboard.AFTER), ("snapkv", 0.5, leaderboard.IN_CONTEXT)
    assert set(got) == {after, inside, ("full", 0.0, leaderboard.AFTER)}
    assert got[after] == {"n": 2, "identical": 1, "same_score": 2, "kvjax": 50.0, "peer": 50.0}
    assert got[inside] == {"n": 1, "identical": 0, "same_score": 0, "kvjax": 100.0, "peer": 0.0}


def test_peer_rows_carry_their_protocol(tmp_path):
    """A folder's earlier kvpress answers (no protocol field) are kvpress's protocol; the papers' protocol is named
    in the row and in its label."""
    lines = [
        {"answer": "7", "press": "SnapKVPress", "ratio": 0.5, "subtask": "single_needle", "expected": ["7"],
         "context_index": 0, "job_key": "0|SnapKVPress|0.5", "seconds": 1.0},
        {"answer": "8", "press": "SnapKVPress", "ratio": 0.5, "subtask": "single_needle", "expected": ["7"],
         "context_index": 0, "job_key": "0|SnapKVPress|0.5|question-in-context", "seconds": 1.0,
         "protocol": leaderboard.IN_CONTEXT},
    ]  # fmt: skip
    (tmp_path / leaderboard.PEER_ROWS).write_text("".join(json.dumps(r) + "\n" for r in lines))
    rows, errors = leaderboard.peer_rows(tmp_path)
    assert errors == {} and [(r["protocol"], r["score"]) for r in rows] == [
        (leaderboard.AFTER, 1.0),
        (leaderboard.IN_CONTEXT, 0.0),
    ]
    labels = {e["method"] for e in leaderboard.summarise(rows, ["single_needle"])}
    assert labels == {"kvpress SnapKVPress", "kvpress SnapKVPress (question in context)"}


def test_committed_comparison_renders_every_row(tmp_path):
    """The SmolLM2 folder's answers (kvjax's and kvpress's) re-rendered running nothing: transformers' full cache under
    both protocols is in the heading, and the averages table has no row without a number."""
    import shutil

    folder = ROOT / "benchmarks" / "results" / "leaderboard-smollm2-50"
    for name in (leaderboard.ROWS, leaderboard.PEER_ROWS):
        shutil.copy(folder / name, tmp_path / name)
    leaderboard.report_only(tmp_path)
    md = (tmp_path / "leaderboard.md").read_text()
    assert "transformers' full cache (the kvpress rows' model): " in md and "the same, question in context: " in md
    averages = md.split("## Average over tasks")[1].split("\n## ")[0]
    rows = [line for line in averages.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    assert rows and all(any(cell.strip() for cell in line.split("|")[2:-1]) for line in rows), averages
