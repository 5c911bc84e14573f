"""Results: JSON (config, versions, device, timings, per-example rows), a markdown table and PNG plots.

Everything shown is derived from the JSON's ``rows``, so ``kvjax-eval plot results.json`` redraws the table
and plots without re-running. A row is one scored example: ``{"task", "method", "budget" (None for full),
"score", ...task fields}``; ``TASKS[task]`` says how rows aggregate (mean percent, or perplexity from the
rows' ``nll`` and ``tokens``).
"""

from __future__ import annotations

import collections
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

SCHEMA = "kvjax-eval/1"

#: task -> (column title, aggregation, higher is better)
TASKS: dict[str, tuple[str, str, bool]] = {
    "needle": ("needle acc (%)", "mean_percent", True),
    "ruler": ("RULER (%)", "mean_percent", True),
    "perplexity": ("perplexity", "perplexity", False),
    "longgen": ("long-gen perplexity", "perplexity", False),
    "longbench": ("LongBench (%)", "mean_percent", True),
    "fidelity": ("attn rel. error", "mean", False),
}


#: task -> extra columns (title, row field) averaged over the rows that have the field (None = not measured)
EXTRA_COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {
    "fidelity": (
        ("top-k recall", "recall_mean"),
        ("top-B recall", "topb_recall_mean"),
        ("layer Jaccard", "jaccard_mean"),
    ),
}


