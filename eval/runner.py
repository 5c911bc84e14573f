"""The runner: every (method, budget) on every task, with a progress bar, into one results dict.

Runs are grouped method-major and every batch of a task is padded to the same batch size and bucket, so the
engine's jitted ``prefill``/``decode_step`` compile once per (method, budget, task shape) and are reused for
all of that task's batches; when a configuration's batches are done, its compiled programs are released
(:func:`kvjax.engine.release_compiled`), so a sweep's memory stays that of its largest configuration. The model's
prefill of each needle / perplexity batch runs once, in the first configuration that needs it, and every
configuration compresses it (:class:`Shared`, :mod:`kvjax.engine.prefilled`). Inputs are checked before anything runs
(unknown method, budget outside (0, 1], context longer than the model's).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import time
from typing import Any, Sequence

import numpy as np
from tqdm.auto import tqdm

from eval import harness, needle, perplexity, report, rowstore
from kvjax.budget import budget_text
from kvjax.engine import as_run, bucket_length, release_compiled
from kvjax.methods.base import Capacity
from kvjax.methods.full import Full
from kvjax.methods.plans.hybrid import describe as describe_plan


@dataclasses.dataclass(frozen=True)
class NeedleTask:
    lengths: tuple[int, ...] = (512, 1024)
    depths: tuple[float, ...] = (0.0, 0.5, 1.0)
    batch: int = 3
    max_new_tokens: int = 8
    seed: int = 0
    trials: int = 1  # passkeys per (length, depth) cell
    name = "needle"

    def prepare(self, model):
        for n in self.lengths:
            harness.check_context(model, n, self.max_new_tokens, "lengths")
        examples = needle.build(model, self.lengths, self.depths, self.seed, self.trials)
        bucket = bucket_length(max(len(e.prompt) for e in examples))
        batches = [examples[i : i + self.batch] for i in range(0, len(examples), self.batch)]
        return bucket, batches

    def capacity(self, prepared) -> Capacity:
        return Capacity(prepared[0], self.max_new_tokens)

    def ends(self, prepared) -> list[tuple[int, int]]:
        """``(prompt tokens, decode steps)`` of each example at the end of its generation (``--equal-bytes``)."""
        return [(len(e.prompt), self.max_new_tokens - 1) for batch in prepared[1] for e in batch]

    def prefill_batch(self, prepared, batch):
        """``(tokens [B, T], lengths [B])``: what ``run_batch`` prefills (shared by every method, :class:`Shared`)."""
        from kvjax import engine

        return engine.pad_prompts(harness.pad_batch([list(e.prompt) for e in batch], self.batch)[0], prepared[0])

    def run_batch(self, model, method, prepared, batch, meta, prefilled=None) -> list[dict]:
        bucket, _ = prepared
        padded, real = harness.pad_batch([list(e.prompt) for e in batch], self.batch)
        from kvjax import engine

        # every sequence decodes max_new_tokens, so the bytes held at the end are the same for every batch (the ones
        # --equal-bytes matches); the answer is cut at its first end-of-sequence token, as generate would
        out = engine.generate(
            model,
            padded,
            method,
            self.max_new_tokens,
            driver="python",
            prompt_len=bucket,
            stop_at_eos=False,
            prefilled=prefilled,
        )
        eos = set(engine.eos_ids(model))
        rows = []
        for e, tokens, stats in zip(batch, out.tokens[:real], out.stats[:real]):
            answer = engine.until_eos(tokens, eos)
            text = model.tokenizer.decode(answer) if model.tokenizer is not None else ""
            rows.append(
                {
                    **meta,
                    "length": e.length,
                    "depth": e.depth,
                    "prompt_tokens": len(e.prompt),
                    "key": e.key,
                    "answer": text,
                    "score": needle.score(text, e.key),
                    **harness.memory_from_stats(stats),
                }
            )
        return rows


class _TeacherForced:
    """What :class:`PerplexityTask` and :class:`LongGenTask` share: ``num_sequences`` windows of the ``book``, each
    ``prefix`` prompt tokens then ``continuation`` tokens fed through the decode step. The subclass gives those four
    attributes and its own ``run_batch``."""

    num_sequences: int
    prefix: int
    continuation: int
    book: str

    def prepare(self, model):
        harness.check_context(model, self.prefix, self.continuation, "prefix")
        seqs = perplexity.build(model, self.num_sequences, self.prefix, self.continuation, self.book)
        return self.prefix, [seqs]

    def capacity(self, prepared) -> Capacity:
        return Capacity(self.prefix, self.continuation)

    def ends(self, prepared) -> list[tuple[int, int]]:
        """``(prompt tokens, decode steps)`` of each sequence at the end of its continuation (``--equal-bytes``)."""
        return [(self.prefix, self.continuation - 1)] * self.num_sequences

    def prefill_batch(self, prepared, batch):
        """``(tokens [B, T], lengths [B])``: what ``run_batch`` prefills (shared by every method, :class:`Shared`)."""
        return np.asarray(batch)[:, : self.prefix], np.full((len(batch),), self.prefix, np.int32)


@dataclasses.dataclass(frozen=True)
class PerplexityTask(_TeacherForced):
    num_sequences: int = 2
    prefix: int = 512
    continuation: int = 64
    book: str = "John"
    name = "perplexity"

    def run_batch(self, model, method, prepared, batch, meta, prefilled=None, on_phase=None) -> list[dict]:
        nll, mem = perplexity.streaming_nll(
            model, method, batch, self.prefix, memory=True, prefilled=prefilled, on_phase=on_phase
        )
        return [
            {**meta, "sequence": i, "nll": float(row.mean()), "tokens": int(row.size), "score": float(row.mean()), **m}
            for i, (row, m) in enumerate(zip(nll, mem))
        ]


@dataclasses.dataclass(frozen=True)
class LongGenTask(_TeacherForced):
    """Long generation: the perplexity of a long teacher-forced continuation (every token through the compiled
    decode step, as :class:`PerplexityTask`) with the bytes each sequence holds at several continuation lengths
    (``continuations``, ascending; the last is the whole continuation). A row per sequence: ``score`` the NLL of the
    whole continuation, the memory fields at its end, and ``sweep``: ``[{continuation, nll, perplexity, held_bytes,
    tokens_held}]`` at every length. With a decode budget (``--option decode_budget=D --option every=E``) the held
    bytes stay flat; without one, the appending methods' grow with every token."""

    num_sequences: int = 2
    prefix: int = 256
    continuations: tuple[int, ...] = (64, 256)
    book: str = "John"
    name = "longgen"

    def __post_init__(self):
        if not self.continuations or list(self.continuations) != sorted(set(self.continuations)):
            raise ValueError(f"continuations={self.continuations} must be distinct lengths in ascending order")
        if self.continuations[0] < 1:
            raise ValueError(f"continuations={self.continuations}: every length must be >= 1")

    @property
    def continuation(self) -> int:
        return self.continuations[-1]

    def run_batch(self, model, method, prepared, batch, meta, prefilled=None, on_phase=None) -> list[dict]:
        nll, mem, at = perplexity.streaming_nll(
            model,
            method,
            batch,
            self.prefix,
            memory=True,
            prefilled=prefilled,
            memory_at=self.continuations[:-1],
            on_phase=on_phase,
        )
        rows = []
        for i, (row, m) in enumerate(zip(nll, mem)):
            sweep = [
                {
                    "continuation": c,
                    "nll": float(row[:c].mean()),
                    "perplexity": float(np.exp(row[:c].mean())),
                    "held_bytes": at[c][i]["held_bytes"],
                    "tokens_held": at[c][i]["tokens_held"],
                }
                for c in self.continuations
            ]
            rows.append(
                {
                    **meta,
                    "sequence": i,
                    "nll": float(row.mean()),
                    "tokens": int(row.size),
                    "score": float(row.mean()),
                    "sweep": sweep,
                    **m,
                }
            )
        return rows


