"""Results JSON round-trips into the table and plots; aggregation against hand-computed values."""

import math

import pytest

from eval import report


def _results():
    r = report.new_results({"note": "synthetic"})
    rows = []
    for m, b, hits in [("full", None, [1, 1, 1, 1]), ("snapkv", 0.2, [1, 0, 1, 0]), ("snapkv", 0.5, [1, 1, 1, 0])]:
        for i, s in enumerate(hits):
            rows.append({"task": "needle", "method": m, "budget": b, "length": 256 * (1 + i // 2),
                         "depth": float(i % 2), "score": float(s), "cache_bytes": 2048})
        rows.append({"task": "perplexity", "method": m, "budget": b, "nll": 2.0, "tokens": 10, "score": 2.0})
        rows.append({"task": "perplexity", "method": m, "budget": b, "nll": 1.0, "tokens": 30, "score": 1.0})
    r["rows"] = rows
    return r


def test_summary_hand_computed():
    s = report.summarise(_results())
    assert s[("needle", "snapkv", 0.2)] == 50.0 and s[("needle", "snapkv", 0.5)] == 75.0
    # token-weighted mean NLL = (2*10 + 1*30) / 40 = 1.25
    assert s[("perplexity", "full", None)] == pytest.approx(math.exp(1.25))


def test_round_trip_table_and_plots(tmp_path):
    results = _results()
    paths = report.write_all(results, tmp_path / "run")
    loaded = report.load(paths["json"])
    assert loaded["rows"] == results["rows"] and "jax" in loaded["versions"] and loaded["device"]["backend"]
    table = report.markdown_table(loaded)
    assert table == report.markdown_table(results)
    lines = table.splitlines()
    assert lines[0] == "| method | budget | needle acc (%) | perplexity | KV cache (KiB) |"
    assert lines[3] == "| snapkv | 0.2 | 50.0 | 3.49 | 2 |"
    for key in ("scores_png", "needle_png"):
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # re-plot from the JSON alone, elsewhere
    again = report.write_all(report.load(paths["json"]), tmp_path / "replot")
    assert (tmp_path / "replot" / "results.md").read_text() == table + "\n"
    assert again["needle_png"].stat().st_size > 1000


def test_load_rejects_other_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="results="):
        report.load(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match="not a kvjax-eval results file"):
        report.load(tmp_path / "x.json")