def environment() -> dict[str, Any]:
    """Library versions and the device, for the JSON."""
    import flax
    import jax
    import numpy as np

    import kvjax

    devices = jax.devices()
    return {
        "versions": {
            "kvjax": kvjax.__version__,
            "jax": jax.__version__,
            "jaxlib": getattr(jax.lib, "__version__", None) or _dist_version("jaxlib"),
            "flax": flax.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
        "device": {
            "backend": jax.default_backend(),
            "devices": [str(d) for d in devices],
            "kind": devices[0].device_kind,
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
        },
    }


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _commit() -> str | None:
    """The git commit of the kvjax checkout this runs from (``+dirty`` with local changes), or None."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def new_results(config: dict[str, Any]) -> dict[str, Any]:
    import shlex
    import sys

    command = " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).name] + sys.argv[1:])
    return {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "config": config,
        **environment(),
        "commit": _commit(),
        "command": command,
        "timings": {"runs": []},
        "rows": [],
    }


def header(results: dict[str, Any]) -> str:
    """The lines results.md opens with: model, dtype, tasks and their sizes, budgets, n per cell, versions,
    device, commit and command; then how to read the tables (and the run's own notes, ``config["notes"]``)."""
    cfg = results.get("config", {})
    tasks = cfg.get("tasks", {})
    n = collections.Counter(_key(r) for r in results["rows"])
    per_task = {t: sorted({c for k, c in n.items() if k[0] == t}) for t in _tasks(results)}
    lines = [
        f"# kvjax-eval results ({results.get('created', '')})",
        "",
        f"- model: `{cfg.get('model', '?')}`, dtype {cfg.get('dtype', '?')}; methods "
        f"{', '.join(cfg.get('methods', []))}; budgets {', '.join(_budget_text(b) for b in cfg.get('budgets', []))}"
        + (f"; also at the bytes of `{cfg['equal_bytes_also']}`" if cfg.get("equal_bytes_also") else "")
        + (f"; budgets matched to the bytes `{cfg['equal_bytes']}` holds" if cfg.get("equal_bytes") else ""),
    ]
    if cfg.get("layers"):
        lines.append(f"- layers: {cfg['layers']}")
    for t, spec in tasks.items():
        size = ", ".join(f"{k}={v}" for k, v in spec.items() if k not in ("name",))
        lines.append(f"- {t}: {size}; n per cell {'/'.join(map(str, per_task.get(t, []))) or '-'}")
    v, d, timings = results.get("versions", {}), results.get("device", {}), results.get("timings", {})
    lines += [
        f"- jax {v.get('jax')}, kvjax {v.get('kvjax')}, {d.get('backend')} ({d.get('kind')}, "
        f"{d.get('cpu_count')} cores); commit `{results.get('commit')}`; "
        f"wall {timings.get('wall_seconds', float('nan')):.0f} s"
        + (
            f" this run; the folder's cells took {timings['cell_seconds_all_runs']:.0f} s in all its runs"
            if "cell_seconds_all_runs" in timings
            else ""
        ),
        f"- command: `{results.get('command', '')}`",
        "",
        "How to read this: " + HOW_TO_READ,
    ]
    if cfg.get("notes"):
        lines += ["", cfg["notes"]]
    return "\n".join(lines)


HOW_TO_READ = (
    "each cell is the mean over n trials with a 95% interval (Wilson for accuracies, Student's t over "
    "sequences for perplexity): cells whose intervals overlap are not shown to differ. Perplexity varies "
    "more between texts than between methods, so its table also gives the paired difference of mean NLL "
    "to full on the same sequences (an interval excluding 0 is a real difference). `budget` is the "
    "nominal one, a fraction of each prompt (or a token count); `held KiB/seq` is what a sequence's KV "
    "cache holds at the end of generation (measured from the state: tokens held x bytes per slot, plus "
    "codes, centroids and low-rank states), `allocated KiB/seq` the buffer the fixed-shape state reserves "
    "for the bucket and max new tokens, `read KiB/step` the bytes one decode step reads. Methods that keep "
    "generated tokens (SnapKV, PyramidKV, ChunkKV, Chelsea) end holding more than their nominal budget; "
    "the recall methods (PQCache, ClusterKV, Quest) hold every token and save reads, not memory. Rows "
    "`= bytes of REF` rerun a method at the budget (after the arrow) whose bytes held at the end of "
    "generation match REF's at that nominal budget, on average over the task's prompts."
)


def save(results: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=_jsonable))
    tmp.replace(path)
    return path


def _jsonable(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON serialisable")


def load(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"results={str(path)!r} does not exist; pass the results.json a run wrote")
    results = json.loads(path.read_text())
    if results.get("schema") != SCHEMA or "rows" not in results:
        raise ValueError(f"results={str(path)!r} is not a kvjax-eval results file (schema {SCHEMA!r})")
    return results


def _budget_text(budget) -> str:
    """:func:`kvjax.budget.budget_text` (imported here: this module loads without jax)."""
    from kvjax.budget import budget_text

    return budget_text(budget)


def _config(row) -> tuple[str, float | int | None]:
    """A row's (label, budget) as shown: the nominal budget for ``--equal-bytes`` rows (whose budget is chosen
    per task to match the bytes the reference method holds at the end of generation); rows of a second,
    equal-bytes pass beside nominal ones (``setting == "equal_bytes"``, the main job) are labelled ``"method =
    bytes of REF"``."""
    name = row["method"]
    if row.get("setting") == "equal_bytes":
        name = f"{name} = bytes of {row['equal_bytes_ref']}"
    return name, row.get("nominal_budget", row["budget"])


def _key(row) -> tuple[str, str, float | int | None]:
    return (row["task"],) + _config(row)


def _groups(results) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list] = collections.defaultdict(list)
    for row in results["rows"]:
        groups[_key(row)].append(row)
    return groups


def summarise(results: dict[str, Any]) -> dict[tuple[str, str, float | int | None], float]:
    """(task, method, budget) -> aggregated score (see ``TASKS``)."""
    return {key: interval(key[0], rows)["value"] for key, rows in _groups(results).items()}


def t_quantile(df: int) -> float:
    """The two-sided 95% quantile of Student's t with ``df`` degrees of freedom."""
    from scipy import stats

    return float(stats.t.ppf(0.975, df))


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95% Wilson score interval of ``k`` successes in ``n`` trials (Wilson, 1927), as fractions."""
    if n == 0:
        return math.nan, math.nan
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def t_interval(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return math.nan, math.nan
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(n - 1) * sd / math.sqrt(n)
    return mean - half, mean + half


def interval(task: str, rows: list[dict]) -> dict[str, float]:
    """``{"value", "lo", "hi", "n"}`` of one (task, method, budget) cell, a 95% interval: Wilson for accuracies
    whose rows score 0 or 1 (needle, RULER), Student's t over the rows' means otherwise (clipped to [0, 100] for
    percentages); for perplexity the value
    is ``exp`` of the token-weighted mean NLL and the interval ``exp`` of the t interval of the per-sequence mean
    NLLs (``n`` = sequences). NaN bounds where ``n < 2``."""
    kind = TASKS.get(task, (task, "mean", True))[1]
    n = len(rows)
    if kind == "perplexity":
        tokens = sum(r["tokens"] for r in rows)
        lo, hi = t_interval([r["nll"] for r in rows])
        value = math.exp(sum(r["nll"] * r["tokens"] for r in rows) / tokens)
        return {"value": value, "lo": math.exp(lo), "hi": math.exp(hi), "n": n}
    scores = [float(r["score"]) for r in rows]
    mean = sum(scores) / n
    if kind == "mean_percent" and all(x in (0.0, 1.0) for x in scores):
        lo, hi = wilson(int(sum(scores)), n)
    else:
        lo, hi = t_interval(scores)
        if kind == "mean_percent":  # scores are fractions of the answer: the interval stays in [0, 1]
            lo, hi = max(0.0, lo), min(1.0, hi)
    scale = 100.0 if kind == "mean_percent" else 1.0
    return {"value": scale * mean, "lo": scale * lo, "hi": scale * hi, "n": n}


def summarise_intervals(results: dict[str, Any]) -> dict[tuple, dict[str, float]]:
    """(task, method, budget) -> :func:`interval` of its rows."""
    return {key: interval(key[0], rows) for key, rows in _groups(results).items()}


#: memory summary field -> (row field, scale): bytes fields shown in KiB
_MEMORY_FIELDS = {
    "tokens_held": ("tokens_held", 1.0),
    "held_kib": ("held_bytes", 1 / 1024),
    "kib_per_seq": ("kib_per_seq", 1.0),
    "read_kib": ("bytes_read_per_step", 1 / 1024),
}


def _memory_value(row, field) -> float | None:
    src, scale = _MEMORY_FIELDS[field]
    if field == "kib_per_seq" and row.get("kib_per_seq") is None and row.get("cache_bytes") is not None:
        return row["cache_bytes"] / 1024  # old results with only cache_bytes
    return None if row.get(src) is None else row[src] * scale


def summarise_memory(results: dict[str, Any]) -> dict[tuple, dict[str, float]]:
    """(task, method, budget) -> means over the rows that record them of ``tokens_held``, ``held_kib`` (KiB the
    sequence holds at the end), ``kib_per_seq`` (KiB allocated per sequence) and ``read_kib`` (KiB one decode
    step reads per sequence); a field is absent when no row records it."""
    acc: dict[tuple, dict[str, list]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for row in results["rows"]:
        for field in _MEMORY_FIELDS:
            v = _memory_value(row, field)
            if v is not None:
                acc[_key(row)][field].append(v)
    return {k: {f: sum(xs) / len(xs) for f, xs in v.items()} for k, v in acc.items()}


def _configs(results) -> list[tuple[str, float | int | None]]:
    return list(dict.fromkeys(_config(row) for row in results["rows"]))


def _tasks(results) -> list[str]:
    return list(dict.fromkeys(row["task"] for row in results["rows"]))


MEMORY_COLUMNS = (
    ("tokens held", "tokens_held"),
    ("held KiB/seq", "held_kib"),
    ("allocated KiB/seq", "kib_per_seq"),
    ("read KiB/step", "read_kib"),
)


def _budget_cell(results, groups, task, method, budget) -> str:
    """The nominal budget, and for rows matched to a reference's bytes the budget they ran at (``0.2 → 0.158``);
    ``groups``: :func:`_groups` of ``results``."""
    if budget is None:
        return "-"
    ran = sorted(
        {
            r["budget"]
            for r in groups.get((task, method, budget), ())
            if r["budget"] is not None and r["budget"] != budget
        }
    )
    text = _budget_text(budget) + (" → " + ", ".join(f"{b:.4g}" for b in ran) if ran else "")
    ref = results.get("config", {}).get("equal_bytes")
    return f"{text} (bytes of {ref})" if ref and method not in ("full", ref) else text


def _score_cell(ci: dict | None, agg: str) -> str:
    if ci is None:
        return ""
    fmt = "{:.1f}" if agg == "mean_percent" else "{:.3f}" if agg == "mean" else "{:.2f}"
    text = fmt.format(ci["value"])
    if not math.isnan(ci["lo"]):
        text += f" [{fmt.format(ci['lo'])}, {fmt.format(ci['hi'])}]"
    return text


def interval_text(c: dict, digits: int = 1) -> str:
    """``value [lo, hi]`` of an :func:`interval` (the bounds to the unit; the value alone where they are NaN)."""
    if math.isnan(c["lo"]):
        return f"{c['value']:.{digits}f}"
    return f"{c['value']:.{digits}f} [{c['lo']:.0f}, {c['hi']:.0f}]"


def paired_vs_full(results: dict[str, Any], task: str = "perplexity") -> dict[tuple, dict[str, float]]:
    """(method, budget) -> the mean per-sequence difference of mean NLL to ``full`` on the same sequences, with its
    95% Student-t interval (paired: the spread between texts, which dominates a perplexity interval, cancels) and
    ``n``; only configurations whose rows carry the ``sequence`` index of a ``full`` row."""
    groups = _groups(results)
    full = {r.get("sequence"): r["nll"] for r in groups.get((task, "full", None), ()) if r.get("sequence") is not None}
    out = {}
    for (t, m, b), rows in groups.items():
        diffs = [
            r["nll"] - full[r["sequence"]] for r in rows if t == task and m != "full" and r.get("sequence") in full
        ]
        if diffs:
            lo, hi = t_interval(diffs)
            out[(m, b)] = {"value": sum(diffs) / len(diffs), "lo": lo, "hi": hi, "n": len(diffs)}
    return out


def gap_closed(
    results: dict[str, Any], task: str = "perplexity", base: str = "h2o", by: str = "less"
) -> dict[Any, dict[str, float]]:
    """budget -> the fraction of ``base``'s NLL gap to ``full`` that ``by`` closes at that budget (LESS Table 2:
    ``1 - ΔNLL_by / ΔNLL_base``, each the mean over the same sequences), with ``by``'s paired gain over ``base``
    (``ΔNLL_base - ΔNLL_by`` per sequence: mean, 95% t interval, n). Budgets where both ran on the sequences of a
    ``full`` row."""
    groups = _groups(results)
    full = {r.get("sequence"): r["nll"] for r in groups.get((task, "full", None), ()) if r.get("sequence") is not None}
    nll = lambda m, b: {r["sequence"]: r["nll"] for r in groups.get((task, m, b), ()) if r.get("sequence") in full}
    out = {}
    for t, m, b in groups:
        if t != task or m != base:
            continue
        a, c = nll(base, b), nll(by, b)
        seqs = sorted(set(a) & set(c))
        if not seqs:
            continue
        gap = sum(a[i] - full[i] for i in seqs)
        gains = [a[i] - c[i] for i in seqs]
        lo, hi = t_interval(gains)
        out[b] = {
            "closed": sum(gains) / gap if gap else math.nan,
            "gain": sum(gains) / len(gains),
            "lo": lo,
            "hi": hi,
            "n": len(seqs),
        }
    return out


def _task_table(results, task, intervals, memory, extra) -> list[str]:
    title, agg, _ = TASKS.get(task, (task, "mean", True))
    mem_cols = [(t, f) for t, f in MEMORY_COLUMNS if any(f in v for k, v in memory.items() if k[0] == task)]
    paired = paired_vs_full(results, task) if agg == "perplexity" else {}
    head = ["method", "budget", f"{title} [95% CI]", "n"] + [t for t, _ in EXTRA_COLUMNS.get(task, ())]
    head += ["ΔNLL vs full, paired [95% CI]"] if paired else []
    head += [t for t, _ in mem_cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|"]
    groups = _groups(results)
    for method, budget in _configs(results):
        ci = intervals.get((task, method, budget))
        if ci is None:
            continue
        cells = [method, _budget_cell(results, groups, task, method, budget), _score_cell(ci, agg), str(ci["n"])]
        for _, field in EXTRA_COLUMNS.get(task, ()):
            xs = extra.get((task, field, method, budget))
            cells.append(f"{sum(xs) / len(xs):.3f}" if xs else "")
        if paired:
            cells.append("-" if method == "full" else _score_cell(paired.get((method, budget)), "mean"))
        for _, field in mem_cols:
            m = memory.get((task, method, budget), {}).get(field)
            cells.append("" if m is None else f"{m:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    if agg == "perplexity":
        for b, g in gap_closed(results, task).items():
            lines.append(
                f"\nLESS closes {100 * g['closed']:.0f}% of H2O's gap to full at budget {_budget_text(b)} "
                f"(LESS Table 2's measure); per sequence, H2O's NLL minus LESS's: {g['gain']:.3f} "
                f"[{g['lo']:.3f}, {g['hi']:.3f}] nats (n = {g['n']})."
            )
    return lines


def markdown_table(results: dict[str, Any]) -> str:
    """Per task a table, one line per (method, budget): the score with its 95% interval (:func:`interval`) and
    ``n``, the task's extra columns, then where rows record them: tokens held, KiB held per sequence at the end,
    KiB allocated per sequence and KiB one decode step reads. Several tasks: each table under a ``###`` heading."""
    intervals = summarise_intervals(results)
    memory = summarise_memory(results)
    extra = collections.defaultdict(list)
    for row in results["rows"]:
        for _, field in EXTRA_COLUMNS.get(row["task"], ()):
            if row.get(field) is not None:
                extra[(row["task"], field) + _config(row)].append(row[field])
    tasks = _tasks(results)
    out: list[str] = []
    for task in tasks:
        if len(tasks) > 1:
            out += ([""] if out else []) + [f"### {task}", ""]
        out += _task_table(results, task, intervals, memory, extra)
    return "\n".join(out)