#: the most bytes of shared prefills (:class:`Shared`) a run keeps; batches beyond it prefill once per method
SHARE_PREFILL_BYTES = 2 << 30


class Shared:
    """The model's prefill of each task batch, made by the first configuration that runs the batch and
    compressed by every later one (:mod:`kvjax.engine.prefilled`): N configurations run the model's prefill
    once per batch instead of N times. Only for tasks with ``prefill_batch`` and a model without a mesh; batches
    past ``limit`` bytes in all are not kept (each configuration then prefills them itself)."""

    def __init__(self, model, limit: int = SHARE_PREFILL_BYTES):
        self.model, self.left, self.kept = model, (limit if model.mesh is None else 0), {}

    def get(self, task, prepared, index: int, batch):
        from kvjax.engine import prefilled as P

        key = (task.name, index)
        if key not in self.kept:
            self.kept[key] = None
            padded = task.prefill_batch(prepared, batch) if hasattr(task, "prefill_batch") else None
            if padded is not None:
                tokens, lengths = padded
                size = P.nbytes(self.model.config, *tokens.shape, self.model.dtype)
                if size <= self.left:
                    self.left -= size
                    self.kept[key] = P.prefill_once(self.model, tokens, lengths)
        return self.kept[key]


def equal_bytes_grid(model, task, prepared, grid, ref: str, options: dict | None = None) -> tuple[list, list[dict]]:
    """``--equal-bytes REF`` for one task: ``full`` and ``ref`` keep their budgets; every other method at nominal
    budget ``b`` gets the largest budget (a fraction of each prompt when ``b`` is one, else a token count) whose
    sequences hold at most ``ref``'s bytes at ``b`` at the end of generation, on average over the task's examples
    (:func:`harness.equal_bytes_budget`). Returns (configs ``(name, budget, nominal budget)``, records)."""
    if not hasattr(task, "ends"):
        raise ValueError(
            f"--equal-bytes is not supported by the {task.name} task (its cache capacity varies "
            "per example); run it without --equal-bytes"
        )
    cap, ends = task.capacity(prepared), task.ends(prepared)
    options = options or {}
    configs, records = [], []
    for name, b in grid:
        if name in ("full", ref):
            configs.append((name, b, b))
            continue
        ref_bytes = harness.held_at_end(
            model.config, harness.make_method(ref, b, options.get(ref)), cap, model.dtype, ends
        )
        try:
            t, got = harness.equal_bytes_budget(
                model.config,
                name,
                ref_bytes,
                cap,
                model.dtype,
                ends,
                fraction=isinstance(b, float),
                options=options.get(name),
            )
        except ValueError as e:
            print(f"[kvjax-eval] skip {name}@{budget_text(b)} on {task.name}: {e}")
            records.append(
                {
                    "task": task.name,
                    "method": name,
                    "nominal_budget": b,
                    "budget": None,
                    "ref": ref,
                    "ref_bytes": ref_bytes,
                    "skipped": str(e),
                }
            )
            continue
        if t != b and harness.same_footprint(
            model.config,
            harness.make_method(name, t, options.get(name)),
            harness.make_method(name, b, options.get(name)),
            cap,
            model.dtype,
            ends,
        ):
            t = b  # the same token counts as the nominal budget: the nominal run stands for it (run() reuses it)
        configs.append((name, t, b))
        records.append(
            {
                "task": task.name,
                "method": name,
                "nominal_budget": b,
                "budget": t,
                "bytes": got,
                "ref": ref,
                "ref_bytes": ref_bytes,
                "measure": "mean bytes held at the end of generation",
                "prompt_len": cap.prompt_len,
                "max_new_tokens": cap.max_new_tokens,
            }
        )
    return configs, records


