"""The runner: every (method, budget) on every task, with a progress bar, into one results dict.

Runs are grouped method-major and every batch of a task is padded to the same batch size and bucket, so the
engine's jitted ``prefill``/``decode_step`` compile once per (method, budget, task shape) and are reused for
all of that task's batches. Inputs are checked before anything runs (unknown method, budget outside (0, 1],
context longer than the model's).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

from tqdm.auto import tqdm

from eval import harness, needle, perplexity, report
from kvjax.engine import bucket_length


@dataclasses.dataclass(frozen=True)
class NeedleTask:
    lengths: tuple[int, ...] = (512, 1024)
    depths: tuple[float, ...] = (0.0, 0.5, 1.0)
    batch: int = 3
    max_new_tokens: int = 8
    seed: int = 0
    name = "needle"

    def prepare(self, model):
        for n in self.lengths:
            harness.check_context(model, n, self.max_new_tokens, "lengths")
        examples = needle.build(model, self.lengths, self.depths, self.seed)
        bucket = bucket_length(max(len(e.prompt) for e in examples))
        batches = [examples[i: i + self.batch] for i in range(0, len(examples), self.batch)]
        return bucket, batches

    def run_batch(self, model, method, prepared, batch, meta) -> list[dict]:
        bucket, _ = prepared
        padded, real = harness.pad_batch([list(e.prompt) for e in batch], self.batch)
        from kvjax import engine

        out = engine.generate(model, padded, method, self.max_new_tokens, driver="python", prompt_len=bucket)
        rows = []
        for e, text, stats in zip(batch, out.text[:real], out.stats[:real]):
            rows.append({**meta, "length": e.length, "depth": e.depth, "prompt_tokens": len(e.prompt),
                         "key": e.key, "answer": text, "score": needle.score(text or "", e.key),
                         "cache_bytes": stats["cache_bytes"]})
        return rows


@dataclasses.dataclass(frozen=True)
class PerplexityTask:
    num_sequences: int = 2
    prefix: int = 512
    continuation: int = 64
    book: str = "John"
    name = "perplexity"

    def prepare(self, model):
        harness.check_context(model, self.prefix, self.continuation, "prefix")
        seqs = perplexity.build(model, self.num_sequences, self.prefix, self.continuation, self.book)
        return self.prefix, [seqs]

    def run_batch(self, model, method, prepared, batch, meta) -> list[dict]:
        nll = perplexity.streaming_nll(model, method, batch, self.prefix)
        return [{**meta, "sequence": i, "nll": float(row.mean()), "tokens": int(row.size),
                 "score": float(row.mean())} for i, row in enumerate(nll)]


def run(model, tasks: Sequence[Any], method_names: Sequence[str], budgets: Sequence[float],
        config: dict[str, Any] | None = None, progress: bool = True) -> dict[str, Any]:
    """Run ``tasks`` for every (method, budget) of :func:`harness.method_grid`; returns the results dict."""
    grid = harness.method_grid(method_names, budgets)
    methods = [(name, b, harness.make_method(name, b)) for name, b in grid]  # option errors surface here
    prepared = {t.name: t.prepare(model) for t in tasks}
    results = report.new_results({**(config or {}), "model": model.name, "methods": list(method_names),
                                  "budgets": list(budgets),
                                  "tasks": {t.name: dataclasses.asdict(t) for t in tasks}})
    results["timings"]["load_seconds"] = model.load_seconds
    total = sum(len(prepared[t.name][1]) for t in tasks) * len(methods)
    start = time.perf_counter()
    with tqdm(total=total, desc="kvjax-eval", unit="batch", disable=not progress) as bar:
        for name, budget, method in methods:
            for task in tasks:
                t0 = time.perf_counter()
                meta = {"task": task.name, "method": name, "budget": budget}
                for i, batch in enumerate(prepared[task.name][1]):
                    bar.set_postfix_str(f"{task.name} {name}" + ("" if budget is None else f"@{budget:g}"))
                    tb = time.perf_counter()
                    rows = task.run_batch(model, method, prepared[task.name], batch, meta)
                    for r in rows:
                        r["batch_seconds"] = time.perf_counter() - tb
                    results["rows"].extend(rows)
                    bar.update(1)
                results["timings"]["runs"].append({"task": task.name, "method": name, "budget": budget,
                                                   "seconds": time.perf_counter() - t0,
                                                   "note": "first batch includes compilation"})
    results["timings"]["total_seconds"] = time.perf_counter() - start
    return results
