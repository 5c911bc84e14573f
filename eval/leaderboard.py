"""``kvjax-eval leaderboard``: kvpress's RULER leaderboard protocol, with every kvjax method beside its baselines.

NVIDIA kvpress's public leaderboard scores presses on RULER at 4k tokens at compression ratios 0.25, 0.5, 0.75 and
0.875 (the fraction of the context's KV pairs removed). This runs the same protocol on a base model (plain-text
prompts, no chat template; by default the embedded Gemma 3 270M):

- tasks (:mod:`eval.ruler`): ``single_needle``, ``multikey``, ``multivalue``, ``variable_tracking``
  and ``common_words``; ``contexts`` contexts per task, every context about ``length`` tokens (the bucket);
- the context is compressed at prefill and the question is not (it is fed after compression,
  :func:`eval.harness.answer_after_context`), as kvpress's pipeline does (protocol ``question-after-context``, the
  default); or, with ``--protocol question-in-context``, the question is compressed together with the context, as
  SnapKV, PyramidKV, ChunkKV and Chelsea evaluate (the same tokens, one prompt);
- ``full`` once, and every other method at each ratio ``r`` with budget ``1 - r`` of each context (a fraction: the
  recall methods then read the same token count per step that the eviction methods keep);
- the score of an answer is RULER's ``string_match_all`` (the fraction of expected strings it contains), as kvpress
  scores it; a cell is the mean over its contexts in percent with a 95% interval, and the average over tasks is the
  mean of the task means (kvpress's "average"), its interval from the tasks' variances (stratified).

One prefill per batch of contexts and protocol serves every method (:mod:`kvjax.engine.prefilled`), batch-major, so
each batch's prefill lives only while its configurations run. Every finished (batch, configuration) appends its rows
to ``rows.jsonl`` in the output folder (:mod:`eval.rowstore`); a run started again skips what that file holds (a
killed run resumes where it stopped), and may add methods, ratios and protocols to it (only the new cells run). The
tables and the figure show every protocol the folder holds (the question in the context: dotted lines). Outputs:
``leaderboard.json``, ``leaderboard.md`` and ``leaderboard.png``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from pathlib import Path
from typing import Any, Sequence

from kernels_pallas.checks import check_int
from eval import harness, report, rowstore, ruler

TASKS = ("single_needle", "multikey", "multivalue", "variable_tracking", "common_words")
#: kvpress's leaderboard ratios: the fraction of the context removed (a method keeps ``1 - ratio`` of it)
RATIOS = (0.25, 0.5, 0.75, 0.875)
ROWS = rowstore.ROWS
read_jsonl = rowstore.read_jsonl
#: kvpress's protocol (the question fed after the compressed context) and the papers' (compressed with it)
AFTER, IN_CONTEXT = "question-after-context", "question-in-context"
PROTOCOLS = (AFTER, IN_CONTEXT)
#: the settings a later run into the same folder may extend
GROWS = ("methods", "ratios", "protocols", "options")
#: answers of a peer (kvpress, ``benchmarks/kvpress_ruler.py``) on the same contexts, merged into the tables
PEER_ROWS = "kvpress.jsonl"


@dataclasses.dataclass(frozen=True)
class Board:
    """One leaderboard run's settings (everything that decides its rows: a resumed run must match them)."""

    model: str
    methods: tuple[str, ...]
    ratios: tuple[float, ...] = RATIOS
    tasks: tuple[str, ...] = TASKS
    length: int = 4096
    contexts: int = 10  # per task
    batch: int = 10
    max_new_tokens: int = 40  # four 7-digit numbers (multivalue) take about 36 tokens of a digit-wise tokenizer
    seed: int = 0
    options: tuple = ()  # ((method, ((key, value), ...)), ...): method options, hashable
    protocols: tuple[str, ...] = (AFTER,)

    def __post_init__(self):
        for p in self.protocols:
            if p not in PROTOCOLS:
                raise ValueError(f"protocol: {p!r} is not one of {', '.join(PROTOCOLS)}")
        for r in self.ratios:
            if not 0 < r < 1:
                raise ValueError(f"ratios: {r} is not a compression ratio in (0, 1) (kvpress's 0.25,0.5,0.75,0.875)")
        for name, value in (
            ("contexts", self.contexts),
            ("batch", self.batch),
            ("max_new_tokens", self.max_new_tokens),
        ):
            check_int(name, value, numpy_ok=True)
        for t in self.tasks:
            if t not in ruler.BUILDERS:
                raise ValueError(f"tasks: {t!r} is not a RULER task; choose from {', '.join(ruler.BUILDERS)}")

    def configs(self) -> list[tuple[str, float | None, float, str]]:
        """``(method, budget, ratio, protocol)`` in run order, per protocol: ``full`` once (ratio 0), then each method
        at each ratio."""
        out = []
        for p in self.protocols:
            out += [("full", None, 0.0, p)] if "full" in self.methods else []
            out += [(m, round(1 - r, 6), r, p) for m in self.methods if m != "full" for r in self.ratios]
        return out

    def task(self, protocol: str = AFTER) -> ruler.RulerTask:
        return ruler.RulerTask(
            lengths=(self.length,),
            tasks=self.tasks,
            samples=self.contexts,
            batch=min(self.batch, len(self.tasks) * self.contexts),  # no batch padded past the contexts there are
            max_new_tokens=self.max_new_tokens,
            seed=self.seed,
            chat=False,
            in_context=protocol == IN_CONTEXT,
        )

    def method_options(self) -> dict[str, dict]:
        return {m: dict(kv) for m, kv in self.options}

    def settings(self) -> dict[str, Any]:
        """JSON-able settings; what ``rows.jsonl`` opens with."""
        return {**dataclasses.asdict(self), "options": self.method_options()}


