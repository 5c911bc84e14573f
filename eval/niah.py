"""``kvjax-eval niah``: needle in a haystack as the papers run it (Kamradt's protocol; Chelsea Fig. 8, PQCache
Fig. 8, ChunkKV Tables 7 and 10, SnapKV Fig. 7, Quest Table 1).

A prompt of ``length`` tokens is the Paul Graham essays cut to fit, one *needle* sentence inserted at ``depth`` of the
haystack (0 = its start, 1 = its end; moved back to the previous sentence end), then the question and the start of
the answer. The **whole prompt, question included, is compressed at prefill** (the papers' protocol; kvpress's,
where the question is not compressed, is ``kvjax-eval leaderboard``'s default). The first answer token comes from
the uncompressed prefill, so the needles' answers are several words long and **scored whole**: an answer scores 1
when it contains every word of the needle's answer (case and punctuation aside), else 0; ``recall`` is the fraction
of those words it contains.

The grid is lengths x depths x needles (``needles`` distinct sentences per cell), every method at the budgets its
paper uses (:data:`PAPER_BUDGETS`). One prefill of the model serves every configuration of a batch
(:mod:`kvjax.engine.prefilled`). The run is resumable and growable (:mod:`eval.rowstore`): a run into the same
``--out`` computes only the (configuration, length, depth, needle) cells it does not hold, so methods, budgets,
lengths, depths and needles can be added later. Outputs: ``niah.json`` (rows and summary), ``niah.md`` (the mean
score per method and budget with n and a 95% interval, per length too), ``niah.png`` (every heatmap) and
``heatmaps/<method>@<budget>.png`` (depth x length, colour = score, as the papers draw them).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kernels_pallas.checks import check_int
from eval import harness, report, rowstore

LENGTHS = (1024, 2048, 4096, 8192)
DEPTHS = tuple(round(0.1 * i, 1) for i in range(11))

INTRO = "Read the following essays carefully. A fact is hidden in them; you will be asked about it afterwards.\n\n"


@dataclasses.dataclass(frozen=True)
class Needle:
    """A needle sentence, the question that asks for it, the answer's start (ends the prompt) and the answer."""

    sentence: str
    question: str
    prefix: str
    answer: str

    def words(self) -> tuple[str, ...]:
        """The answer's words that an answer must contain (lower case, letters and digits only)."""
        return tuple(_words(self.answer))


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


#: Kamradt's needle first; every answer is several words (the first answer token comes from the uncompressed
#: prefill), of words the essays do not hold together.
NEEDLES = (
    Needle(
        "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.",
        "What is the best thing to do in San Francisco?",
        "The best thing to do in San Francisco is to",
        "eat a sandwich and sit in Dolores Park on a sunny day",
    ),
    Needle(
        "The secret ingredient in Grandmother Elsa's apple pie is a spoonful of black pepper and lemon zest.",
        "What is the secret ingredient in Grandmother Elsa's apple pie?",
        "The secret ingredient in Grandmother Elsa's apple pie is",
        "a spoonful of black pepper and lemon zest",
    ),
    Needle(
        "Captain Morrow's treasure is buried beneath the old lighthouse on Gull Island.",
        "Where is Captain Morrow's treasure buried?",
        "Captain Morrow's treasure is buried",
        "beneath the old lighthouse on Gull Island",
    ),
    Needle(
        "The password to the observatory archive is purple elephant dancing at midnight.",
        "What is the password to the observatory archive?",
        "The password to the observatory archive is",
        "purple elephant dancing at midnight",
    ),
    Needle(
        "The first expedition to Mount Kerrigan was led by a botanist named Ingrid Halvorsen.",
        "Who led the first expedition to Mount Kerrigan?",
        "The first expedition to Mount Kerrigan was led by",
        "a botanist named Ingrid Halvorsen",
    ),
    Needle(
        "The town council of Brindlewood voted to paint every bridge in the town bright orange.",
        "What did the town council of Brindlewood vote to do?",
        "The town council of Brindlewood voted to",
        "paint every bridge in the town bright orange",
    ),
)

