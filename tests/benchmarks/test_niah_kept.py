"""benchmarks/niah_kept.py's parts, by hand: where a needle's answer sits in a prompt (its first token may merge
with the word before it), the fraction of it a layer keeps in every KV head, and the split of the scores by whether
the answer was kept whole in every layer."""

from __future__ import annotations

import numpy as np
import pytest
from repo_scripts import load_script


@pytest.fixture(scope="module")
def nk():
    return load_script("benchmarks/niah_kept.py", "bench_niah_kept", beside=True)


def test_the_answer_is_found_where_it_sits(nk):
    prompt = [1, 7, 8, 9, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert nk.answer_span(prompt, [99, 8, 9]) == [10, 11]  # the first token merged: the rest, last occurrence
    assert nk.answer_span(prompt, [2, 3, 4]) == [5, 6]
    with pytest.raises(ValueError, match="not in the prompt"):
        nk.answer_span(prompt, [50, 51, 52])


def test_a_layer_keeps_a_token_only_if_every_kv_head_does(nk):
    mask = np.zeros((2, 2, 8), bool)  # [L, Hkv, T]
    mask[0, :, [2, 3, 4]] = True
    mask[1, 0, [2, 3, 4]] = True
    mask[1, 1, [2]] = True
    assert nk.kept_fraction(mask, [2, 3, 4]).tolist() == [1.0, pytest.approx(1 / 3)]


def test_scores_split_by_whether_the_answer_was_kept(nk):
    rows = [
        {"config": "a", "kept": [1.0, 1.0], "score": 1.0},
        {"config": "a", "kept": [1.0, 1.0], "score": 0.0},
        {"config": "a", "kept": [1.0, 0.5], "score": 0.0},
        {"config": "b", "kept": [0.0, 0.0], "score": 0.0},
    ]
    a, b = nk.summary(rows)
    assert (a["n"], a["score"], a["answer_kept_whole"], a["score_when_kept"], a["score_when_lost"]) == (
        3,
        0.333,
        2,
        0.5,
        0.0,
    )
    assert a["mean_kept_fraction"] == pytest.approx(0.917, abs=1e-3)
    assert (b["answer_kept_whole"], b["score_when_kept"], b["score_when_lost"]) == (0, None, 0.0)
    assert "| a | 3 | 0.33 | 2 | 0.50 | 0.00 | 0.92 |" in nk.markdown({"summary": [a, b]})
