"""benchmarks/chelsea_clusters.py's statistics of a head's slot counts, by hand."""

from __future__ import annotations

import numpy as np
import pytest
from repo_scripts import load_script


@pytest.fixture(scope="module")
def cc():
    return load_script("benchmarks/chelsea_clusters.py", "bench_chelsea_clusters", beside=True)


def test_slot_counts_give_the_share_of_tokens_in_large_slots(cc):
    s = cc.slot_stats(np.array([0.0, 1, 1, 20, 100, 0]))  # 0: empty slots, not counted
    assert s["slots"] == 4 and s["largest"] == 100 and s["median"] == 10.5
    assert s["share_in_16"] == pytest.approx(120 / 122) and s["share_in_64"] == pytest.approx(100 / 122)
    assert s["share_in_largest"] == pytest.approx(100 / 122)
    m = cc.bc.mean_stats([s, cc.slot_stats(np.array([2.0, 2]))])
    assert m["slots"] == 3 and m["largest"] == 51 and m["share_in_64"] == pytest.approx(round(50 / 122, 3))
    table = cc.markdown({"rows": [{"budget": 0.1, "layer": 5, **m}]})
    assert "| 0.1 | 5 | 3 | 51 |" in table
