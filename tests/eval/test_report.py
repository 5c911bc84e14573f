"""Results JSON round-trips into the table and plots; aggregation against hand-computed values."""

import math

import pytest

from eval import report


def _results():
    r = report.new_results({"note": "synthetic"})
    rows = []
    for m, b, hits in [("full", None, [1, 1, 1, 1]), ("snapkv", 0.2, [1, 0, 1, 0]), ("snapkv", 0.5, [1, 1, 1, 0])]:
        for i, s in enumerate(hits):
            rows.append(
                {
                    "task": "needle",
                    "method": m,
                    "budget": b,
                    "length": 256 * (1 + i // 2),
                    "depth": float(i % 2),
                    "score": float(s),
                    "cache_bytes": 2048,
                }
            )
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
    assert lines[:3] == ["### needle", "", "| method | budget | needle acc (%) [95% CI] | n | allocated KiB/seq |"]
    # 2 of 4: Wilson [15.0, 85.0]; perplexity rows nll 2 and 1 (10 and 30 tokens): exp(1.25) = 3.49
    assert lines[5] == "| snapkv | 0.2 | 50.0 [15.0, 85.0] | 4 | 2.0 |"
    # t(1) interval of the per-sequence NLLs 2 and 1: 1.5 +- 12.706 * 0.5, exponentiated
    assert lines[lines.index("### perplexity") + 5] == "| snapkv | 0.2 | 3.49 [0.01, 2573.71] | 2 |"
    for key in ("scores_png", "needle_png"):
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # re-plot from the JSON alone, elsewhere
    again = report.write_all(report.load(paths["json"]), tmp_path / "replot")
    md = (tmp_path / "replot" / "results.md").read_text()
    assert md.endswith("\n\n" + table + "\n") and md.startswith("# kvjax-eval results") and "- command: `" in md
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
    for m, b, held, kib in [
        ("full", None, (300.0, 500.0), (64.0, 64.0)),
        ("snapkv", 0.2, (60.0, 100.0), (16.0, 16.0)),
        ("less", 0.2, (61.0, 99.0), (18.0, 20.0)),
    ]:
        for i in range(2):
            rows.append(
                {
                    "task": "needle",
                    "method": m,
                    "budget": b,
                    "length": 256,
                    "depth": float(i),
                    "score": float(i),
                    "tokens_held": held[i],
                    "cache_bytes": int(kib[i] * 1024),
                    "kib_per_seq": kib[i],
                }
            )
            rows.append(
                {
                    "task": "perplexity",
                    "method": m,
                    "budget": b,
                    "nll": 1.0 + i,
                    "tokens": 10,
                    "score": 1.0 + i,
                    "tokens_held": held[i] / 2,
                    "cache_bytes": int(kib[i] * 512),
                    "kib_per_seq": kib[i] / 2,
                }
            )
    r["rows"] = rows
    return r


def test_memory_columns_beside_every_score(tmp_path):
    results = _memory_results()
    mem = report.summarise_memory(results)
    assert mem[("needle", "less", 0.2)] == {"tokens_held": 80.0, "kib_per_seq": 19.0}
    assert mem[("perplexity", "full", None)] == {"tokens_held": 200.0, "kib_per_seq": 32.0}
    lines = report.markdown_table(results).splitlines()
    assert lines[2] == "| method | budget | needle acc (%) [95% CI] | n | tokens held | allocated KiB/seq |"
    # hand-computed: needle 50% (scores 0, 1); held (61+99)/2 = 80; KiB (18+20)/2 = 19; ppl exp((1+2)/2) = 4.48;
    # perplexity rows hold half: 40 tokens, 9.5 KiB
    assert lines[6] == "| less | 0.2 | 50.0 [9.5, 90.5] | 2 | 80.0 | 19.0 |"
    assert lines[4] == "| full | - | 50.0 [9.5, 90.5] | 2 | 400.0 | 64.0 |"
    ppl = lines.index("### perplexity")
    assert lines[ppl + 4].startswith("| full | - | 4.48 [") and lines[ppl + 4].endswith("| 2 | 200.0 | 32.0 |")
    assert lines[ppl + 6].endswith("| 2 | 40.0 | 9.5 |")
    paths = report.write_all(results, tmp_path)
    assert paths["scores_png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_equal_bytes_rows_group_by_nominal_budget():
    results = _memory_results()
    results["config"]["equal_bytes"] = "less"
    for row in results["rows"]:
        if row["method"] == "snapkv":  # chosen token budgets differ per task; the table groups by the nominal one
            row.update(nominal_budget=0.2, budget=57 if row["task"] == "needle" else 31, equal_bytes_ref="less")
    lines = report.markdown_table(results).splitlines()
    # the budget each task ran at follows the nominal one
    assert lines[5] == "| snapkv | 0.2 → 57 (bytes of less) | 50.0 [9.5, 90.5] | 2 | 80.0 | 16.0 |"
    assert sum("| snapkv | 0.2 → 31 (bytes of less) |" in line for line in lines) == 1
    assert len(lines) == 2 * 7 + 1


def test_wilson_inverts_the_score_test():
    """Wilson's interval is the set of p the score test does not reject: |k/n - p| <= z sqrt(p (1 - p) / n).
    Checked by scanning p on a fine grid (independent of the closed form)."""
    import numpy as np

    z = 1.959964
    for k, n in [(0, 6), (3, 6), (6, 6), (7, 20), (19, 20)]:
        p = np.linspace(0, 1, 200001)
        ok = np.abs(k / n - p) <= z * np.sqrt(p * (1 - p) / n)
        lo, hi = report.wilson(k, n)
        assert lo == pytest.approx(p[ok].min(), abs=2e-5) and hi == pytest.approx(p[ok].max(), abs=2e-5)


def test_perplexity_interval_against_scipy():
    """exp of scipy's Student-t interval of the per-sequence mean NLLs; the value stays token-weighted."""
    stats = pytest.importorskip("scipy.stats")
    import numpy as np

    nll = [1.9, 2.3, 2.0, 2.6, 2.2]
    rows = [{"nll": x, "tokens": 48, "score": x} for x in nll]
    ci = report.interval("perplexity", rows)
    lo, hi = stats.t.interval(0.95, len(nll) - 1, loc=np.mean(nll), scale=stats.sem(nll))
    assert ci["n"] == 5 and ci["value"] == pytest.approx(math.exp(np.mean(nll)))
    assert ci["lo"] == pytest.approx(math.exp(lo)) and ci["hi"] == pytest.approx(math.exp(hi))


def test_second_equal_bytes_pass_gets_its_own_rows():
    """The main job's rows at the reference's bytes (``setting="equal_bytes"``) are labelled apart from the
    nominal rows of the same method and budget."""
    results = _memory_results()
    extra = [
        dict(r, setting="equal_bytes", equal_bytes_ref="less", nominal_budget=0.2, budget=40, score=0.0)
        for r in results["rows"]
        if r["method"] == "snapkv" and r["task"] == "needle"
    ]
    results["rows"] += extra
    lines = report.markdown_table(results).splitlines()
    assert "| snapkv = bytes of less | 0.2 → 40 | 0.0 [0.0, 65.8] | 2 | 80.0 | 16.0 |" in lines
    assert "| snapkv | 0.2 | 50.0 [9.5, 90.5] | 2 | 80.0 | 16.0 |" in lines


def _text_boxes(fig):
    """Window extents of every drawn, non-empty text of ``fig`` (titles, labels, the tick labels of the ticks
    inside each axis's view, legend entries, colorbar labels)."""
    from matplotlib.axis import Tick
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    tick_labels = {id(t) for tick in fig.findobj(Tick) for t in (tick.label1, tick.label2)}
    texts = [t for t in fig.findobj(Text) if id(t) not in tick_labels]
    for ax in fig.axes:
        if ax.get_visible() and ax.axison:
            for axis in (ax.xaxis, ax.yaxis):
                texts += [t for tick in axis._update_ticks() for t in (tick.label1, tick.label2)]
    return [
        (t.get_text(), t.get_window_extent(renderer))
        for t in texts
        if t.get_visible() and t.get_text().strip() and (t.axes is None or t.axes.get_visible())
    ]


def _overlaps(boxes, fig):
    fb = fig.bbox
    out = []
    for i, (a, ba) in enumerate(boxes):
        if ba.x0 < fb.x0 - 1 or ba.y0 < fb.y0 - 1 or ba.x1 > fb.x1 + 1 or ba.y1 > fb.y1 + 1:
            out.append((a, "clipped by the figure edge"))
        for b, bb in boxes[i + 1 :]:
            w = min(ba.x1, bb.x1) - max(ba.x0, bb.x0)
            h = min(ba.y1, bb.y1) - max(ba.y0, bb.y0)
            if w > 1 and h > 1:
                out.append((a, b))
    return out


def _held(method, setting):
    """Synthetic bytes held: h2o and chunkkv alike (their points coincide), the equal-bytes pass 10% lower."""
    base = {"full": 8, "h2o": 2, "chunkkv": 2}.get(method, 1 + len(method) % 3)
    return int(2**20 * base * (0.9 if setting else 1.0))


def _read(method, setting):
    """Synthetic bytes one decode step reads: what it holds, a quarter of it for the recall methods."""
    return _held(method, setting) // (4 if method in ("pqcache", "clusterkv", "quest") else 1)


def _main_like_results():
    """Every registered method at one budget plus an equal-bytes pass, two needle lengths x five depths and
    perplexity: the main job's shape, synthetic scores (two methods identical, as h2o/chunkkv were)."""
    from kvjax import methods

    r = report.new_results({"note": "synthetic main"})
    rows = []
    for i, m in enumerate(methods.names()):
        for setting in (None, "equal_bytes") if m not in ("full", "h2o") else (None,):
            b = None if m == "full" else 0.2
            extra = {} if setting is None else {"setting": setting, "equal_bytes_ref": "h2o", "nominal_budget": 0.2}
            for n in (256, 512):
                for d in (0.0, 0.25, 0.5, 0.75, 1.0):
                    rows.append(
                        {
                            "task": "needle",
                            "method": m,
                            "budget": b,
                            "length": n,
                            "depth": d,
                            "score": float((i + int(d * 4) + (setting is None)) % 3 == 0 or m in ("h2o", "chunkkv")),
                            "held_bytes": _held(m, setting),
                            "bytes_read_per_step": _read(m, setting),
                            "kib_per_seq": 1024.0 * (2 + i % 4),
                            "tokens_held": 50.0,
                            **extra,
                        }
                    )
            for k in range(3):
                rows.append(
                    {
                        "task": "perplexity",
                        "method": m,
                        "budget": b,
                        "nll": 2.0 + 0.1 * k + 0.01 * i,
                        "tokens": 48,
                        "score": 2.0,
                        "held_bytes": _held(m, setting),
                        "bytes_read_per_step": _read(m, setting),
                        **extra,
                    }
                )
    r["rows"] = rows
    return r


@pytest.mark.parametrize("which", ["scores", "needle"])
def test_figures_have_no_overlapping_or_clipped_text(which):
    """The defect of the first main job (legend over the data, panel titles on the x labels above, depth labels
    over the neighbouring panel, a clipped '50%'): no two texts of a figure overlap and none leaves the figure."""
    results = _main_like_results()
    fig = report.scores_figure(results) if which == "scores" else report.needle_figure(results)
    boxes = _text_boxes(fig)
    assert len(boxes) > 20
    assert _overlaps(boxes, fig) == []
    if which == "scores":  # the legend sits outside every axes
        legend = fig.legends[0].get_window_extent()
        assert all(not legend.overlaps(ax.get_window_extent()) for ax in fig.axes)
        labels = [t.get_text() for t in fig.legends[0].get_texts()]
        assert "chunkkv (= h2o on needle)" in labels, labels  # identical points are named, not hidden


def test_overlap_check_catches_a_collision():
    """The check above can fail: a panel title too long for its column is reported against its neighbours'."""
    results = _main_like_results()
    fig = report.needle_figure(results)
    axes = [ax for ax in fig.axes if ax.get_title()]
    axes[1].set_title(axes[1].get_title() + " with a long setting name" * 3, fontsize=8)  # into its neighbours
    assert _overlaps(_text_boxes(fig), fig) != []


def test_paired_difference_to_full_against_scipy():
    """The perplexity table's paired column: per sequence, method NLL - full NLL; scipy's t interval of the mean."""
    stats = pytest.importorskip("scipy.stats")
    import numpy as np

    full = [2.0, 3.1, 1.2, 2.6]
    meth = [2.1, 3.3, 1.25, 2.6]
    r = report.new_results({})
    r["rows"] = [
        {"task": "perplexity", "method": "full", "budget": None, "sequence": i, "nll": x, "tokens": 16, "score": x}
        for i, x in enumerate(full)
    ] + [
        {"task": "perplexity", "method": "h2o", "budget": 0.2, "sequence": i, "nll": x, "tokens": 16, "score": x}
        for i, x in enumerate(meth)
    ]
    d = np.subtract(meth, full)
    lo, hi = stats.t.interval(0.95, len(d) - 1, loc=d.mean(), scale=stats.sem(d))
    got = report.paired_vs_full(r)[("h2o", 0.2)]
    assert got["n"] == 4 and got["value"] == pytest.approx(d.mean())
    assert (got["lo"], got["hi"]) == (pytest.approx(lo), pytest.approx(hi))
    assert "| h2o | 0.2 |" in report.markdown_table(r) and "ΔNLL vs full, paired" in report.markdown_table(r)


def test_whole_prompt_budget_is_not_shown_as_one_token():
    """A fraction 1.0 is shown ``1.0`` and a token count 256 ``256`` (``:g`` showed 1.0 as ``1``, a token count)."""
    r = _results()
    for row in r["rows"]:
        if row["budget"] == 0.5:
            row["budget"] = 1.0
        elif row["budget"] == 0.2:
            row["budget"] = 256
    lines = report.markdown_table(r).splitlines()
    assert (
        "| snapkv | 1.0 | 75.0 [30.1, 95.4] | 4 | 2.0 |" in lines
        and "| snapkv | 256 | 50.0 [15.0, 85.0] | 4 | 2.0 |" in lines
    )


def test_scores_figure_shows_bytes_read_beside_bytes_held():
    """Below score vs bytes held, score vs bytes read per step: each method's markers sit at the mean of its rows'
    ``held_bytes`` / ``bytes_read_per_step`` (KiB), so the recall methods, which hold what ``full`` holds, sit at a
    quarter of it on the read panel. Rows without ``bytes_read_per_step`` give no read panel."""
    results = _main_like_results()
    fig = report.scores_figure(results)
    styles = report._styles(results)
    by_style = {(st["color"], st["marker"], st.get("mfc")): m for m, st in styles.items()}
    for task in ("needle", "perplexity"):
        panels = {
            ax.get_title().split(": ")[1].split(" (")[0]: ax for ax in fig.axes if ax.get_title().startswith(task)
        }
        assert set(panels) == {"score vs memory held", "score vs bytes read per step"}, panels
        for what, field in (("memory held", "held_bytes"), ("bytes read per step", "bytes_read_per_step")):
            shown = {}
            for c in panels[f"score vs {what}"].containers:
                line = c.lines[0]
                mfc = "none" if line.get_markerfacecolor() == "none" else None
                shown[by_style[(line.get_color(), line.get_marker(), mfc)]] = float(line.get_xdata()[0])
            for label, x in shown.items():
                method, setting = label.split(" = ")[0], " = " in label
                assert x == pytest.approx((_read if "read" in what else _held)(method, setting) / 1024), (task, label)
            assert len(shown) == len(styles)
        read = {c.lines[0].get_xdata()[0] for c in panels["score vs bytes read per step"].containers}
        assert min(read) < _held("full", None) / 1024 / 2  # the recall methods read a quarter
    for row in results["rows"]:
        del row["bytes_read_per_step"]
    titles = [ax.get_title() for ax in report.scores_figure(results).axes]
    assert not any("read" in t for t in titles) and sum("memory held" in t for t in titles) == 2


def test_fractional_scores_interval_stays_in_range():
    """RULER's partial scores (a multi-value answer scores 1/4 per value found) take scipy's t interval, clipped to
    [0, 100] percent: a cell of n = 3 would otherwise report a negative lower bound."""
    stats = pytest.importorskip("scipy.stats")
    import numpy as np

    scores = [0.25, 0.0, 1.0]
    ci = report.interval("ruler", [{"score": x} for x in scores])
    lo, hi = stats.t.interval(0.95, 2, loc=np.mean(scores), scale=stats.sem(scores))
    assert lo < 0 and hi > 1  # the unclipped interval leaves the range
    assert ci["value"] == pytest.approx(100 * np.mean(scores)) and (ci["lo"], ci["hi"]) == (0.0, 100.0)
    scores = [0.5, 0.75, 0.5, 0.25, 0.5]
    ci = report.interval("ruler", [{"score": x} for x in scores])
    lo, hi = stats.t.interval(0.95, 4, loc=np.mean(scores), scale=stats.sem(scores))
    assert (ci["lo"], ci["hi"]) == (pytest.approx(100 * lo), pytest.approx(100 * hi))


def test_less_gap_closed_by_hand():
    """LESS Table 2's measure, by hand: H2O's gaps to full 0.4 and 0.2 (sum 0.6), LESS's 0.1 and 0.2: LESS gains 0.3
    and 0.0 nats, closing 0.3 / 0.6 = 50% of the gap; the gain's interval is scipy's t interval."""
    stats = pytest.importorskip("scipy.stats")

    r = report.new_results({})
    row = lambda m, b, i, x: {"task": "perplexity", "method": m, "budget": b, "sequence": i, "nll": x, "tokens": 8}
    r["rows"] = [row("full", None, 0, 2.0), row("full", None, 1, 3.0)]
    r["rows"] += [
        row("h2o", 0.05, 0, 2.4),
        row("h2o", 0.05, 1, 3.2),
        row("less", 0.05, 0, 2.1),
        row("less", 0.05, 1, 3.2),
    ]
    r["rows"] += [row("h2o", 0.1, 0, 2.1)]  # no LESS at 0.1: no entry
    got = report.gap_closed(r)
    assert list(got) == [0.05] and got[0.05]["closed"] == pytest.approx(0.5) and got[0.05]["n"] == 2
    lo, hi = stats.t.interval(0.95, 1, loc=0.15, scale=stats.sem([0.3, 0.0]))
    assert (got[0.05]["gain"], got[0.05]["lo"], got[0.05]["hi"]) == tuple(pytest.approx(x) for x in (0.15, lo, hi))
    assert "LESS closes 50% of H2O's gap to full at budget 0.05" in report.markdown_table(r)