#: marker shapes cycled over methods (with the colour cycle: no two methods share both)
_MARKERS = "osD^vP*Xh<>p"


def _styles(results) -> dict[str, dict]:
    """Per method label: colour and marker (``full`` black squares); equal-bytes labels hollow markers of their
    method's style."""
    from matplotlib import rcParams

    colours = rcParams["axes.prop_cycle"].by_key()["color"]
    base = [m for m in dict.fromkeys(r["method"] for r in results["rows"]) if m != "full"]
    styles = {"full": {"color": "k", "marker": "s"}}
    for i, m in enumerate(base):
        styles[m] = {"color": colours[i % len(colours)], "marker": _MARKERS[i % len(_MARKERS)]}
    for label, _ in _configs(results):
        method = label.split(" = ")[0]
        if label != method:
            styles[label] = {**styles[method], "mfc": "none"}
    return styles


def _identical_note(points: dict[str, tuple]) -> dict[str, str]:
    """label -> ' (= other)' for configurations whose plotted points equal an earlier one's exactly (a line drawn
    under another is otherwise invisible)."""
    seen: dict[tuple, str] = {}
    notes = {}
    for label, pts in points.items():
        key = tuple(pts)
        if key in seen:
            notes[label] = f" (= {seen[key]})"
        else:
            seen[key] = label
    return notes


