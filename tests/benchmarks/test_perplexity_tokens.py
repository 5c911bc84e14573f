"""benchmarks/perplexity_tokens.py's parts, by hand: which continuation tokens only the far context can copy, and
the split of a method's excess NLL over those classes."""

from __future__ import annotations

import numpy as np
import pytest
from repo_scripts import load_script


@pytest.fixture(scope="module")
def pt():
    return load_script("benchmarks/perplexity_tokens.py", "bench_perplexity_tokens", beside=True)


def test_a_token_is_a_copy_by_where_its_ngram_last_occurred(pt):
    #        0  1  2  3  4  5  6  7  8  9 10 11 | prefix 10: tokens 10, 11 scored
    seq = np.array([5, 6, 7, 1, 2, 3, 4, 8, 9, 5, 6, 7])
    # (5, 6) ends at 1 (9 back from 10): far with a window of 4; (6, 7) ends at 2 (9 back from 11): far
    assert pt.token_classes(seq, 10, ngram=2, window=4) == ["far copy", "far copy"]
    assert pt.token_classes(seq, 10, ngram=2, window=9) == ["near copy", "near copy"]
    assert pt.token_classes(seq, 10, ngram=3, window=4) == ["new", "far copy"]  # (9, 5, 6) never occurred
    assert pt.token_classes(seq, 10, ngram=2, window=0) == ["far copy", "far copy"]  # no local window: any is far
    # the latest occurrence decides: a near one beside a far one is near
    seq2 = np.array([5, 6, 0, 0, 0, 0, 5, 6, 0, 5, 6])
    assert pt.token_classes(seq2, 10, ngram=2, window=4) == ["near copy"]
    assert pt.token_classes(seq2, 10, ngram=2, window=3) == ["near copy"]  # ends at 7 = 10 - 3: within the window
    assert pt.token_classes(seq2, 10, ngram=2, window=2) == ["far copy"]


def test_the_excess_is_split_over_the_classes(pt):
    delta = np.array([1.0, 3.0, 0.0, 0.0, 0.5, -0.5])
    full = np.array([0.1, 0.3, 2.0, 4.0, 1.0, 1.0])
    classes = ["far copy", "far copy", "new", "new", "near copy", "near copy"]
    rows = {r["class"]: r for r in pt.summarise(delta, full, classes)}
    assert rows["far copy"]["n"] == 2 and rows["far copy"]["delta_nll"] == 2.0
    assert rows["far copy"]["full_nll"] == pytest.approx(0.2)
    assert rows["far copy"]["share_of_excess"] == pytest.approx(1.0)  # 4 of the 4 summed
    assert rows["new"]["share_of_excess"] == 0.0 and rows["near copy"]["delta_nll"] == 0.0
    lo, hi = rows["far copy"]["ci"]
    # t(0.975, 1) sd / sqrt(n), sd = sqrt(n) = sqrt(2)
    assert lo < 2.0 < hi and hi - lo == pytest.approx(2 * 12.706, rel=1e-3)
    assert "| far copy | 2 |" in pt.markdown({"summary": {"x@0.1": list(rows.values())}})
