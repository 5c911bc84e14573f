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
    assert lines[0] == "| method | budget | needle acc (%) | KiB/seq (needle) | perplexity |"
    assert lines[3] == "| snapkv | 0.2 | 50.0 | 2.0 | 3.49 |"
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


def _memory_results():
    """Rows recording tokens held and KiB/seq beside every score (what the runner now writes)."""
    r = report.new_results({"note": "synthetic memory"})
    rows = []
    for m, b, held, kib in [("full", None, (300.0, 500.0), (64.0, 64.0)), ("snapkv", 0.2, (60.0, 100.0), (16.0, 16.0)),
                            ("less", 0.2, (61.0, 99.0), (18.0, 20.0))]:
        for i in range(2):
            rows.append({"task": "needle", "method": m, "budget": b, "length": 256, "depth": float(i),
                         "score": float(i), "tokens_held": held[i], "cache_bytes": int(kib[i] * 1024),
                         "kib_per_seq": kib[i]})
            rows.append({"task": "perplexity", "method": m, "budget": b, "nll": 1.0 + i, "tokens": 10,
                         "score": 1.0 + i, "tokens_held": held[i] / 2, "cache_bytes": int(kib[i] * 512),
                         "kib_per_seq": kib[i] / 2})
    r["rows"] = rows
    return r


def test_memory_columns_beside_every_score(tmp_path):
    results = _memory_results()
    mem = report.summarise_memory(results)
    assert mem[("needle", "less", 0.2)] == {"tokens_held": 80.0, "kib_per_seq": 19.0}
    assert mem[("perplexity", "full", None)] == {"tokens_held": 200.0, "kib_per_seq": 32.0}
    lines = report.markdown_table(results).splitlines()
    assert lines[0] == ("| method | budget | needle acc (%) | tokens held (needle) | KiB/seq (needle) | perplexity | "
                        "tokens held (perplexity) | KiB/seq (perplexity) |")
    # hand-computed: needle 50% (scores 0, 1); held (61+99)/2 = 80; KiB (18+20)/2 = 19; ppl exp((1+2)/2) = 4.48;
    # perplexity rows hold half: 40 tokens, 9.5 KiB
    assert lines[4] == "| less | 0.2 | 50.0 | 80.0 | 19.0 | 4.48 | 40.0 | 9.5 |"
    assert lines[2] == "| full | - | 50.0 | 400.0 | 64.0 | 4.48 | 200.0 | 32.0 |"
    paths = report.write_all(results, tmp_path)
    assert paths["scores_png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_equal_bytes_rows_group_by_nominal_budget():
    results = _memory_results()
    results["config"]["equal_bytes"] = "less"
    for row in results["rows"]:
        if row["method"] == "snapkv":  # chosen token budgets differ per task; the table groups by the nominal one
            row.update(nominal_budget=0.2, budget=57 if row["task"] == "needle" else 31, equal_bytes_ref="less")
    lines = report.markdown_table(results).splitlines()
    assert lines[3] == "| snapkv | 0.2 (bytes of less) | 50.0 | 80.0 | 16.0 | 4.48 | 40.0 | 8.0 |"
    assert len(lines) == 5