#: The score-against-bytes panels of :func:`scores_figure`: (memory field or fields, first found, title, x label).
BYTES_PANELS = (
    (("held_kib", "kib_per_seq"), "score vs memory held", "KV held per sequence at the end (MiB)", ""),
    (("read_kib",), "score vs bytes read per step", "KV read per decode step and sequence (MiB)", " reads"),
)


def _bytes_panel(ax, task, cells, memory, fields, styles, handles, notes_all, suffix) -> bool:
    """One task's score (95% intervals) against the first of ``fields`` recorded (KiB, log x); False when no
    configuration records one. Identical point sets are noted in ``notes_all`` as on ``task + suffix``."""
    pts = {}
    for (m, b), ci in cells.items():
        mem = memory.get((task, m, b), {})
        x = next((mem[f] for f in fields if mem.get(f) is not None), None)
        if x is not None:
            pts.setdefault(m, []).append((b, x, ci))
    notes = _identical_note(
        {
            m: [(round(x, 3), round(ci["value"], 6)) for _, x, ci in sorted(p, key=lambda p: str(p[0]))]
            for m, p in pts.items()
        }
    )
    for m, p in pts.items():
        xs = [x for _, x, _ in p]
        ys = [ci["value"] for _, _, ci in p]
        err = [
            [max(0.0, ci["value"] - ci["lo"]) if not math.isnan(ci["lo"]) else 0.0 for _, _, ci in p],
            [max(0.0, ci["hi"] - ci["value"]) if not math.isnan(ci["hi"]) else 0.0 for _, _, ci in p],
        ]
        handles.setdefault(m, ax.errorbar(xs, ys, yerr=err, ls="", capsize=2, elinewidth=0.8, ms=6, **styles[m]))
        if m in notes and (notes[m], task) not in notes_all[m]:  # named once when equal on held and read alike
            notes_all[m].append((notes[m], task + suffix))
    return bool(pts)