def check_equal_bytes_refs(grid, refs: dict[str, str | None]) -> None:
    """Each reference method ``refs[option]`` (None: not asked for) must be one of the compressed methods of
    ``grid`` (:func:`harness.method_grid`'s pairs); a ValueError naming the option otherwise."""
    compressed = list(dict.fromkeys(n for n, _ in grid if n != "full"))
    for option, ref in refs.items():
        if ref is not None and ref not in compressed:
            raise ValueError(
                f"{option} {ref!r} must be one of the compressed methods of --methods "
                f"({', '.join(compressed) or 'none'})"
            )


def _plan(model, tasks, prepared, grid, equal_bytes, also_equal_bytes, options, results) -> list[tuple]:
    """The runs of :func:`run`, in order: ``(task, name, budget, nominal budget, equal-bytes reference of a second
    pass or None)``. The equal-bytes budgets are searched here (their records go to ``results["equal_bytes"]``).
    The nominal pass comes first, method-major, one configuration's tasks together: a compiled method is reused
    across its batches and across tasks of the same shapes (the main job's needle and perplexity)."""
    plan = []
    for task in tasks:
        if equal_bytes is None:
            configs = [(n, b, b) for n, b in grid]
        else:
            configs, records = equal_bytes_grid(model, task, prepared[task.name], grid, equal_bytes, options)
            results.setdefault("equal_bytes", []).extend(records)
        plan.extend((task, n, b, nb, None) for n, b, nb in configs)
        if also_equal_bytes is not None:
            configs, records = equal_bytes_grid(model, task, prepared[task.name], grid, also_equal_bytes, options)
            results.setdefault("equal_bytes", []).extend(records)
            plan.extend(
                (task, n, b, nb, also_equal_bytes) for n, b, nb in configs if n not in ("full", also_equal_bytes)
            )
    order = {n: i for i, n in enumerate(dict.fromkeys(n for n, _ in grid))}
    plan.sort(key=lambda p: (p[4] is not None, order[p[1]], repr(p[2]), p[4] or ""))
    return plan