def config_key(method: str, ratio: float, protocol: str = AFTER) -> str:
    """A configuration's key in ``rows.jsonl``: ``method@ratio``, with ``/in-context`` for the papers' protocol."""
    return f"{method}@{ratio:g}" + ("/in-context" if protocol == IN_CONTEXT else "")


def fit_contexts(model, board: Board, protocol: str = AFTER):
    """The task and its prepared batches, every context within ``board.length`` tokens (the bucket); the tasks
    alternate along the batches (context ``i`` of every task before context ``i + 1`` of any), so a run stopped
    early has the same number of contexts of every task in every cell."""
    from kvjax.engine import bucket_length

    task = board.task(protocol)
    (bucket, cap_new), batches = task.prepare(model)
    by_task = [[e for b in batches for e in b if e.task == t] for t in board.tasks]
    examples = [e for i in range(board.contexts) for group in by_task for e in group[i : i + 1]]  # round-robin
    prepared = (bucket, cap_new), [examples[i : i + board.batch] for i in range(0, len(examples), board.batch)]
    longest = max(len(e.context) + len(e.question) for e in examples)
    if prepared[0][0] != bucket_length(board.length) or longest > board.length:
        raise ValueError(
            f"length={board.length}: a context came out at {longest} tokens, over the bucket; use a power of two "
            "(4096, 8192) so contexts fill their bucket"
        )
    return task, prepared


def _open_rows(out: Path, board: Board, restart: bool) -> tuple[dict, dict[tuple[int, str], list[dict]]]:
    """The folder's settings (grown by ``board``'s) and the rows ``rows.jsonl`` already holds, by (batch index,
    config key); a new file when there is none."""
    store = rowstore.RowStore(
        out,
        board.settings(),
        GROWS,
        restart,
        defaults={"protocols": [AFTER]},
        what="leaderboard run",
        owners={"options": "methods"},
    )
    return store, {(rec["batch_index"], rec["config"]): rec["rows"] for rec in store.records}