#: Each method at the budgets its paper runs the needle test at (a float: a fraction of each prompt; an int: tokens):
#: Chelsea 25% (App. D.1), ChunkKV and SnapKV KV sizes 96-512 (ChunkKV Table 10), PQCache 1/5 and 1/10 of the tokens
#: (§5.2), and Quest, ClusterKV and the evicting baselines 128-1024 tokens (Quest Table 1, ClusterKV Fig. 6).
PAPER_BUDGETS: dict[str, tuple] = {
    "full": (None,),
    "chelsea": (0.25,),
    "chunkkv": (96, 128, 256, 512),
    "snapkv": (96, 128, 256, 512),
    "pqcache": (0.2, 0.1),
    "quest": (128, 256, 512, 1024),
    "clusterkv": (128, 256, 512, 1024),
    "streaming_llm": (128, 256, 512, 1024),
    "h2o": (128, 256, 512, 1024),
    "pyramidkv": (128, 256, 512, 1024),
    "less": (128, 256, 512, 1024),
}
#: options the papers' needle tests use: Chelsea's constant merge ratio 0.25 and no outlier heads (App. D.1)
PAPER_OPTIONS: dict[str, dict] = {"chelsea": {"schedule": "niah", "outlier_heads": ()}}


@dataclasses.dataclass(frozen=True)
class Example:
    length: int
    depth: float
    needle: int  # index into NEEDLES
    prompt: tuple[int, ...]  # token ids: intro, haystack with the needle, question, answer prefix

    @property
    def cell(self) -> tuple[int, float, int]:
        return (self.length, self.depth, self.needle)


@functools.lru_cache(maxsize=2)
def _haystack_ids(tok) -> tuple[int, ...]:
    from kvjax.loading import assets

    return tuple(tok.encode(assets.essays_text()))


def _render(tok, text: str, needle: Needle, chat: bool) -> list[int]:
    """Token ids of the prompt around ``text`` (the haystack with its needle): plain text for a base model, else the
    chat template; both end with the answer prefix."""
    if chat:
        return tok.encode_chat([{"role": "user", "content": INTRO + text + "\n\n" + needle.question}]) + tok.encode(
            needle.prefix
        )
    return tok.encode(INTRO + text + "\n\n" + needle.question + "\n" + needle.prefix, add_special_tokens=True)


def build_example(model, length: int, depth: float, needle: int, chat: bool = False) -> Example:
    """The prompt of at most ``length`` tokens with needle ``NEEDLES[needle]`` at ``depth`` of the haystack."""
    from eval.needle import sentence_start

    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depths: {depth} is not a fraction of the haystack in [0, 1]")
    tok = model.tokenizer
    if tok is None:
        raise ValueError("kvjax-eval niah needs a model loaded with its tokenizer")
    n = NEEDLES[needle]
    frame = len(_render(tok, "\n\n" + n.sentence + "\n\n", n, chat))
    hay = _haystack_ids(tok)
    room = length - frame - 4
    if room < 64:
        raise ValueError(f"lengths: {length} leaves no room for a haystack (the rest takes {frame} tokens); use >= 256")
    if room > len(hay):
        raise ValueError(f"lengths: {length} needs {room} haystack tokens but the essays have {len(hay)}")
    period = {i for i in set(hay[: room + 64]) if tok.decode([i]).rstrip().endswith((".", "!", "?"))}
    while True:  # decoding and encoding again may merge tokens differently at the seams: shrink until it fits
        cut = list(hay[:room])
        at = len(cut) if depth >= 1.0 else sentence_start(cut, int(round(depth * len(cut))), period)
        text = (tok.decode(cut[:at]).rstrip() + "\n\n" + n.sentence + "\n\n" + tok.decode(cut[at:]).lstrip()).strip()
        prompt = _render(tok, text, n, chat)
        if len(prompt) <= length:
            return Example(int(length), float(depth), int(needle), tuple(prompt))
        room -= len(prompt) - length


def score(answer: str, needle: Needle) -> tuple[float, float]:
    """``(score, recall)``: 1.0 if ``answer`` holds every word of the needle's answer (else 0.0), and the fraction
    of those words it holds."""
    have = set(_words(answer))
    want = needle.words()
    found = sum(w in have for w in want)
    return float(found == len(want)), found / len(want)


def config_key(method: str, budget) -> str:
    return method if budget is None else f"{method}@{budget:g}"