def _run_batches(model, task, method, prepared, meta, shared, bar, cells=None) -> list[dict]:
    """Every batch of one task under one method: its rows, each with its batch's seconds (``shared``: the model's
    prefill of each batch computed once for every configuration). ``cells`` (a resumable run, :class:`_Cells`):
    a batch it holds is read back, not run (nor prefilled), and a batch run is appended to it."""
    out = []
    method = as_run(model.config, method)  # a hybrid model: ring buffers on its local layers
    phases = inspect.signature(task.run_batch).parameters.keys() >= {"on_phase"}
    label, show = bar.postfix or "", harness.throttled(bar.set_postfix_str)
    for i, batch in enumerate(prepared[1]):
        held = cells.get(meta, i) if cells else None
        if held is not None:
            out.extend(held)
            bar.update(1)
            continue
        tb = time.perf_counter()
        pre = shared.get(task, prepared, i, batch) if shared else None
        kw = {} if pre is None else {"prefilled": pre}
        if phases:
            where = f"{label} batch {i + 1}/{len(prepared[1])}".strip()
            kw["on_phase"] = lambda phase, where=where: show(f"{where}: {phase}")
        rows = task.run_batch(model, method, prepared, batch, meta, **kw)
        for r in rows:
            r["batch_seconds"] = time.perf_counter() - tb
        if cells:
            cells.put(meta, i, rows)
        out.extend(rows)
        bar.update(1)
    return out