def scores_figure(results: dict[str, Any]):
    """The figure :func:`plot_scores` saves (a ``matplotlib.figure.Figure``, no pyplot): per task (columns), score
    vs budget (when several budgets ran), score vs KV bytes held and, where rows record it, score vs KV bytes read
    per decode step (the recall methods hold everything and read a fraction)."""
    from matplotlib.figure import Figure

    intervals = summarise_intervals(results)
    memory = summarise_memory(results)
    tasks = _tasks(results)
    styles = _styles(results)
    budgets = {b for _, b in _configs(results) if b is not None}
    by_budget = len(budgets) > 1
    panels = [p for p in BYTES_PANELS if any(set(p[0]) & set(v) for v in memory.values())] or BYTES_PANELS[:1]
    nrows = by_budget + len(panels)
    fig = Figure(figsize=(5.2 * len(tasks) + 2.6, 4.2 * nrows), layout="constrained")
    axes = fig.subplots(nrows, len(tasks), squeeze=False)
    handles, notes_all = {}, collections.defaultdict(list)
    for col, task in enumerate(tasks):
        title, _, higher = TASKS.get(task, (task, "mean", True))
        cells = {(m, b): ci for (t, m, b), ci in intervals.items() if t == task}
        for row, (fields, what, xlabel, suffix) in enumerate(panels, start=by_budget):
            ax = axes[row][col]
            ax.set_title(f"{task}: {what} ({'higher' if higher else 'lower'} is better)", fontsize=9)
            if not _bytes_panel(ax, task, cells, memory, fields, styles, handles, notes_all, suffix):
                ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, fontsize=8)
                ax.set_xticks([])
                ax.set_yticks([])
                continue
            ax.set_xlabel(xlabel)
            ax.set_ylabel(title)
            _mib_axis(ax)
            if TASKS.get(task, ("", "mean"))[1] == "perplexity":
                ax.set_yscale("log")  # one bad configuration would flatten the rest
            ax.grid(alpha=0.3)
        if by_budget:
            ax = axes[0][col]
            lines = collections.defaultdict(list)
            for (m, b), ci in cells.items():
                lines[m].append((b, ci["value"]))
            for m, p in lines.items():
                if all(b is None for b, _ in p):
                    ax.axhline(p[0][1], ls="--", color="k", lw=1)
                    continue
                p = sorted((q for q in p if q[0] is not None), key=lambda q: (isinstance(q[0], int), q[0]))
                ax.plot([b for b, _ in p], [v for _, v in p], **styles[m], ms=5)
            ax.set_title(f"{task}: score vs budget (full dashed)", fontsize=9)
            ax.set_xlabel("budget (fraction of the prompt, or tokens)")
            ax.set_ylabel(title)
            ax.grid(alpha=0.3)
    if handles:
        labels = []
        for m in handles:
            same = collections.defaultdict(list)  # " (= other)" -> tasks
            for note, task in notes_all.get(m, ()):
                same[note].append(task)
            labels.append(m + "".join(f"{note[:-1]} on {', '.join(ts)})" for note, ts in same.items()))
        refs = sorted({m.split(" = bytes of ")[1] for m in handles if " = bytes of " in m})
        title = "method (error bars: 95% CI)" + (f"\nhollow: at the bytes of {', '.join(refs)}" if refs else "")
        fig.legend(list(handles.values()), labels, loc="outside right upper", fontsize=8, title=title, title_fontsize=8)
    return fig


