"""benchmarks/niah_chunkkv_reference.py's parts, by hand: which prompts it examines (spread over lengths and depths),
a chunk's rank among the chunk scores (ties to the lower index, as ChunkKV's top-k), how close the selection's cut
is, kvjax's kept positions against the reference's, the share of the window's votes per part of the prompt, how
many of the window's tokens are the answer prefix, and where the kept chunks lie."""

from __future__ import annotations

import numpy as np
import pytest
from repo_scripts import load_script


@pytest.fixture(scope="module")
def ck():
    return load_script("benchmarks/niah_chunkkv_reference.py", "bench_niah_chunkkv_reference", beside=True)


def test_prompts_are_spread_over_lengths_and_depths(ck):
    assert ck.spread(list(range(10)), 3) == [0, 4, 9]  # the first, the middle, the last
    assert ck.spread([1, 2], 5) == [1, 2]
    assert ck.spread([1, 2, 3], 1) == [1] and ck.spread([1, 2], 0) == []
    rows = [{"length": n, "depth": d} for n in (1024, 2048) for d in (0.0, 0.5, 1.0)]
    got = ck.pick(rows, [1024, 2048], 3)  # 2 of the first length, 1 of the second
    assert [(r["length"], r["depth"]) for r in got] == [(1024, 0.0), (1024, 1.0), (2048, 0.0)]


def test_a_chunk_ranks_among_the_scores_ties_to_the_lower_index(ck):
    scores = np.array([0.5, 3.0, 1.0, 3.0, 0.1])
    assert ck.chunk_ranks(scores, [1, 3, 2, 0, 4]) == [1, 2, 3, 4, 5]
    assert ck.chunk_ranks(scores, []) == []


def test_the_cut_gap_is_zero_at_a_tie(ck):
    assert ck.cut_gap(np.array([4.0, 1.0, 2.0, 2.0]), 2) == 0.0  # 2nd and 3rd best tie
    assert ck.cut_gap(np.array([4.0, 1.0, 2.0]), 1) == pytest.approx(0.5)  # (4 - 2) / 4
    assert ck.cut_gap(np.array([4.0, 1.0]), 2) is None  # every chunk kept


def test_kept_positions_are_compared_as_sets_and_in_order(ck):
    same = ck.compare_kept([5, 6, 0, 1], [5, 6, 0, 1])
    assert same == {"equal": True, "same_order": True, "jaccard": 1.0, "only_kvjax": [], "only_reference": []}
    moved = ck.compare_kept([0, 1, 5, 6], [5, 6, 0, 1])
    assert moved["equal"] and not moved["same_order"]
    other = ck.compare_kept([0, 1, 2, 9], [0, 1, 3, 9])
    assert (other["equal"], other["jaccard"], other["only_kvjax"], other["only_reference"]) == (False, 0.6, [2], [3])


def test_vote_shares_per_part_and_the_rest(ck):
    votes = np.array([4.0, 1.0, 1.0, 2.0, 0.0, 2.0])
    got = ck.vote_shares(votes, {"first": [0], "needle": [1, 2], "window": [5]})
    assert got == {"first": 0.4, "needle": 0.2, "window": 0.2, "rest": 0.2}


def test_the_tail_is_the_longest_suffix_the_prompt_ends_with(ck):
    assert ck.tail_length([9, 1, 2, 3], [1, 2, 3]) == 3
    assert ck.tail_length([9, 8, 2, 3], [1, 2, 3]) == 2  # its first token merged with the one before
    assert ck.tail_length([9, 8, 7], [1, 2]) == 0


def test_kept_chunks_are_placed_by_the_first_range_they_overlap(ck):
    places = {"start": range(1), "needle": range(23, 45), "question": range(90, 100)}
    got = ck.chunk_places([0, 2, 4, 5, 8, 9], 10, places)  # chunk 4 holds 40-49: needle; 5 holds 50-59: haystack
    assert got == {"start": 1, "needle": 2, "question": 1, "haystack": 2}


def test_the_summary_splits_by_layer_and_score(ck):
    def row(layer, score, ranks, equal=True):
        return {
            "layer": layer,
            "score": score,
            "equal": equal,
            "jaccard": 1.0 if equal else 0.5,
            "chunks_kept": 12,
            "answer_chunk_ranks": ranks,
            "vote_share": {"first": 0.2, "needle": 0.1, "question": 0.3},
            "answer_vote_share": 0.05,
            "kept_chunks_in": {"start": 1, "needle": 1, "question": 2, "haystack": 8},
        }

    rows = [row(5, 0.0, [3, 79]), row(5, 0.0, [20], equal=False), row(5, 1.0, [4]), row(11, 0.0, [13, 2])]
    s5f, s5p, s11 = ck.summary(rows, [5, 11])
    assert (s5f["n"], s5f["equal"], s5f["mean_jaccard"], s5f["median_worst_answer_rank"]) == (2, 1, 0.75, 49.5)
    assert (s5f["best_worst_answer_rank"], s5f["answer_chunks_all_kept"]) == (20, 0)
    assert (s5p["score"], s5p["answer_chunks_all_kept"], s5p["kept_chunks_in"]["haystack"]) == (1.0, 1, 8)
    assert (s5p["needle_vote_share"], s5p["answer_vote_share"]) == (0.1, 0.05)
    assert (s11["layer"], s11["median_worst_answer_rank"], s11["answer_chunks_all_kept"]) == (11, 13.0, 0)