def read_settings(out: str | Path) -> dict[str, Any]:
    """The settings of the leaderboard run in folder ``out`` (the first line of its ``rows.jsonl``)."""
    s = rowstore.read_settings(out, "leaderboard run", "kvjax-eval leaderboard")
    s = {"protocols": [AFTER], **s}
    return {**s, **{k: tuple(s[k]) for k in ("methods", "ratios", "tasks", "protocols")}}


def peer_rows(out: str | Path) -> tuple[list[dict], dict[str, str]]:
    """The peer's answers in ``out`` (:data:`PEER_ROWS`) as scored rows (method ``kvpress <Press>``; no press:
    ``transformers full`` at ratio 0), and ``{press: error}`` for presses that failed on the model."""
    from eval import metrics

    rows, errors = [], {}
    for r in read_jsonl(Path(out) / PEER_ROWS):
        name = "transformers full" if r["press"] == "none" else f"kvpress {r['press']}"
        if "error" in r:
            errors[name] = r["error"]
            continue
        rows.append(
            {
                "method": name,
                "ratio": r["ratio"],
                "subtask": r["subtask"],
                "context": r["context_index"],
                "expected": r["expected"],
                "answer": r["answer"],
                "score": metrics.string_match_all(r["answer"], r["expected"]),
                "seconds": r["seconds"],
                "protocol": r.get("protocol", AFTER),
            }
        )
    return rows, errors


#: kvjax's method -> the peer's row of the same method (``benchmarks/kvpress_ruler.py``)
PEER_OF = {
    "full": "transformers full",
    "snapkv": "kvpress SnapKVPress",
    "streaming_llm": "kvpress StreamingLLMPress",
    "chunkkv": "kvpress ChunkKVPress",
}


def agreement(rows: Sequence[dict], peer: Sequence[dict]) -> dict[tuple[str, float, str], dict[str, float]]:
    """Per (kvjax method, ratio, protocol) that the peer ran too (:data:`PEER_OF`; ``full`` at ratio 0): over the
    contexts both hold (a context: its task and expected answers), how many answers are identical (up to white space
    at the ends) and how many score the same, and both mean scores in percent."""
    theirs = {(r["method"], r["ratio"], r.get("protocol", AFTER), r["subtask"], tuple(r["expected"])): r for r in peer}
    cells: dict[tuple[str, float, str], list[tuple[dict, dict]]] = {}
    for r in rows:
        protocol = r.get("protocol", AFTER)
        other = theirs.get((PEER_OF.get(r["method"]), r["ratio"], protocol, r["subtask"], tuple(r["expected"])))
        if other is not None:
            cells.setdefault((r["method"], r["ratio"], protocol), []).append((r, other))
    return {
        key: {
            "n": len(pairs),
            "identical": sum(a["answer"].strip() == b["answer"].strip() for a, b in pairs),
            "same_score": sum(float(a["score"]) == float(b["score"]) for a, b in pairs),
            "kvjax": 100 * sum(float(a["score"]) for a, _ in pairs) / len(pairs),
            "peer": 100 * sum(float(b["score"]) for _, b in pairs) / len(pairs),
        }
        for key, pairs in cells.items()
    }