def _mib_axis(ax) -> None:
    """A log-scale x axis of KiB values labelled in MiB at powers of two (no minor labels to collide)."""
    from matplotlib import ticker

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(ticker.LogLocator(base=2))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v / 1024:g}"))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())


def plot_scores(results: dict[str, Any], path: str | Path) -> Path:
    """Per task (columns): score with its 95% interval vs the KV bytes each sequence holds at the end (one marker
    per method and budget; hollow: the equal-bytes pass), below it vs the KV bytes one decode step reads (where the
    rows record ``bytes_read_per_step``), and above them score vs budget when several budgets ran. One legend,
    outside the data."""
    fig = scores_figure(results)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def needle_figure(results: dict[str, Any]):
    """The figure :func:`plot_needle` saves, or None without needle rows."""
    rows = [r for r in results["rows"] if r["task"] == "needle"]
    if not rows:
        return None
    import numpy as np
    from matplotlib.figure import Figure

    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    configs = [c for c in _configs(results) if any(_config(r) == c for r in rows)]
    cols = min(4, len(configs))
    nrows = -(-len(configs) // cols)
    fig = Figure(figsize=(3.3 * cols + 1.2, 2.6 * nrows + 0.6), layout="constrained")
    axes = fig.subplots(nrows, cols, squeeze=False)
    for ax in axes.flat[len(configs) :]:
        ax.axis("off")
    for i, (ax, (m, b)) in enumerate(zip(axes.flat, configs)):
        grid = np.full((len(depths), len(lengths)), np.nan)
        acc = collections.defaultdict(list)
        for r in rows:
            if _config(r) == (m, b):
                acc[(r["depth"], r["length"])].append(r["score"])
        for (d, n), s in acc.items():
            grid[depths.index(d), lengths.index(n)] = 100.0 * sum(s) / len(s)
        im = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
        ax.set_title(m if b is None else f"{m} @ {_budget_text(b)}", fontsize=8)
        if i // cols == nrows - 1 or i + cols >= len(configs):
            ax.set_xlabel("context (tokens)", fontsize=7)
        if i % cols == 0:
            ax.set_ylabel("needle depth", fontsize=7)
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="accuracy (%)")
    return fig


def plot_needle(results: dict[str, Any], path: str | Path) -> Path | None:
    """The needle heatmap (depth x context length, colour = accuracy), one panel per (method, budget)."""
    fig = needle_figure(results)
    if fig is None:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def write_all(results: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """results.json, results.md, scores.png and (with needle rows) needle.png in ``out_dir``."""
    out = Path(out_dir)
    paths = {"json": save(results, out / "results.json")}
    (out / "results.md").write_text(header(results) + "\n\n" + markdown_table(results) + "\n")
    paths["markdown"] = out / "results.md"
    paths["scores_png"] = plot_scores(results, out / "scores.png")
    needle_png = plot_needle(results, out / "needle.png")
    if needle_png is not None:
        paths["needle_png"] = needle_png
    return paths