@dataclasses.dataclass(frozen=True)
class Grid:
    """One NIAH run's settings. ``configs``: ``((method, budget), ...)``; ``options``: ``((method, ((key, value),
    ...)), ...)``. The grid settings (lengths, depths, needles, configs, options) may grow between runs into one
    folder; the others decide every row and must match."""

    model: str
    configs: tuple[tuple[str, Any], ...]
    lengths: tuple[int, ...] = LENGTHS
    depths: tuple[float, ...] = DEPTHS
    needles: int = 2
    batch: int = 4
    max_new_tokens: int = 24
    chat: bool = False
    options: tuple = ()

    def __post_init__(self):
        check_int("needles", self.needles, numpy_ok=True)
        check_int("batch", self.batch, numpy_ok=True)
        check_int("max_new_tokens", self.max_new_tokens, numpy_ok=True)
        if not 1 <= self.needles <= len(NEEDLES):
            raise ValueError(
                f"needles={self.needles}: there are {len(NEEDLES)} needle sentences; use 1..{len(NEEDLES)}"
            )
        for d in self.depths:
            if not 0.0 <= d <= 1.0:
                raise ValueError(f"depths: {d} is not a fraction of the haystack in [0, 1]")
        for n in self.lengths:
            check_int("lengths", n, numpy_ok=True)

    def method_options(self) -> dict[str, dict]:
        return {m: dict(kv) for m, kv in self.options}

    def keys(self) -> list[str]:
        return [config_key(m, b) for m, b in self.configs]

    def settings(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "chat": self.chat,
            "max_new_tokens": self.max_new_tokens,
            "batch": self.batch,
            "configs": self.keys(),
            "lengths": list(self.lengths),
            "depths": list(self.depths),
            "needles": list(range(self.needles)),
            "options": {m: {k: list(v) if isinstance(v, tuple) else v for k, v in kv} for m, kv in self.options},
        }


#: the settings a later run into the same folder may extend
GROWS = ("configs", "lengths", "depths", "needles", "options")


def paper_configs(names: Sequence[str], budgets: dict[str, Sequence] | None = None) -> tuple[tuple[str, Any], ...]:
    """``(method, budget)`` for each method name at its paper's budgets (:data:`PAPER_BUDGETS`), or at
    ``budgets[name]`` where given; a ValueError for a method without a paper budget and none given."""
    out = []
    for n in names:
        bs = (budgets or {}).get(n) or PAPER_BUDGETS.get(n)
        if bs is None:
            raise ValueError(f"--budget {n}=...: {n} has no paper needle budget; pass e.g. --budget {n}=128,256")
        out += [(n, None if n == "full" else b) for b in bs]
    return tuple(dict.fromkeys(out))


def build(model, grid: Grid) -> list[Example]:
    """Every (length, depth, needle) prompt of ``grid``, length-major."""
    return [
        build_example(model, n, d, k, grid.chat) for n in grid.lengths for d in grid.depths for k in range(grid.needles)
    ]


def _row_key(r: dict) -> tuple:
    return (r["config"], r["length"], r["depth"], r["needle"])