class _Cells:
    """A resumable, growable run's rows in ``out/rows.jsonl`` (:class:`eval.rowstore.RowStore`): one record per
    (task, method, budget, setting, batch), so a killed run resumes at the batch it was in and a run adding methods,
    budgets or options to the folder computes only their cells."""

    GROWS = ("methods", "budgets", "options")

    def __init__(self, out, settings: dict, restart: bool, commit: str | None):
        self.store = rowstore.RowStore(
            out, settings, self.GROWS, restart, what="kvjax-eval run", owners={"options": "methods"}
        )
        self.commit = commit
        self.done = {r["cell"]: r["rows"] for r in self.store.records}

    @staticmethod
    def key(meta: dict, batch: int) -> str:
        fields = ("task", "method", "budget", "nominal_budget", "equal_bytes_ref", "setting")
        return json.dumps([meta.get(f) for f in fields] + [batch])

    def get(self, meta: dict, batch: int) -> list[dict] | None:
        return self.done.get(self.key(meta, batch))

    def put(self, meta: dict, batch: int, rows: list[dict]) -> None:
        key = self.key(meta, batch)
        seconds = rows[0].get("batch_seconds", 0.0) if rows else 0.0
        self.store.append({"cell": key, "seconds": seconds, "commit": self.commit, "rows": rows})
        self.done[key] = rows


def _timing(task, name: str, budget, seconds: float, setting, note: str) -> dict:
    """One entry of ``results["timings"]["runs"]``: a configuration's run of a task."""
    return {"task": task.name, "method": name, "budget": budget, "seconds": seconds, "setting": setting, "note": note}


def _run_config(model, tasks, method_names, budgets, options) -> dict:
    """What :func:`run` records of its arguments in ``results["config"]``."""
    return {
        "model": model.name,
        "dtype": str(model.dtype),
        "methods": list(method_names),
        "options": options,
        "budgets": list(budgets),
        "tasks": {t.name: dataclasses.asdict(t) for t in tasks},
        # what each kind of layer holds: on a hybrid model, ring buffers of the window on the local layers and the
        # method (named in each row) on the global ones
        "layers": describe_plan(model.config, Full()).replace(": full", ": the method"),
    }


def _row_meta(task, name: str, budget, nominal, equal_bytes, second) -> dict:
    """The fields every row of one configuration's run carries: task, method, budget and, in an equal-bytes
    comparison, the nominal budget and the reference method (``second``: the second pass's)."""
    meta = {"task": task.name, "method": name, "budget": budget}
    if equal_bytes is not None:
        meta.update(nominal_budget=nominal, equal_bytes_ref=equal_bytes)
    if second is not None:
        meta.update(nominal_budget=nominal, equal_bytes_ref=second, setting="equal_bytes")
    return meta


def _check_grid(model, method_names, budgets, options, equal_bytes, also_equal_bytes) -> list:
    """The (method, budget) grid, every configuration built once so that bad methods, budgets and options raise."""
    grid = harness.method_grid(method_names, budgets, model.config.max_position_embeddings)
    check_equal_bytes_refs(grid, {"--equal-bytes": equal_bytes, "--also-equal-bytes": also_equal_bytes})
    for name, b in grid:
        harness.make_method(name, b, options.get(name))  # option errors surface here
    return grid