def report_only(out: str | Path) -> dict[str, Any]:
    """The outputs of what ``out``'s ``rows.jsonl`` holds, running nothing (a run stopped early: every cell then has
    the contexts of its finished batches, ``results["partial"]`` says how many)."""
    out = Path(out)
    board = board_of(read_settings(out))
    records = read_jsonl(out / ROWS)[1:]
    done = {(r["batch_index"], r["config"]): r["rows"] for r in records}
    batches = sorted({i for i, _ in done})
    held = {k for _, k in done}  # the configurations some run asked for (the folder's grid is their union)
    keys = [k for k in (config_key(n, r, p) for n, _, r, p in board.configs()) if k in held]
    results = report.new_results({**board.settings(), "commits": sorted({str(r.get("commit")) for r in records})})
    results["command"] = command(board, out)  # the run's own command (this one only wrote the tables)
    results["rows"] = [row for i in batches for k in keys for row in done.get((i, k), [])]
    whole = [i for i in batches if all((i, k) in done for k in keys)]
    total = -(-len(board.tasks) * board.contexts // board.batch)
    results["partial"] = {"batches_done": len(whole), "batches": total, "cells_done": len(done)}
    results["timings"]["seconds_all_runs"] = sum(r.get("seconds", 0.0) for r in records)
    _merge_peer(results, out)
    write(results, out)
    return results


def board_of(settings: dict) -> Board:
    """The :class:`Board` of a folder's settings (``rows.jsonl``'s first line)."""
    s = {k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()}
    return Board(**{**s, "options": tuple((m, tuple(sorted(kv.items()))) for m, kv in settings["options"].items())})


def command(board: Board, out: str | Path) -> str:
    """The ``kvjax-eval leaderboard`` command line that runs (or resumes) ``board`` into ``out``."""
    default = Board(model=board.model, methods=board.methods)
    flags = {"ratios": "ratios", "tasks": "tasks", "length": "length", "contexts": "contexts", "batch": "batch"}
    flags.update(max_new_tokens="max-new-tokens", seed="seed", protocols="protocol")
    line = ["kvjax-eval leaderboard"]
    if board.model != "gemma3-270m":
        line.append(f"--model {board.model}")
    for field, flag in flags.items():
        value = getattr(board, field)
        if value != getattr(default, field):
            line.append(f"--{flag} {','.join(map(str, value)) if isinstance(value, tuple) else value}")
    for m, kv in board.options:
        line += [f"--option {m}.{k}={v}" for k, v in kv]
    return " ".join(line + [f"--out {out}"])


def rewrite(out: str | Path) -> dict[str, Any]:
    """Merge the peer's answers in ``out`` into its ``leaderboard.json`` and redraw the table and figure."""
    out = Path(out)
    results = report.load(out / "leaderboard.json")
    _merge_peer(results, out)
    write(results, out)
    return results


def _merge_peer(results: dict[str, Any], out: Path) -> None:
    rows, errors = peer_rows(out)
    results["peer"] = {"rows": rows, "errors": errors, "file": PEER_ROWS} if rows or errors else None
    results["summary"] = summarise(results["rows"] + rows, results["config"]["tasks"])


def run(
    model,
    board: Board,
    out: str | Path,
    progress: bool = True,
    restart: bool = False,
    kernels: str | Path | None = None,
) -> dict[str, Any]:
    """Run (or resume) ``board`` on ``model``; returns the results (also written to ``out``). ``kernels``: LESS's
    kernels where ``board.options`` names none (the ones shipped for the embedded model; recorded in the results,
    not among the settings a resumed run must match, since the folder's path differs between machines)."""
    from tqdm.auto import tqdm

    from kvjax.engine import prefilled as P

    out = Path(out)
    options = board.method_options()
    if kernels is not None and "less" in board.methods and "kernels" not in options.get("less", {}):
        options["less"] = {**options.get("less", {}), "kernels": str(kernels)}
    configs = board.configs()
    for name, budget, _, _ in configs:
        harness.make_method(name, budget, options.get(name))  # bad methods and options fail before any work
    fitted = {p: fit_contexts(model, board, p) for p in board.protocols}
    store, done = _open_rows(out, board, restart)
    folder = board_of(store.settings)  # this run's configurations and those the folder held before
    results = report.new_results(
        {**folder.settings(), "dtype": str(model.dtype), "less_kernels": kernels and Path(kernels).name}
    )
    seconds: dict[str, float] = {}
    commit = results["commit"]
    batches = fitted[board.protocols[0]][1][1]
    keyed = [(c, config_key(c[0], c[2], c[3])) for c in configs]
    todo = [(i, c, k) for i in range(len(batches)) for c, k in keyed if (i, k) not in done]
    start = time.perf_counter()
    with tqdm(total=len(todo), desc="leaderboard", unit="cell", disable=not progress) as bar:
        shown = harness.throttled(bar.set_postfix_str)
        for i in range(len(batches)):
            for protocol in board.protocols:
                cells = [(c, k) for j, c, k in todo if j == i and c[3] == protocol]
                if not cells:
                    continue
                task, prepared = fitted[protocol]
                batch = prepared[1][i]
                where = f"batch {i + 1}/{len(batches)}" + (" in context" if protocol == IN_CONTEXT else "")
                bar.set_postfix_str(f"{where}: model prefill")
                tp = time.perf_counter()
                pre = P.prefill_once(model, *task.prefill_batch(prepared, batch))
                seconds["prefill"] = seconds.get("prefill", 0.0) + time.perf_counter() - tp
                for (name, budget, ratio, _), key in cells:
                    t0 = time.perf_counter()
                    method = harness.make_method(name, budget, options.get(name))
                    meta = {"task": "leaderboard", "method": name, "budget": budget, "ratio": ratio}
                    meta["protocol"] = protocol
                    rows = task.run_batch(
                        model,
                        method,
                        prepared,
                        batch,
                        meta,
                        prefilled=pre,
                        on_phase=lambda phase: shown(f"{where}: {key} {phase}"),
                    )
                    took = time.perf_counter() - t0
                    for r in rows:
                        r["batch_seconds"] = took
                    done[(i, key)] = rows
                    store.append({"batch_index": i, "config": key, "seconds": took, "commit": commit, "rows": rows})
                    seconds[key] = seconds.get(key, 0.0) + took
                    bar.update(1)
                del pre
    keys = [config_key(n, r, p) for n, _, r, p in folder.configs()]
    results["rows"] = [row for i in range(len(batches)) for k in keys for row in done.get((i, k), [])]
    results["timings"].update(
        wall_seconds_this_run=time.perf_counter() - start,
        load_seconds=model.load_seconds,
        seconds_this_run=seconds,
        seconds_all_runs=sum(rec.get("seconds", 0.0) for rec in store.records),
        **rowstore.peak_memory(),
    )
    _merge_peer(results, out)
    write(results, out)
    return results


def average_interval(per_task: Sequence[Sequence[float]]) -> dict[str, float]:
    """The average of the task means (percent) with a 95% interval: the tasks are strata, so the variance of the
    average is ``sum(s_t^2 / n_t) / T^2`` (Student's t with ``N - T`` degrees of freedom)."""
    t = len(per_task)
    means = [sum(s) / len(s) for s in per_task]
    avg = sum(means) / t
    n = sum(len(s) for s in per_task)
    if any(len(s) < 2 for s in per_task):
        return {"value": 100 * avg, "lo": math.nan, "hi": math.nan, "n": n}
    var = sum(sum((x - m) ** 2 for x in s) / (len(s) - 1) / len(s) for s, m in zip(per_task, means)) / t**2
    half = report.t_quantile(n - t) * math.sqrt(var)
    return {"value": 100 * avg, "lo": 100 * max(0.0, avg - half), "hi": 100 * min(1.0, avg + half), "n": n}


def label(method: str, protocol: str = AFTER) -> str:
    """A row's name in the tables and the figure: the method, marked when the question was compressed too."""
    return method + (" (question in context)" if protocol == IN_CONTEXT else "")


def summarise(rows: Sequence[dict], tasks: Sequence[str]) -> list[dict]:
    """One entry per (method, ratio, protocol): each task's cell and the average over tasks (see the module
    docstring); ``method`` is the row's :func:`label`."""
    cells: dict[tuple[str, float, str], dict[str, list[float]]] = {}
    for r in rows:
        key = (r["method"], r["ratio"], r.get("protocol", AFTER))
        cells.setdefault(key, {}).setdefault(r["subtask"], []).append(float(r["score"]))
    out = []
    for (method, ratio, protocol), by_task in cells.items():
        present = [t for t in tasks if t in by_task]
        out.append(
            {
                "method": label(method, protocol),
                "base": method,
                "protocol": protocol,
                "ratio": ratio,
                "tasks": {t: report.interval("ruler", [{"score": x} for x in by_task[t]]) for t in present},
                "average": average_interval([by_task[t] for t in present]),
            }
        )
    return out


def protocol_differences(rows: Sequence[dict]) -> dict[tuple[str, float], dict[str, float]]:
    """Per (method, ratio) run under both protocols: the paired difference of the score (question in the context
    minus after it, percentage points) over the contexts both hold (a context: its task and expected answers), its
    mean with a 95% t interval and n."""
    scores: dict[tuple, dict[str, float]] = {}
    for r in rows:
        context = (r["subtask"], tuple(r["expected"]))
        scores.setdefault((r["method"], r["ratio"], context), {})[r.get("protocol", AFTER)] = float(r["score"])
    diffs: dict[tuple[str, float], list[float]] = {}
    for (method, ratio, _), by in scores.items():
        if AFTER in by and IN_CONTEXT in by:
            diffs.setdefault((method, ratio), []).append(100 * (by[IN_CONTEXT] - by[AFTER]))
    out = {}
    for key, xs in diffs.items():
        lo, hi = report.t_interval(xs)
        out[key] = {"value": sum(xs) / len(xs), "lo": lo, "hi": hi, "n": len(xs)}
    return out


NEEDLES = ("single_needle", "multikey", "multivalue")
FAILURES = ("found", "cut short", "another number", "no number")


def needle_failures(rows: Sequence[dict]) -> dict[tuple[str, float], dict[str, int]]:
    """How the needle tasks' expected numbers fare in the answers, per (method, ratio): ``found``; ``cut short`` (the
    answer holds a number that is a proper prefix of it: the method kept some of its digits, one token each in a
    digit-wise tokenizer such as Gemma's); ``another number``; ``no number``."""
    out: dict[tuple[str, float], dict[str, int]] = {}
    for r in rows:
        if r["subtask"] not in NEEDLES:
            continue
        cell = out.setdefault((label(r["method"], r.get("protocol", AFTER)), r["ratio"]), dict.fromkeys(FAILURES, 0))
        numbers = re.findall(r"\d+", r["answer"])
        for e in r["expected"]:
            if e in r["answer"]:
                cell["found"] += 1
            elif any(e.startswith(n) and len(n) < len(e) for n in numbers):
                cell["cut short"] += 1
            else:
                cell["another number" if numbers else "no number"] += 1
    return out


_cell = report.interval_text


def markdown(results: dict[str, Any]) -> str:
    """The leaderboard as Markdown: methods x ratios (the average over tasks with its interval), then per task."""
    s = results["config"]
    summary = results["summary"]
    by = {(e["method"], e["ratio"]): e for e in summary}
    bases = list(dict.fromkeys(e.get("base", e["method"]) for e in summary))
    order = {e["method"]: (bases.index(e.get("base", e["method"])), e.get("protocol") == IN_CONTEXT) for e in summary}
    methods = sorted(order, key=order.get)  # each method, then the same with the question in the context
    ratios = sorted({e["ratio"] for e in summary if e["ratio"] > 0})
    full = by.get(("full", 0.0))
    full_in = by.get((label("full", IN_CONTEXT), 0.0))
    peer_full = by.get(("transformers full", 0.0))
    peer_full_in = by.get((label("transformers full", IN_CONTEXT), 0.0))
    t, v, d = results["timings"], results.get("versions", {}), results.get("device", {})
    protocols = s.get("protocols") or [AFTER]
    lines = [
        f"# kvjax leaderboard: RULER at {s['length']} tokens on `{s['model']}` ({results.get('created', '')})",
        "",
        f"- {len(s['tasks'])} tasks ({', '.join(s['tasks'])}), {s['contexts']} contexts each per cell; plain-text "
        f"prompts; "
        + (
            "the context compressed, the question not (kvpress's protocol)"
            if IN_CONTEXT not in protocols
            else "two protocols: the context compressed and the question not (kvpress's), and rows marked "
            "*(question in context)*: the question compressed with the context (the papers')"
        )
        + "; score: string_match_all, percent, 95% intervals in brackets",
        f"- compression ratio r: the fraction of each context removed (each method keeps 1 - r of it; the recall "
        f"methods hold every token and read 1 - r per step); full: {_cell(full['average']) if full else 'not run'}"
        + (f"; full, question in context: {_cell(full_in['average'])}" if full_in else "")
        + (f"; transformers' full cache (the kvpress rows' model): {_cell(peer_full['average'])}" if peer_full else "")
        + (f"; the same, question in context: {_cell(peer_full_in['average'])}" if peer_full_in else ""),
        f"- kvjax {v.get('kvjax', '?')}, jax {v.get('jax', '?')}, {d.get('kind', '?')} ({d.get('cpu_count')} cores), "
        f"commit `{', '.join(s.get('commits') or [str(results.get('commit'))])}`; compute "
        f"{t.get('seconds_all_runs', 0):.0f} s "
        f"(all runs into this folder)"
        + (f", peak memory {t['peak_rss_gib']:.1f} GiB in the last run" if t.get("peak_rss_gib") else "")
        + f", command `{results.get('command', '')}`",
        *(
            [
                f"- **partial run**: {results['partial']['batches_done']} of {results['partial']['batches']} batches "
                f"finished for every method ({results['partial']['cells_done']} (batch, configuration) cells); the "
                "same command resumes it"
            ]
            if results.get("partial") and results["partial"]["batches_done"] < results["partial"]["batches"]
            else []
        ),
        "",
        "## Average over tasks",
        "",
        "| method | " + " | ".join(f"r = {r:g}" for r in ratios) + " |",
        "|---|" + "---|" * len(ratios),
    ]
    for m in methods:
        if not any((m, r) in by for r in ratios):  # the full caches (ratio 0) are in the heading
            continue
        lines.append(
            f"| {m} | " + " | ".join(_cell(by[(m, r)]["average"]) if (m, r) in by else "" for r in ratios) + " |"
        )
    peer = results.get("peer") or {}
    for name, error in peer.get("errors", {}).items():
        lines.append(f"\n{name} does not run on this model: `{error}`")
    lines += ["", "## Per task (score at each ratio)", ""]
    tasks = [t for t in s["tasks"]]
    lines += ["| method | ratio | " + " | ".join(tasks) + " |", "|---|---|" + "---|" * len(tasks)]
    for m in methods:
        for r in sorted({e["ratio"] for e in summary if e["method"] == m}):
            e = by[(m, r)]
            lines.append(
                f"| {m} | {r:g} | "
                + " | ".join(f"{e['tasks'][t]['value']:.0f}" if t in e["tasks"] else "" for t in tasks)
                + " |"
            )
    peer_rows_ = list(peer.get("rows", []))
    agreed = agreement(results["rows"], peer_rows_)
    if agreed:
        lines += [
            "",
            "## kvjax beside kvpress (same contexts, same tokens)",
            "",
            "Per method both ran: the contexts whose answers are identical (and score the same), and each side's "
            "mean score in percent over those contexts (kvjax full beside transformers' full cache).",
            "",
            "| method | ratio | protocol | identical answers | same score | kvjax | kvpress |",
            "|---|---|---|---|---|---|---|",
        ]
        for (m, r, p), c in sorted(agreed.items(), key=lambda kv: (list(PEER_OF).index(kv[0][0]), kv[0][1:])):
            lines.append(
                f"| {m} | {r:g} | {'in context' if p == IN_CONTEXT else 'after'} | {c['identical']}/{c['n']} | "
                f"{c['same_score']}/{c['n']} | {c['kvjax']:.0f} | {c['peer']:.0f} |"
            )
    paired = protocol_differences(results["rows"] + peer_rows_)
    if paired:
        lines += [
            "",
            "## The question in the context against after it (paired, same contexts)",
            "",
            "Score with the question compressed in the context minus the score with it fed after the compressed "
            "context, in percentage points, over the contexts both protocols hold; mean [95% t interval] (n).",
            "",
            "| method | ratio | difference |",
            "|---|---|---|",
        ]
        for (m, r), c in sorted(
            paired.items(), key=lambda kv: (methods.index(kv[0][0]) if kv[0][0] in methods else 0, kv[0][1])
        ):
            lines.append(f"| {m} | {r:g} | {_cell(c)} ({c['n']}) |")
    failures = needle_failures(results["rows"] + peer_rows_)
    if failures:
        lines += [
            "",
            "## How the needles' numbers fare (single_needle, multikey, multivalue: every expected number)",
            "",
            "| method | ratio | " + " | ".join(FAILURES) + " |",
            "|---|---|" + "---|" * len(FAILURES),
        ]
        for (m, r), cell in failures.items():
            lines.append(f"| {m} | {r:g} | " + " | ".join(str(cell[f]) for f in FAILURES) + " |")
    return "\n".join(lines) + "\n"


def figure(results: dict[str, Any]):
    """Average score against compression ratio, one line per method (from ``full``'s score at ratio 0), as the
    kvpress leaderboard draws it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results["summary"]
    by = {(e["method"], e["ratio"]): e["average"] for e in summary}
    full = by.get(("full", 0.0))
    full_in = by.get((label("full", IN_CONTEXT), 0.0))
    fig, ax = plt.subplots(figsize=(8, 5))
    markers = "osD^vP*Xh<>p"
    bases = list(dict.fromkeys(e.get("base", e["method"]) for e in summary if e["ratio"] > 0))
    colours = {b: f"C{k % 10}" for k, b in enumerate(bases)}
    lines = {e["method"]: e for e in summary if e["ratio"] > 0}  # one line per label
    for m, e in lines.items():
        base, protocol = e.get("base", m), e.get("protocol", AFTER)
        start = full_in if protocol == IN_CONTEXT else full
        ratios = sorted(r for (n, r) in by if n == m)
        xs = ([0.0] if start else []) + ratios
        ys = ([start["value"]] if start else []) + [by[(m, r)]["value"] for r in ratios]
        style = ":" if protocol == IN_CONTEXT else "--" if m.startswith("kvpress ") else "-"
        k = bases.index(base)
        ax.plot(xs, ys, marker=markers[k % len(markers)], color=colours[base], label=m, linestyle=style)
    if full:
        ax.axhline(full["value"], color="black", linestyle="--", linewidth=1, label="full")
    if full_in:
        ax.axhline(full_in["value"], color="black", linestyle=":", linewidth=1, label=label("full", IN_CONTEXT))
    s = results["config"]
    ax.set_xlabel("compression ratio (fraction of the context removed)")
    ax.set_ylabel("average score over tasks (%)")
    ax.set_title(f"RULER at {s['length']} tokens, {s['model']}, {s['contexts']} contexts per task")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    return fig


def write(results: dict[str, Any], out: str | Path) -> dict[str, Path]:
    """``leaderboard.json``, ``leaderboard.md`` and ``leaderboard.png`` in ``out``."""
    import matplotlib.pyplot as plt

    out = Path(out)
    paths = {"json": out / "leaderboard.json", "md": out / "leaderboard.md", "png": out / "leaderboard.png"}
    report.save(results, paths["json"])
    paths["md"].write_text(markdown(results), encoding="utf-8")
    fig = figure(results)
    fig.savefig(paths["png"], dpi=120)
    plt.close(fig)
    return paths
