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
    "longbench": ("LongBench (%)", "mean_percent", True),
    "fidelity": ("attn rel. error", "mean", False),
}


#: task -> extra columns (title, row field) averaged over the rows that have the field (None = not measured)
EXTRA_COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {
    "fidelity": (("top-k recall", "recall_mean"), ("top-B recall", "topb_recall_mean"),
                 ("layer Jaccard", "jaccard_mean")),
}


def environment() -> dict[str, Any]:
    """Library versions and the device, for the JSON."""
    import flax
    import jax
    import numpy as np

    import kvjax

    devices = jax.devices()
    return {
        "versions": {"kvjax": kvjax.__version__, "jax": jax.__version__,
                     "jaxlib": getattr(jax.lib, "__version__", None) or _dist_version("jaxlib"),
                     "flax": flax.__version__, "numpy": np.__version__, "python": platform.python_version()},
        "device": {"backend": jax.default_backend(), "devices": [str(d) for d in devices],
                   "kind": devices[0].device_kind, "cpu_count": os.cpu_count(), "platform": platform.platform()},
    }


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def new_results(config: dict[str, Any]) -> dict[str, Any]:
    return {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": config, **environment(),
            "timings": {"runs": []}, "rows": []}


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


def _config(row) -> tuple[str, float | int | None]:
    """A row's (method, budget) as shown: the nominal budget for ``--equal-bytes`` rows (whose token budget is
    chosen per task to match the reference method's memory)."""
    return row["method"], row.get("nominal_budget", row["budget"])


def _key(row) -> tuple[str, str, float | int | None]:
    return (row["task"],) + _config(row)


def summarise(results: dict[str, Any]) -> dict[tuple[str, str, float | int | None], float]:
    """(task, method, budget) -> aggregated score (see ``TASKS``)."""
    groups: dict[tuple, list] = collections.defaultdict(list)
    for row in results["rows"]:
        groups[_key(row)].append(row)
    out = {}
    for key, rows in groups.items():
        kind = TASKS.get(key[0], (key[0], "mean", True))[1]
        if kind == "perplexity":
            tokens = sum(r["tokens"] for r in rows)
            out[key] = math.exp(sum(r["nll"] * r["tokens"] for r in rows) / tokens)
        else:
            mean = sum(r["score"] for r in rows) / len(rows)
            out[key] = 100.0 * mean if kind == "mean_percent" else mean
    return out


def _kib(row) -> float | None:
    if row.get("kib_per_seq") is not None:
        return row["kib_per_seq"]
    return None if row.get("cache_bytes") is None else row["cache_bytes"] / 1024