def run(
    model,
    tasks: Sequence[Any],
    method_names: Sequence[str],
    budgets: Sequence,
    config: dict[str, Any] | None = None,
    progress: bool = True,
    equal_bytes: str | None = None,
    options: dict[str, dict] | None = None,
    also_equal_bytes: str | None = None,
    share_prefill: bool = True,
    out: str | None = None,
    restart: bool = False,
) -> dict[str, Any]:
    """Run ``tasks`` for every (method, budget) of :func:`harness.method_grid`; returns the results dict.

    ``equal_bytes`` (a method name in ``method_names``): the other compressed methods run at the budget whose
    bytes held at the end of generation match that method's at each nominal budget (:func:`equal_bytes_grid`);
    rows then carry
    ``nominal_budget`` and ``equal_bytes_ref``, and ``results["equal_bytes"]`` records every chosen budget.
    ``options``: ``{method: {option: value}}`` passed to every config of that method (``kvjax-eval --option``).
    ``also_equal_bytes`` (a method name): after the nominal runs, every other compressed method runs again at the
    budget matching that method's bytes held at the end (rows with ``setting="equal_bytes"``; the main job's second
    comparison). Methods that cannot match (the recall methods keep every token) are recorded as skipped; a method
    whose matching budget is its nominal one reuses the nominal run's rows (marked ``reused``). ``share_prefill``:
    the model's prefill of each needle/perplexity batch runs once and every configuration compresses it
    (:class:`Shared`); the rows are those of a prefill per configuration, up to float rounding. ``out``: a folder
    that makes the run resumable and growable (:class:`_Cells`): each finished batch of each configuration is kept in
    ``out/rows.jsonl``; a later run into it with the same tasks and model runs only the cells it lacks, and may add
    methods, budgets and options (the folder then holds the union, and the results cover all of it); ``restart``
    starts the folder again."""
    options = dict(options or {})
    grid = _check_grid(model, method_names, budgets, options, equal_bytes, also_equal_bytes)
    prepared = {t.name: t.prepare(model) for t in tasks}  # bad input is named before a folder is read
    cells = None
    if out is not None:
        fixed = _run_config(model, tasks, method_names, budgets, options)
        settings = {**fixed, "equal_bytes": equal_bytes, "equal_bytes_also": also_equal_bytes}
        cells = _Cells(out, settings, restart, commit=None)  # the commit: the results' own, set below
        held = cells.store.settings
        method_names, budgets = held["methods"], list(held["budgets"])
        options = {**{m: rowstore.tupled(kw) for m, kw in held["options"].items() if m not in options}, **options}
        grid = _check_grid(model, method_names, budgets, options, equal_bytes, also_equal_bytes)  # the folder's union
    results = report.new_results(
        {
            **(config or {}),
            **_run_config(model, tasks, method_names, budgets, options),
            "equal_bytes": equal_bytes,
            "equal_bytes_also": also_equal_bytes,
        }
    )
    if cells is not None:
        cells.commit = results["commit"]
    results["timings"]["load_seconds"] = model.load_seconds
    plan = _plan(model, tasks, prepared, grid, equal_bytes, also_equal_bytes, options, results)
    total = sum(len(prepared[t.name][1]) for t, *_ in plan)
    start = time.perf_counter()
    done = {}  # (task, method, budget) of the first pass -> its rows
    shared = Shared(model) if share_prefill else None
    with tqdm(total=total, desc="kvjax-eval", unit="batch", disable=not progress) as bar:
        for k, (task, name, budget, nominal, second) in enumerate(plan):
            method = harness.make_method(name, budget, options.get(name))
            t0 = time.perf_counter()
            meta = _row_meta(task, name, budget, nominal, equal_bytes, second)
            if second is not None:
                same = done.get((task.name, name, budget))
                if same is not None:  # the budget matching the reference's bytes is the nominal one: same run
                    results["rows"].extend({**r, **meta, "reused": "the nominal run's rows"} for r in same)
                    bar.update(len(prepared[task.name][1]))
                    results["timings"]["runs"].append(
                        _timing(task, name, budget, 0.0, f"bytes of {second}", "the nominal run's rows, reused")
                    )
                    continue
            first = len(results["rows"])
            bar.set_postfix_str(
                f"{task.name} {name}"
                + ("" if budget is None else f"@{budget_text(budget)}")
                + ("" if second is None else f" (bytes of {second})")
            )
            results["rows"].extend(_run_batches(model, task, method, prepared[task.name], meta, shared, bar, cells))
            note = "a configuration's first batch includes compilation"
            took = time.perf_counter() - t0
            results["timings"]["runs"].append(_timing(task, name, budget, took, second and f"bytes of {second}", note))
            if second is None:
                done[(task.name, name, budget)] = results["rows"][first:]
            if k + 1 == len(plan) or plan[k + 1][1:3] != (name, budget):
                release_compiled()  # the next configuration compiles its own programs; this one's are dead weight
    results["timings"]["total_seconds"] = time.perf_counter() - start
    if cells is not None:  # what the folder's cells took, in this run and the ones before it (resumed, grown)
        results["timings"]["cell_seconds_all_runs"] = sum(r.get("seconds", 0.0) for r in cells.store.records)
    return results
