"""Serving at a fixed memory: the largest batch each method fits on one device, and its decode tokens/s there.

A compressed cache pays twice in serving: each step reads less, and more sequences fit in the same memory. Per
method@budget at one context (default: Llama-3.1-8B shapes, random bfloat16 weights, 32k-token prompts)::

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python benchmarks/serving.py --out benchmarks/results/serving_h200.json

(``bash scripts/gpu_serving.sh`` runs it, then the Gemma 3 rows, as one device call; ``--model tiny`` is the CPU
test's). Rows, ``full`` first, then the five papers' methods (chelsea, clusterkv, pqcache, chunkkv, less), then the
baselines; every method at ``--budget`` (0.2), the recall methods (``Method.recalls``: they keep every token and
save reads, not memory) at ``--recall-budget`` (2048 tokens).

**The fit** (kind ``fit``). A serving engine prefills each request alone and decodes the batch together, so the
memory at batch ``B`` is, in bytes (``L`` the limit: ``--memory-gb``, else the device's ``bytes_limit``)::

    S(B)    = fixed + B * s            the states at batch B: s per sequence from the method's own accounting
                                       (engine.memory_bytes at batch 2 minus batch 1, of the states engine.init_states
                                       builds at the context's bucket + --new-tokens), fixed = what else the state
                                       allocates (LESS's kernels)
    P       = peak of the batch-1 prefill   (memory_analysis: weights + S(1) + its temporaries + logits)
    D(B)    = peak of the batch-B decode loop, affine through its memory_analysis at batches 1 and --probe-batch:
              D(1) + (B - 1) * (D(b2) - D(1)) / (b2 - 1)   (weights + S(B) + temporaries that grow per sequence:
              logits, attention scores over the held slots; XLA's fixed temporaries are the intercept)
    need(B) = max(P + S(B), D(B) + S(1))

(the prefill of one sequence beside the batch's states, as a server prefills a new request; the batch's decode
beside the one prefilled state this benchmark keeps to copy from). The fitted batch is the largest ``B <=
--max-batch`` with ``need(B) <= L`` (:func:`fit_batch`, integer arithmetic). Why affine in ``B``: every state leaf
has a batch axis or none (LESS's kernels), and a decode step's temporaries are per sequence (its logits, its
scores over its slots) plus what XLA keeps whatever the batch; the confirmation below catches where XLA's buffer
assignment departs from the line. The fitted batch is then confirmed: the decode loop compiled at ``B`` must
satisfy ``max(P + S(B), D_compiled(B) + S(1)) <= L`` and must run. On a failure the try is recorded in ``tries``
with its reason and a smaller batch is tried, at most ``--max-tries`` in all: where the compiled peak is off the
line, the line is refitted through it and the nearest compiled point below (``refit``: XLA:CPU's temporaries, for
one, grow faster at large batches than between 1 and 4); on a compile error or an out-of-memory, ``B - 1``.

**The measurement.** One ``--context``-token random prompt is prefilled at batch 1 (``ttft_1_s``, one run of the
compiled prefill); its states are copied ``B`` times (``jnp.broadcast_to`` of every leaf from batch 1 to the
batch-``B`` shapes: what ``B`` prefills of that prompt give, so a step reads what a batch of ``B`` such prompts
reads); then the compiled decode loop (``engine.run_loop``, scan driver, ``--new-tokens - 1`` steps) runs once to
warm up and ``--repeats`` times timed, each run continuing from the last one's states and tokens (the states are
built with room for all of them: ``Capacity(bucket, (repeats + 1) * (new_tokens - 1) + 1)``). ``tpot_s`` = the
median run's seconds / steps; ``throughput_tok_s`` = ``B * steps / median seconds``; ``throughput_ratio_vs_full``
and ``batch_ratio_vs_full`` against the ``full`` row of the same run (``full_row``).

**Batch rows** (kind ``batch``, ``--batch-contexts``, default 32k and 64k at ``--batch`` 8): e2e.py's row (its
skip rule, ``compile_pair``, ratios): the whole batch prefilled (``ttft_s``, one run of the compiled prefill), then
the same decode timing, ``full`` first at each context.

**Resumable.** The JSON (``--out``) is rewritten after every row and read at start: a row already there with the
same commit (``$KVJAX_COMMIT`` where set) and settings (``settings``) is not measured again. A row is written as
``running`` before it starts; one found so (its process was stopped inside it, e.g. by a phase's ``timeout``) is
measured again in its place once, and skipped with that reason when stopped a second time, so a row too slow for a
limit does not block the rows after it (``--retry-interrupted`` measures it regardless). ``--stop-after-s`` starts
no row after that many seconds. Nothing crashes the run: a method that cannot build its cache, does not fit one
sequence, or fails to compile or run at every batch tried is a ``skipped`` row with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import context_label, fmt, git_dirty, load_average, parse_budgets, parse_contexts  # noqa: E402
from e2e import (  # noqa: E402
    MODELS,
    memory_stats,
    abstract_params,
    abstract_states,
    add_ratios,
    cannot_run,
    compile_pair,
    device_memory_bytes,
    device_params,
    estimate_bytes,
    header,
    memory_analysis,
)

from kvjax import engine, methods  # noqa: E402
from kvjax.methods.base import Capacity, tree_bytes  # noqa: E402
from kvjax.methods.plans.hybrid import for_model  # noqa: E402
from kvjax.engine.sampling import Greedy  # noqa: E402

#: The five papers' methods, in the order their rows follow ``full``; the baselines come after, in registry order.
PAPERS_METHODS = ("chelsea", "clusterkv", "pqcache", "chunkkv", "less")


def serving_variants(names, budget, recall_budget) -> list[tuple[str, object, object]]:
    """``(label, method, budget)``: full first, then the papers' methods, then the baselines; a recall method at
    ``recall_budget``, every other at ``budget``; ChunkKV without index reuse."""
    for n in names:
        methods.get(n)  # an unknown name raises the registry's ValueError
    order = ["full"] + [n for n in PAPERS_METHODS if n in names] + [n for n in names if n not in PAPERS_METHODS]
    out = [("full", methods.get("full"), None)]
    for name in dict.fromkeys(n for n in order if n != "full"):
        b = recall_budget if methods.REGISTRY[name].recalls else budget
        out.append((f"{name}@{b}", methods.get(name, budget=b), b))
    return out


# ---------------------------------------------------------------------------------------------------------------
# The byte model and the fit.


def state_bytes(cfg, method, cap, dtype, scan) -> tuple[int, int]:
    """``(fixed, per_seq)``: the states at batch ``B`` allocate ``fixed + B * per_seq`` bytes, ``per_seq`` from the
    method's own accounting (engine.memory_bytes, batch 2 minus batch 1), ``fixed`` the rest of what batch 1
    allocates. Abstract (nothing allocated)."""
    m = for_model(cfg, method)
    one, two = (engine.memory_bytes(m, abstract_states(cfg, method, b, cap, dtype, False)) for b in (1, 2))
    per_seq = two - one
    return tree_bytes(abstract_states(cfg, method, 1, cap, dtype, scan)) - per_seq, per_seq


def fit_batch(limit: int, prefill_peak: int, decode_peaks: dict, fixed: int, per_seq: int, max_batch: int) -> dict:
    """The largest ``B <= max_batch`` with ``need(B) = max(P + S(B), D(B) + S(1)) <= limit`` (module docstring),
    ``D`` the line through the two points of ``decode_peaks`` (``{batch: decode-loop peak}``: the probes at 1 and
    ``--probe-batch``, or a refit's); 0 when not even one sequence fits. Returns the batch and each constraint's
    own bound."""
    (ba, pa), (bb, pb) = sorted((int(b), p) for b, p in decode_peaks.items())
    room = limit - prefill_peak - fixed  # P + fixed + B s <= L
    by_prefill = room // per_seq if per_seq > 0 else (max_batch if room >= 0 else 0)
    room = limit - (fixed + per_seq) - pa  # pa + (B - ba) (pb - pa) / (bb - ba) + S(1) <= L
    if pb <= pa:  # the peak does not grow with the batch: taken as flat at pa
        by_decode = max_batch if room >= 0 else 0
    else:
        by_decode = ba + room * (bb - ba) // (pb - pa)
    return {
        "batch": max(0, min(by_prefill, by_decode, max_batch)),
        "by_prefill": by_prefill,
        "by_decode": by_decode,
    }


def probe(cfg, method, shapes, cap, dtype, scan, probe_batch, new_tokens) -> tuple[dict, dict, dict]:
    """The fit's inputs, from abstract shapes (nothing allocated): the states' bytes (:func:`state_bytes`), the
    batch-1 prefill's peak and the decode loop's peaks at batches 1 and ``probe_batch`` (``memory_analysis``).
    Returns (e2e.compile_pair's dict at batch 1 + ``probe_compile_s``, ``{batch: compiled decode loop}``, inputs)."""
    fixed, per_seq = state_bytes(cfg, method, cap, dtype, scan)
    comp = compile_pair(
        cfg, method, shapes, abstract_states(cfg, method, 1, cap, dtype, scan), 1, cap.prompt_len, new_tokens
    )
    st = abstract_states(cfg, method, probe_batch, cap, dtype, scan)
    dec, comp["probe_compile_s"] = compile_decode(cfg, method, shapes, st, probe_batch, new_tokens)
    inputs = {
        "state_fixed": fixed,
        "state_per_seq": per_seq,
        "prefill_peak": _peak(comp["prefill"]),
        "decode_peaks": {1: _peak(comp["decode"]), probe_batch: _peak(dec)},
    }
    return comp, {1: comp["decode"], probe_batch: dec}, inputs


def need_bytes(b: int, prefill_peak: int, decode_peak_b: int, fixed: int, per_seq: int) -> int:
    """``need(B)`` with the decode loop's peak at ``B`` given (the compiled one, in the confirmation)."""
    return max(prefill_peak + fixed + b * per_seq, decode_peak_b + fixed + per_seq)


def _peak(compiled) -> int:
    return (memory_analysis(compiled) or {}).get("peak", 0)


def compile_decode(cfg, method, params, states, batch, new_tokens):
    """The decode loop (scan driver) compiled from abstract ``states`` at ``batch``; (executable, seconds)."""
    i32 = jax.ShapeDtypeStruct((batch,), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    loop = engine.DecodeLoop(cfg, method, Greedy(), new_tokens, ())
    t0 = time.perf_counter()
    out = engine.run_loop.lower(loop, "scan", params, states, i32, i32, key).compile()
    return out, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------------------
# Running one batch.


def run_at(cfg, method, params, states, first, lengths, decode, repeats) -> dict:
    """Decode timing of ``states`` (donated) at their batch: the compiled loop ``decode`` runs once to warm up, then
    ``repeats`` times, each run continuing from the last one's states, token and positions (the states are built with
    room for every run's steps). Raises what the device raises (an out-of-memory, ...)."""
    b = first.shape[0]
    dev, runs, steps = jax.devices()[0], [], 0
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        out, steps, states = decode(params, states, first, lengths, jax.random.PRNGKey(i))
        out.block_until_ready()
        if i:  # the first run warms up
            runs.append(time.perf_counter() - t0)
        steps = int(steps) - 1
        first, lengths = out[:, -1], lengths + steps
    dec = statistics.median(runs)
    m = for_model(cfg, method)
    return {
        "decode_s": dec,
        "decode_runs_s": runs,
        "decode_steps": steps,
        "tpot_s": dec / steps,
        "throughput_tok_s": b * steps / dec,
        "cache_bytes": engine.memory_bytes(m, states),
        "tokens_held_per_seq": float(np.mean(engine.tokens_held(m, states))),
        "peak_bytes_in_use": memory_stats(dev).get("peak_bytes_in_use"),
    }


def tile(states, target):
    """``states`` of one sequence copied to ``target``'s (abstract) batch-``B`` shapes: every leaf broadcast from
    batch 1 to ``B`` (leaves without a batch axis are copied as they are)."""
    return jax.jit(lambda s: jax.tree.map(lambda x, t: jnp.broadcast_to(x, t.shape), s, target))(states)


def prefill(comp, params, tokens, lengths, init) -> tuple:
    """One run of the compiled prefill on fresh states: (states, first tokens, seconds incl. the first token)."""
    states = init()
    jax.block_until_ready(states)
    t0 = time.perf_counter()
    states, logits = comp(params, tokens, lengths, states)
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    first.block_until_ready()
    return states, first, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------------------
# The run: rows, resume, output.


class Serving:
    def __init__(self, args):
        self.args = args
        self.cfg, self.dtype = MODELS[args.model], jnp.dtype(args.dtype)
        self.scan = args.scan_layers == "on" or (args.scan_layers == "auto" and args.model == "llama-3.1-8b")
        self.limit, self.limit_from = device_memory_bytes(jax.devices()[0], args.memory_gb)
        names = [m.strip() for m in args.methods.split(",") if m.strip()]
        self.todo = serving_variants(names, args.budget, args.recall_budget)
        self.out = Path(args.out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.head = {**header(args, self.cfg, self.dtype, self.limit, self.limit_from), "benchmark": "serving"}
        self.head["commit_dirty"] = git_dirty("kvjax", "benchmarks/e2e.py", "benchmarks/serving.py")
        self.settings = {
            k: getattr(args, k)
            for k in (
                "model",
                "dtype",
                "new_tokens",
                "repeats",
                "probe_batch",
                "max_batch",
                "max_tries",
                "compile_only",
            )
        } | {"scan_layers": self.scan, "memory_limit_bytes": self.limit}
        self.rows = json.loads(self.out.read_text())["rows"] if self.out.exists() else []
        self.shapes = abstract_params(self.cfg, self.dtype, self.scan)
        self.weights = tree_bytes(self.shapes)
        self.params = None
        self.rng = np.random.default_rng(0)
        self.t0 = time.monotonic()
        print(
            f"serving: {args.model} {self.dtype.name} on {jax.devices()[0].device_kind}, limit "
            f"{self.limit / 2**30:.2f} GiB ({self.limit_from}), scan_layers={self.scan}",
            flush=True,
        )

    # -- rows ---------------------------------------------------------------------------------------------------
    def key(self, r) -> tuple:
        return (r["kind"], r["label"], r["context"], r.get("batch_asked"))

    def same(self, r) -> bool:
        return r.get("commit") == self.head["commit"] and r.get("settings") == self.settings

    def prior(self, row) -> dict | None:
        """The row already measured at this key, commit and settings, else None. A row left ``running`` (its process
        was stopped inside it) is measured again in its place once; stopped twice, it is skipped with that reason
        (``--retry-interrupted``: measured again regardless)."""
        for i, r in enumerate(self.rows):
            if self.key(r) == self.key(row) and self.same(r):
                if r["status"] == "running":
                    n = r.get("interrupted", 0) + 1
                    if n < 2 or self.args.retry_interrupted:
                        row.update(row_id=i, interrupted=n)
                        return None
                    r.update(
                        status="skipped",
                        interrupted=n,
                        skipped=f"interrupted {n} times: runs stopped inside this row (a phase's time limit, or "
                        "killed); --retry-interrupted measures it again",
                    )
                    self.write()
                return r
        return None

    def write(self) -> None:
        """The JSON, replaced whole (a process killed while writing leaves the previous one)."""
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps({**self.head, "rows": self.rows}, indent=1, default=str))
        os.replace(tmp, self.out)

    def start(self, row) -> dict:
        row.update(commit=self.head["commit"], settings=self.settings, status="running")
        if "row_id" in row:  # an interrupted row, measured again in its place
            self.rows[row["row_id"]] = row
        else:
            row["row_id"] = len(self.rows)
            self.rows.append(row)
        self.write()
        return row

    def finish(self, row, where) -> None:
        row["load_average_1min"] = load_average()
        self.write()
        if row["status"] == "ok":
            print(
                f"{where} batch {row['batch']:4d}  TPOT {1e3 * row['tpot_s']:8.2f} ms  "
                f"{row['throughput_tok_s']:9.1f} tok/s  x{fmt(row.get('throughput_ratio_vs_full'), '.2f')} full",
                flush=True,
            )
        elif row["status"] == "compiled":
            print(f"{where} fits {row['fit']['batch']} ({_fit_text(row['fit'])})", flush=True)
        else:
            print(f"{where} skipped: {row['skipped']}", flush=True)

    def ensure_params(self):
        if self.params is None:
            self.params = device_params(self.cfg, self.dtype, self.scan)
        return self.params

    def prompt(self, batch, n, bucket):
        tokens, lengths = engine.pad_prompts(self.rng.integers(1, self.cfg.vocab_size, (batch, n)).tolist(), bucket)
        return jnp.asarray(tokens), jnp.asarray(lengths)

    def base(self, kind, ctx, label, method, budget, batch_asked=None) -> dict:
        n = min(ctx, self.cfg.max_position_embeddings - self.steps() - 1)
        return {
            "kind": kind,
            "label": label,
            "method": methods.method_of(method).name,
            "budget": budget,
            "model": self.args.model,
            "context": ctx,
            "prompt_len": n,
            "bucket": engine.bucket_length(n),
            "new_tokens": self.args.new_tokens,
            "batch_asked": batch_asked,
        }

    def steps(self) -> int:
        """Decode steps the states make room for: every run's (warm-up + repeats), each continuing the last."""
        return (self.args.repeats + 1) * (self.args.new_tokens - 1)

    def capacity(self, row) -> Capacity:
        return Capacity(row["bucket"], self.steps() + 1)

    def _cannot(self, method, n) -> str | None:
        model = types.SimpleNamespace(config=self.cfg, dtype=self.dtype)
        return cannot_run(model, method, n, self.steps())

    # -- the rows -------------------------------------------------------------------------------------------------
    def sweep(self, kind: str, ctx: int) -> bool:
        """Every method's row of ``kind`` ("fit" or "batch") at ``ctx``, full first; False when ``--stop-after-s``
        stopped it before a row."""
        full = None
        for label, method, budget in self.todo:
            row = self.base(kind, ctx, label, method, budget, self.args.batch if kind == "batch" else None)
            where = f"{kind} {context_label(ctx):>5s} {label:20s}"
            done = self.prior(row)
            if done is not None:
                print(f"{where} already measured (row {done['row_id']}, status {done['status']})", flush=True)
            elif time.monotonic() - self.t0 > self.args.stop_after_s:
                print(f"{where} not started: --stop-after-s {self.args.stop_after_s:.0f} has passed", flush=True)
                return False
            else:
                done = self.start(row)
                try:
                    (self.fit_one if kind == "fit" else self.batch_one)(row, method)
                except Exception as e:  # noqa: BLE001  (a row never crashes the run)
                    row.update(status="skipped", skipped=f"{type(e).__name__}: {str(e)[:400]}")
                engine.release_compiled()
                if row["status"] == "ok":
                    (_ratios if kind == "fit" else add_ratios)(row, row if label == "full" else full)
                self.finish(row, where)
            full = done if label == "full" else full
        return True

    def fit_one(self, row, method) -> None:
        a, cfg, dt = self.args, self.cfg, self.dtype
        reason = self._cannot(method, row["prompt_len"])
        if reason:
            row.update(status="skipped", skipped=reason)
            return
        cap, shapes = self.capacity(row), self.shapes
        comp, compiled, fit = probe(cfg, method, shapes, cap, dt, self.scan, a.probe_batch, a.new_tokens)
        fixed, per_seq = fit["state_fixed"], fit["state_per_seq"]
        fit = {"limit": self.limit, "weights": self.weights, **fit}
        fit.update(fit_batch(self.limit, fit["prefill_peak"], fit["decode_peaks"], fixed, per_seq, a.max_batch))
        row.update(fit=fit, tries=[], **{k: v for k, v in comp.items() if k.endswith("_s")})
        if a.compile_only:
            row["status"] = "compiled"
            return
        if fit["batch"] < 1:
            row.update(
                status="skipped",
                skipped=f"not even one sequence fits {self.limit / 2**30:.2f} GiB "
                f"({self.limit_from}): {_fit_text(fit)}",
            )
            return
        params = self.ensure_params()
        tokens, lengths = self.prompt(1, row["prompt_len"], row["bucket"])
        init = jax.jit(lambda: engine.init_states(cfg, method, 1, cap, dt, scan_layers=self.scan))
        st, first, row["ttft_1_s"] = prefill(comp["prefill"], params, tokens, lengths, init)
        b, points = fit["batch"], dict(fit["decode_peaks"])
        while b >= 1 and len(row["tries"]) < a.max_tries:
            t = {"batch": b}
            row["tries"].append(t)
            try:
                target = abstract_states(cfg, method, b, cap, dt, self.scan)
                dec = compiled.get(b)
                if dec is None:
                    dec, t["compile_s"] = compile_decode(cfg, method, shapes, target, b, a.new_tokens)
                t["decode_peak"] = points[b] = _peak(dec)
                t["need"] = need_bytes(b, fit["prefill_peak"], t["decode_peak"], fixed, per_seq)
                if t["need"] > self.limit:  # off the line: refit it through this point and the nearest below
                    lower = max(x for x in points if x < b)
                    t["refit"] = fit_batch(
                        self.limit,
                        fit["prefill_peak"],
                        {lower: points[lower], b: points[b]},
                        fixed,
                        per_seq,
                        a.max_batch,
                    )["batch"]
                    raise MemoryError(
                        f"compiled decode loop at batch {b}: need {t['need'] / 2**30:.3f} GiB > limit "
                        f"{self.limit / 2**30:.3f} GiB; refit: batch {t['refit']}"
                    )
                first_b, lengths_b = (jnp.broadcast_to(x, (b,)) for x in (first, lengths))
                res = run_at(cfg, method, params, tile(st, target), first_b, lengths_b, dec, a.repeats)
            except Exception as e:  # noqa: BLE001  (compile failure, out of memory: a smaller batch)
                t.update(status="failed", reason=f"{type(e).__name__}: {str(e)[:300]}")
                b = min(b - 1, t.get("refit", b))
                continue
            t["status"] = "ok"
            row.update(res, batch=b, status="ok", state_bytes=fixed + b * per_seq)
            return
        row.update(
            status="skipped",
            skipped=f"no batch from {fit['batch']} down ran in {len(row['tries'])} tries: "
            + "; ".join(f"{t['batch']}: {t['reason']}" for t in row["tries"]),
        )

    def batch_one(self, row, method) -> None:
        a, cfg, dt, b = self.args, self.cfg, self.dtype, self.args.batch
        reason = self._cannot(method, row["prompt_len"])
        cap = self.capacity(row)
        st = abstract_states(cfg, method, b, cap, dt, self.scan)
        if reason is None:
            est = row["estimate_bytes"] = estimate_bytes(cfg, self.weights, st, b, row["bucket"], dt)
            if est["total"] > self.limit:
                reason = f"estimated memory {est['total'] / 2**30:.1f} GiB > limit {self.limit / 2**30:.1f} GiB"
        if reason is None:
            comp = compile_pair(cfg, method, self.ensure_params(), st, b, row["bucket"], a.new_tokens)
            row.update({k: v for k, v in comp.items() if k not in ("prefill", "decode")})
            peak = max(_peak(comp["prefill"]), _peak(comp["decode"]))
            if peak > self.limit:
                reason = f"compiled executables need {peak / 2**30:.1f} GiB > limit {self.limit / 2**30:.1f} GiB"
        if reason:
            row.update(status="skipped", skipped=reason)
            return
        tokens, lengths = self.prompt(b, row["prompt_len"], row["bucket"])
        init = jax.jit(lambda: engine.init_states(cfg, method, b, cap, dt, scan_layers=self.scan))
        states, first, ttft = prefill(comp["prefill"], self.params, tokens, lengths, init)
        res = run_at(cfg, method, self.params, states, first, lengths, comp["decode"], a.repeats)
        row.update(res, batch=b, ttft_s=ttft, e2e_s=ttft + res["decode_s"], status="ok")


def _ratios(row, full) -> None:
    ok = row.get("status") == "ok" and full is not None and full.get("status") == "ok"
    row["full_row"] = full["row_id"] if ok else None
    row["throughput_ratio_vs_full"] = row["throughput_tok_s"] / full["throughput_tok_s"] if ok else None
    row["batch_ratio_vs_full"] = row["batch"] / full["batch"] if ok else None
    row["tpot_ratio_vs_full"] = row["tpot_s"] / full["tpot_s"] if ok else None


def _fit_text(fit) -> str:
    g, peaks = 2**30, {b: round(p / 2**30, 3) for b, p in fit["decode_peaks"].items()}
    return (
        f"weights {fit['weights'] / g:.2f} GiB, states {fit['state_per_seq'] / g:.4f} GiB a sequence "
        f"(+{fit['state_fixed'] / g:.4f}), prefill peak {fit['prefill_peak'] / g:.2f} GiB, decode peaks {peaks} GiB"
    )


def table(data) -> str:
    """The fit table and the batch table of a run's JSON (the last row per key)."""
    rows = list({(r["kind"], r["label"], r["context"], r.get("batch_asked")): r for r in data["rows"]}.values())
    g = 2**30
    lines = [
        f"serving: {data['model']} ({data['dtype']}) on {data['device_kind']} ({data['backend']}), jax "
        f"{data['jax_version']}, commit {(data.get('commit') or '?')[:10]}, limit "
        f"{(data.get('memory_limit_bytes') or 0) / g:.1f} GiB ({data.get('memory_limit_from')}), "
        f"{data['new_tokens'] - 1} decode steps a run"
    ]
    fit = [r for r in rows if r["kind"] == "fit"]
    if fit:
        lines.append(f"\n== the largest batch at a fixed memory, {context_label(fit[0]['context'])} ==")
        lines.append(
            f"{'method':20s} {'MiB/seq':>8s} {'fit':>5s} {'batch':>5s} {'tries':>5s} {'TPOT ms':>8s} "
            f"{'tok/s':>9s} {'tok/s x':>7s} {'batch x':>7s}"
        )
        for r in fit:
            if r["status"] == "compiled":
                lines.append(
                    f"{r['label']:20s} {r['fit']['state_per_seq'] / 2**20:8.1f} {r['fit']['batch']:5d}     -  "
                    f"(--compile-only: {_fit_text(r['fit'])})"
                )
                continue
            if r["status"] != "ok":
                lines.append(f"{r['label']:20s} {r['status']}: {r.get('skipped', '')[:100]}")
                continue
            lines.append(
                f"{r['label']:20s} {r['fit']['state_per_seq'] / 2**20:8.1f} {r['fit']['batch']:5d} {r['batch']:5d} "
                f"{len(r['tries']):5d} {1e3 * r['tpot_s']:8.2f} {r['throughput_tok_s']:9.1f} "
                f"{fmt(r.get('throughput_ratio_vs_full'), '7.2f')} {fmt(r.get('batch_ratio_vs_full'), '7.2f')}"
            )
    for ctx in dict.fromkeys(r["context"] for r in rows if r["kind"] == "batch"):
        sel = [r for r in rows if r["kind"] == "batch" and r["context"] == ctx]
        lines.append(f"\n== batch {sel[0]['batch_asked']}, {context_label(ctx)} ==")
        lines.append(f"{'method':20s} {'TTFT s':>8s} {'TPOT ms':>8s} {'tok/s':>9s} {'tok/s x':>7s} {'TPOT x':>7s}")
        for r in sel:
            if r["status"] != "ok":
                lines.append(f"{r['label']:20s} {r['status']}: {r.get('skipped', '')[:100]}")
                continue
            lines.append(
                f"{r['label']:20s} {r['ttft_s']:8.2f} {1e3 * r['tpot_s']:8.2f} {r['throughput_tok_s']:9.1f} "
                f"{fmt(r.get('throughput_ratio_vs_full'), '7.2f')} {fmt(r.get('tpot_speedup_vs_full'), '7.2f')}"
            )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS))
    ap.add_argument("--context", type=lambda s: parse_contexts(s)[0], default=32768, help="prompt tokens (Nk = N*1024)")
    ap.add_argument("--methods", default=",".join(methods.names()), help="registered methods (full always first)")
    ap.add_argument("--budget", type=lambda s: parse_budgets(s)[0], default=0.2, help="every method's budget")
    ap.add_argument(
        "--recall-budget", type=lambda s: parse_budgets(s)[0], default=2048, help="the recall methods' budget"
    )
    ap.add_argument("--new-tokens", type=int, default=33, help="tokens generated: 1 from prefill + the timed steps")
    ap.add_argument("--repeats", type=int, default=3, help="timed decode-loop runs after the warm-up (median)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--scan-layers", choices=("auto", "on", "off"), default="auto", help="auto: on for the 8B")
    ap.add_argument("--memory-gb", type=float, default=None, help="the memory limit (default: bytes_limit)")
    ap.add_argument("--probe-batch", type=int, default=4, help="the decode loop's second probe batch (first: 1)")
    ap.add_argument("--max-batch", type=int, default=4096)
    ap.add_argument("--max-tries", type=int, default=3, help="batches tried from the fitted one down")
    ap.add_argument("--rows", choices=("fit", "batch", "all"), default="all")
    ap.add_argument("--batch", type=int, default=8, help="the batch rows' batch")
    ap.add_argument(
        "--batch-contexts",
        type=lambda s: parse_contexts(s) if s.strip() else [],
        default=[32768, 65536],
        help="the batch rows' contexts ('' for none)",
    )
    ap.add_argument(
        "--stop-after-s",
        type=float,
        default=float("inf"),
        help="start no row after this many seconds (a phase's limit)",
    )
    ap.add_argument(
        "--compile-only",
        action="store_true",
        help="fit rows only: the byte model and the fitted batch from abstract shapes; nothing allocated or run",
    )
    ap.add_argument("--retry-interrupted", action="store_true", help="measure rows an earlier run was stopped in")
    ap.add_argument("--out", default="benchmarks/results/serving.json")
    ap.add_argument("--report", default=None, metavar="JSON", help="only print and write the table of a run's JSON")
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.report:
        data = json.loads(Path(args.report).read_text())
    else:
        if args.new_tokens < 2 or args.probe_batch < 2:
            _parser().error("--new-tokens and --probe-batch must be >= 2")
        run = Serving(args)
        args.rows = "fit" if args.compile_only else args.rows
        go = args.rows == "batch" or run.sweep("fit", args.context)
        for ctx in args.batch_contexts if args.rows != "fit" else []:
            go = go and run.sweep("batch", ctx)
        data, args.report = {**run.head, "rows": run.rows}, str(run.out)
    text = table(data)
    print(text, flush=True)
    Path(args.report).with_suffix(".txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