def summarise_memory(results: dict[str, Any]) -> dict[tuple, dict[str, float]]:
    """(task, method, budget) -> ``{"tokens_held": mean, "kib_per_seq": mean}`` over the rows that record them
    (a key is absent when no row does; old results with only ``cache_bytes`` give KiB/seq alone)."""
    acc: dict[tuple, dict[str, list]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for row in results["rows"]:
        if row.get("tokens_held") is not None:
            acc[_key(row)]["tokens_held"].append(row["tokens_held"])
        if _kib(row) is not None:
            acc[_key(row)]["kib_per_seq"].append(_kib(row))
    return {k: {f: sum(xs) / len(xs) for f, xs in v.items()} for k, v in acc.items()}


def _configs(results) -> list[tuple[str, float | int | None]]:
    return list(dict.fromkeys(_config(row) for row in results["rows"]))


def _tasks(results) -> list[str]:
    return list(dict.fromkeys(row["task"] for row in results["rows"]))


MEMORY_COLUMNS = (("tokens held", "tokens_held"), ("KiB/seq", "kib_per_seq"))


def _budget_cell(results, method, budget) -> str:
    if budget is None:
        return "-"
    ref = results.get("config", {}).get("equal_bytes")
    text = f"{budget:g}"
    return f"{text} (bytes of {ref})" if ref and method not in ("full", ref) else text


def markdown_table(results: dict[str, Any]) -> str:
    """One line per (method, budget); per task its score (and extra columns), then the measured mean tokens
    held per sequence and the cache KiB per sequence (where rows record them)."""
    summary = summarise(results)
    memory = summarise_memory(results)
    tasks = _tasks(results)
    extra = collections.defaultdict(list)
    for row in results["rows"]:
        for _, field in EXTRA_COLUMNS.get(row["task"], ()):
            if row.get(field) is not None:
                extra[(row["task"], field) + _config(row)].append(row[field])
    mem_cols = {t: [(title, f) for title, f in MEMORY_COLUMNS
                    if any(f in v for k, v in memory.items() if k[0] == t)] for t in tasks}
    head = ["method", "budget"]
    for t in tasks:
        head += [TASKS.get(t, (t,))[0]] + [title for title, _ in EXTRA_COLUMNS.get(t, ())]
        head += [title if len(tasks) == 1 else f"{title} ({t})" for title, _ in mem_cols[t]]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|"]
    for method, budget in _configs(results):
        cells = [method, _budget_cell(results, method, budget)]
        for t in tasks:
            v = summary.get((t, method, budget))
            agg = TASKS.get(t, ("", "mean"))[1]
            cells.append("" if v is None else f"{v:.1f}" if agg == "mean_percent" else f"{v:.3f}" if agg == "mean"
                         else f"{v:.2f}")
            for _, field in EXTRA_COLUMNS.get(t, ()):
                xs = extra.get((t, field, method, budget))
                cells.append(f"{sum(xs) / len(xs):.3f}" if xs else "")
            for _, field in mem_cols[t]:
                m = memory.get((t, method, budget), {}).get(field)
                cells.append("" if m is None else f"{m:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_scores(results: dict[str, Any], path: str | Path) -> Path:
    """Per task (columns): score vs budget (top; one line per method, ``full`` a dashed horizontal line) and
    score vs measured cache KiB per sequence (bottom; where rows record memory)."""
    from matplotlib.figure import Figure  # no pyplot: the caller's backend (e.g. a notebook's inline) is untouched

    summary = summarise(results)
    memory = summarise_memory(results)
    tasks = _tasks(results)
    fig = Figure(figsize=(5 * len(tasks), 7.6))
    axes = fig.subplots(2, len(tasks), squeeze=False)
    for ax, kax, task in zip(axes[0], axes[1], tasks):
        by_method = collections.defaultdict(list)
        for (t, m, b), v in summary.items():
            if t == task:
                by_method[m].append((b, v))
        title, _, higher = TASKS.get(task, (task, "mean", True))
        for m, pts in by_method.items():
            kib = [(memory.get((task, m, b), {}).get("kib_per_seq"), v) for b, v in pts]
            kib = sorted((k, v) for k, v in kib if k is not None)
            if m == "full" or all(b is None for b, _ in pts):
                for b, v in pts:
                    ax.axhline(v, ls="--", color="k", lw=1, label=f"{m} ({v:.3g})")
                if kib:
                    kax.plot([k for k, _ in kib], [v for _, v in kib], marker="s", ls="", color="k", label=m)
                continue
            pts = sorted(((b, v) for b, v in pts if b is not None), key=lambda p: (isinstance(p[0], int), p[0]))
            line, = ax.plot([b for b, _ in pts], [v for _, v in pts], marker="o", label=m)
            if kib:
                kax.plot([k for k, _ in kib], [v for _, v in kib], marker="o", color=line.get_color(), label=m)
        ax.set_title(f"{task} ({'higher' if higher else 'lower'} is better)")
        ax.set_xlabel("budget (fraction of the prompt, or tokens)")
        ax.set_ylabel(title)
        kax.set_title(f"{task}: score vs memory")
        kax.set_xlabel("KV cache per sequence (KiB, measured)")
        kax.set_ylabel(title)
        for a in (ax, kax):
            a.grid(alpha=0.3)
            if a.get_legend_handles_labels()[0]:
                a.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def plot_needle(results: dict[str, Any], path: str | Path) -> Path | None:
    """The needle heatmap (depth x context length, colour = accuracy), one panel per (method, budget)."""
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
    fig = Figure(figsize=(3.2 * cols + 1, 2.8 * nrows))
    axes = fig.subplots(nrows, cols, squeeze=False)
    for ax in axes.flat[len(configs):]:
        ax.axis("off")
    for ax, (m, b) in zip(axes.flat, configs):
        grid = np.full((len(depths), len(lengths)), np.nan)
        acc = collections.defaultdict(list)
        for r in rows:
            if _config(r) == (m, b):
                acc[(r["depth"], r["length"])].append(r["score"])
        for (d, n), s in acc.items():
            grid[depths.index(d), lengths.index(n)] = 100.0 * sum(s) / len(s)
        im = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_title(m if b is None else f"{m} @ {b:g}", fontsize=9)
        ax.set_xlabel("context (tokens)", fontsize=8)
        ax.set_ylabel("depth", fontsize=8)
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="accuracy (%)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def write_all(results: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """results.json, results.md, scores.png and (with needle rows) needle.png in ``out_dir``."""
    out = Path(out_dir)
    paths = {"json": save(results, out / "results.json")}
    (out / "results.md").write_text(markdown_table(results) + "\n")
    paths["markdown"] = out / "results.md"
    paths["scores_png"] = plot_scores(results, out / "scores.png")
    needle_png = plot_needle(results, out / "needle.png")
    if needle_png is not None:
        paths["needle_png"] = needle_png
    return paths