def run(
    model, grid: Grid, out: str | Path, progress: bool = True, restart: bool = False, kernels=None
) -> dict[str, Any]:
    """Run (or resume, or extend) ``grid`` on ``model`` into ``out``; returns the results (also written there).
    ``kernels``: LESS's kernels where ``grid.options`` names none."""
    from tqdm.auto import tqdm

    from kvjax.engine import bucket_length, pad_prompts
    from kvjax.engine import prefilled as P

    out = Path(out)
    options = grid.method_options()
    if kernels is not None and "kernels" not in options.get("less", {}):
        options["less"] = {**options.get("less", {}), "kernels": str(kernels)}
    for name, budget in grid.configs:  # bad methods and options fail before any work
        harness.make_method(name, budget, options.get(name))
    store = rowstore.RowStore(
        out, grid.settings(), GROWS, restart, what="needle-in-a-haystack run", owners={"options": "configs"}
    )
    done = {_row_key(r): r for rec in store.records for r in rec["rows"]}
    examples = build(model, grid)
    for n in grid.lengths:
        harness.check_context(model, n, grid.max_new_tokens)
    keys = grid.keys()
    todo = {(k, e.cell) for k in keys for e in examples if (k, *e.cell) not in done}
    batches = []
    for n in grid.lengths:
        pending = [e for e in examples if e.length == n and any((k, e.cell) in todo for k in keys)]
        batches += [pending[i : i + grid.batch] for i in range(0, len(pending), grid.batch)]
    cells = [(b, k) for b in batches for k in keys if any((k, e.cell) in todo for e in b)]
    results = report.new_results({**store.settings, "less_kernels": kernels and Path(kernels).name})
    commit, seconds, start = results["commit"], {}, time.perf_counter()
    with tqdm(total=len(cells), desc="niah", unit="cell", disable=not progress) as bar:
        shown = harness.throttled(bar.set_postfix_str)
        for i, batch in enumerate(batches):
            bucket = bucket_length(batch[0].length)
            padded, real = harness.pad_batch(list(batch), grid.batch)
            where = f"{batch[0].length} tokens, batch {i + 1}/{len(batches)}"
            bar.set_postfix_str(f"{where}: model prefill")
            tp = time.perf_counter()
            pre = P.prefill_once(model, *pad_prompts([list(e.prompt) for e in padded], bucket))
            seconds["prefill"] = seconds.get("prefill", 0.0) + time.perf_counter() - tp
            for (name, budget), key in zip(grid.configs, keys):
                if not any((key, e.cell) in todo for e in batch):
                    continue
                t0 = time.perf_counter()
                answers = harness.answer_after_context(
                    model,
                    harness.make_method(name, budget, options.get(name)),
                    [list(e.prompt) for e in padded],
                    [[] for _ in padded],
                    bucket,
                    grid.max_new_tokens,
                    prefilled=pre,
                    on_phase=lambda phase: shown(f"{where}: {key} {phase}"),
                )[:real]
                took = time.perf_counter() - t0
                rows = []
                for e, a in zip(batch, answers):
                    s, rec = score(a, NEEDLES[e.needle])
                    rows.append(
                        {
                            "config": key,
                            "method": name,
                            "budget": budget,
                            "length": e.length,
                            "depth": e.depth,
                            "needle": e.needle,
                            "prompt_tokens": len(e.prompt),
                            "answer": a,
                            "score": s,
                            "recall": rec,
                        }
                    )
                store.append({"config": key, "seconds": took, "commit": commit, "rows": rows})
                done.update({_row_key(r): r for r in rows})
                seconds[key] = seconds.get(key, 0.0) + took
                bar.update(1)
            del pre
    results["rows"] = sorted(done.values(), key=lambda r: (r["config"], r["length"], r["depth"], r["needle"]))
    results["summary"] = summarise(results["rows"], store.settings["configs"])
    results["timings"].update(
        wall_seconds_this_run=time.perf_counter() - start,
        seconds_this_run=seconds,
        seconds_all_runs=sum(rec.get("seconds", 0.0) for rec in store.records),
        **rowstore.peak_memory(),
    )
    write(results, out)
    return results


def summarise(rows: Sequence[dict], order: Sequence[str] = ()) -> list[dict]:
    """Per configuration (in ``order``, then the others): the mean score in percent with its 95% (Wilson) interval
    and n, the same per length, and the mean of ``recall``."""
    by: dict[str, list[dict]] = {k: [] for k in order}
    for r in rows:
        by.setdefault(r["config"], []).append(r)
    out = []
    for key, rs in by.items():
        if not rs:
            continue
        lengths = sorted({r["length"] for r in rs})
        out.append(
            {
                "config": key,
                "method": rs[0]["method"],
                "budget": rs[0]["budget"],
                "score": report.interval("needle", rs),
                "recall": 100 * sum(r["recall"] for r in rs) / len(rs),
                "by_length": {n: report.interval("needle", [r for r in rs if r["length"] == n]) for n in lengths},
            }
        )
    return out


def _cell(c: dict) -> str:
    return f"{report.interval_text(c, 0)} (n = {c['n']})"


def markdown(results: dict[str, Any]) -> str:
    s, summary = results["config"], results["summary"]
    lengths = sorted({n for e in summary for n in e["by_length"]}, key=int)
    t, v = results["timings"], results.get("versions", {})
    lines = [
        f"# kvjax needle in a haystack on `{s['model']}` ({results.get('created', '')})",
        "",
        f"- Kamradt's protocol: the Paul Graham essays, one sentence needle at each depth "
        f"({', '.join(f'{d:g}' for d in s['depths'])}), {len(s['needles'])} needles a cell; the question and the "
        f"answer's start end the prompt, and the whole prompt is compressed at prefill; an answer scores 1 when it "
        f"holds every word of the needle's answer (up to {s['max_new_tokens']} tokens generated); "
        f"{'chat template' if s['chat'] else 'plain-text prompts'}",
        f"- budgets: a fraction of each prompt (e.g. 0.25) or a token count (e.g. 128), as each paper runs the test; "
        f"options {s['options'] or 'none'}; score in percent with a 95% (Wilson) interval and n",
        f"- kvjax {v.get('kvjax', '?')}, jax {v.get('jax', '?')}, commit "
        f"`{', '.join(s.get('commits') or [str(results.get('commit'))])}`; compute "
        f"{t.get('seconds_all_runs', 0):.0f} s (all runs into this folder)"
        + (f", peak memory {t['peak_rss_gib']:.1f} GiB in the last run" if t.get("peak_rss_gib") else "")
        + f"; command `{results.get('command', '')}`",
        "",
        "| method | budget | score (%) | recall (%) | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
        "|---|---|---|---|" + "---|" * len(lengths),
    ]
    for e in summary:
        lines.append(
            f"| {e['method']} | {'—' if e['budget'] is None else format(e['budget'], 'g')} | {_cell(e['score'])} | "
            f"{e['recall']:.0f} | "
            + " | ".join(f"{e['by_length'][n]['value']:.0f}" if n in e["by_length"] else "" for n in lengths)
            + " |"
        )
    return "\n".join(lines) + "\n"


def heatmap(rows: Sequence[dict], ax, title: str) -> None:
    """Depth (rows, 0% at the top) x length (columns), colour = mean score of the cell's needles, as the papers."""
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    grid = np.full((len(depths), len(lengths)), np.nan)
    for i, d in enumerate(depths):
        for j, n in enumerate(lengths):
            xs = [r["score"] for r in rows if r["depth"] == d and r["length"] == n]
            if xs:
                grid[i, j] = 100 * sum(xs) / len(xs)
    ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(lengths)), [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths], fontsize=7)
    ax.set_yticks(range(len(depths)), [f"{100 * d:.0f}" for d in depths], fontsize=7)
    ax.set_xlabel("context length (tokens)", fontsize=7)
    ax.set_ylabel("needle depth (%)", fontsize=7)
    ax.set_title(title, fontsize=8)


def write(results: dict[str, Any], out: str | Path) -> dict[str, Path]:
    """``niah.json``, ``niah.md``, ``niah.png`` (every heatmap) and ``heatmaps/<config>.png`` in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    paths = {"json": out / "niah.json", "md": out / "niah.md", "png": out / "niah.png"}
    report.save(results, paths["json"])
    paths["md"].write_text(markdown(results), encoding="utf-8")
    summary = results["summary"]
    by = {}
    for r in results["rows"]:
        by.setdefault(r["config"], []).append(r)
    (out / "heatmaps").mkdir(exist_ok=True)
    for e in summary:
        title = f"{e['config']}: {e['score']['value']:.0f}%"
        fig, ax = plt.subplots(figsize=(4, 3.2))
        heatmap(by[e["config"]], ax, title)
        fig.tight_layout()
        fig.savefig(out / "heatmaps" / f"{e['config']}.png", dpi=110)
        plt.close(fig)
    cols = min(6, max(1, len(summary)))
    nrows = -(-len(summary) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(2.6 * cols, 2.4 * nrows), squeeze=False)
    for ax, e in zip(axes.flat, summary):
        heatmap(by[e["config"]], ax, f"{e['config']}: {e['score']['value']:.0f}%")
    for ax in list(axes.flat)[len(summary) :]:
        ax.axis("off")
    fig.suptitle(f"needle in a haystack, {results['config']['model']}: score by depth and length", fontsize=10)
    fig.tight_layout()
    fig.savefig(paths["png"], dpi=100)
    plt.close(fig)
    return paths


def report_only(out: str | Path) -> dict[str, Any]:
    """The outputs of what ``out/rows.jsonl`` holds, running nothing."""
    out = Path(out)
    settings = rowstore.read_settings(out, "needle-in-a-haystack run", "kvjax-eval niah")
    records = rowstore.read_jsonl(out / rowstore.ROWS)[1:]
    done = {_row_key(r): r for rec in records for r in rec["rows"]}
    results = report.new_results({**settings, "commits": sorted({str(r.get("commit")) for r in records})})
    results["command"] = f"kvjax-eval niah --out {out}"  # resumes the run (its settings are the folder's)
    results["rows"] = sorted(done.values(), key=lambda r: (r["config"], r["length"], r["depth"], r["needle"]))
    results["summary"] = summarise(results["rows"], settings["configs"])
    results["timings"]["seconds_all_runs"] = sum(rec.get("seconds", 0.0) for rec in records)
    write(results, out)
    return results
