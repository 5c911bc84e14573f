"""Roofline of the decode step where the KV cache dominates: step time against bytes read, every method vs full.

    python benchmarks/roofline.py --quick                       # a few minutes: 16k, batch 1, float32
    python benchmarks/roofline.py --lengths 32k --methods full,snapkv,pqcache --budgets 0.2 --token-budgets 2048
    python benchmarks/roofline.py                               # the whole grid (below): many hours on 2 CPU cores
    python benchmarks/roofline.py --report benchmarks/results/roofline_cpu.json   # redraw table, plot, projection
    python benchmarks/roofline.py --report a.json,b.json --out merged.json        # runs made in pieces, as one
    python benchmarks/roofline.py --shape gemma3 --layers 6 --first-layer 0 --lengths 32k   # Gemma-3-shaped, hybrid
    python benchmarks/roofline.py --shape gemma3-global --layers 6 --first-layer 0 --lengths 32k  # every layer global

**Setting: attention + cache only.** Llama-3.1-8B's attention shapes (32 query / 8 KV heads x 128), no weights,
no MLP, no projections. Each of ``--layers`` layers (numbered from ``--first-layer``, default 2: past ClusterKV's
and Quest's full layers, in a 32-layer model, so PyramidKV's and ChunkKV's per-layer rules see a real depth) gets a
random prompt ``q [B, 32, n, 128]``, ``k, v [B, 8, n, 128]`` that goes through the method's own ``prefill``; then
every decode step calls each layer's ``method.decode`` (the public interface, nothing method-specific here) with
fixed random ``q, k, v`` in one compiled, state-donating step. With no weights a step reads only what the method
reads, so the ratios are the methods' own, not diluted by an 8B model's 16 GB of weights (the projection adds
those back).

The grid (defaults): prompts 8k, 16k, 32k, 64k, 128k tokens x batch 1, 4 x float32, bfloat16; ``full`` and every
registered method at budgets 0.1 and 0.2, and the recall methods (``Method.recalls``: pqcache, clusterkv, quest)
also at 1024 and 2048 tokens: 27 variants per (context, batch, dtype). ``--quick`` is 16k, batch 1, float32,
budget 0.2 and 2048 tokens, 3 rounds of 4 steps (14 variants). ``--tiny`` swaps in a 4-head, 32-dim config (the
smoke test's).

How long (measured on this 2-core CPU, batch 1, float32, 1 layer): ``--quick`` 130 s; 32k with 14 variants
(budget 0.2 + 2048 tokens, 5 rounds of 8 steps) 342 s, of which 224 s are the three quadratic prefills (the causal
attention 76 s, h2o's 76 s, LESS's 72 s) and ~8 s per variant the rest (compiles, linear prefills, timed rounds).
The quadratic parts grow 4x per doubling of the context and with the batch, the rest ~2x; the default grid's 27
variants run h2o and LESS twice each. Estimated from those: float32, batch 1 ~1 h (8k 2 min, 16k 4 min, 32k 10
min, 64k 30 min, 128k 12 min with the quadratic prefills skipped), batch 4 ~1.2 h (64k without the quadratic
prefills, 128k skipped: it does not fit); bfloat16 (XLA:CPU upcasts its dots) is slower: see the 8k run. Run it in
pieces (``--lengths 8k,16k``, ...) and merge them with ``--report a.json,b.json``.

Timing: the states of a group of variants are built first; then ``--rounds`` rounds each run ``--steps`` steps of
every variant in a rotated order (compile and the first round excluded) and the step time is the median over rounds,
so a change in machine load hits every variant alike. By default (``--timing loop``) a variant's ``--steps`` steps
are one compiled program (a ``fori_loop``, as the engine's decode loop runs them), so the fixed cost of a call
(dispatch and argument handling: a large share of a compressed step on a GPU) is paid once per round; ``--timing
calls`` calls the step once per step, as runs before 2026-11-26 did (on this CPU at 16k the loop is 0.3 ms a step
faster for every variant alike: full 10.6 vs 11.7 ms, quest@0.2 4.0 vs 4.4 ms). ``full`` runs in every group, so
every ratio compares rows of the same run (one group unless memory forces more, see below). Per row (JSON keys in
brackets):

- step time [``step_s``], and the method's own bytes read per step [``bytes_read``]: the sum over layers of
  ``method.bytes_read_per_step`` (the K/V blocks, codes, centroids, scores... each method counts);
- with ``--timing calls``, XLA's ``cost_analysis()["bytes accessed"]`` of the compiled step [``xla_bytes``] beside
  it (XLA:CPU counts a dynamic-update-slice's whole operand, so it over-counts in-place writes; with ``--timing
  loop`` it is null: the cost analysis counts a loop's body once);
- achieved GB/s [``gbs``] = bytes / step time; the header has the machine's measured read bandwidth (a sum over
  512 MiB) and copy bandwidth (an in-place ``x + 1``: read + write) [``read_gbs``, ``copy_gbs``];
- **efficiency** [``efficiency``] = (step time / full's step time) / (bytes read / full's bytes read)
  [``time_ratio`` / ``bytes_ratio``]: 1.0 means the step costs exactly what it reads, 2.0 twice that; speed-up
  [``speedup``] = full's time / the method's; ``full_row`` is the index of the full row it is compared with;
- prefill, **attention-only**: [``attention_s``] the causal prefill attention (``kvjax.model.causal_attention``, the
  engine's, on the same prompt) summed over the layers, measured once per (context, batch, dtype);
  [``prefill_s``] the method's own ``prefill`` (its compression: scoring, clustering, quantising, and writing its
  cache; for ``full`` only the cache write) summed over the layers; time to first token [``ttft_s``] =
  ``attention_s + prefill_s`` (a method that declares ``attends_prompt``, H2O and LESS: its ``prefill_attend``
  computes the attention with its scores, as in the engine, so ``ttft_s = prefill_s``); [``ttft_ratio``] = TTFT /
  full's TTFT; compression's share [``compress_share``] = (TTFT - full's TTFT) / TTFT. Each is one run, compile
  excluded (ahead-of-time compiled). A real model's TTFT adds
  the projections and MLPs, which every method pays alike, so these ratios are upper bounds of the model's;
- with ``--model-ttft``, the model's: [``dense_s``] one layer's position-wise prefill work at the same prompt (the
  engine's ``layer_qkv_blocks`` and ``layer_finish_blocks``: norms, q/k/v/o projections, RoPE and the MLP in
  512-token blocks, on random weights of the 8B layer's shapes; the attention left out), measured once per
  (context, batch, dtype), and [``model_ttft_ratio``] = ``(layers x dense_s + TTFT) / (layers x dense_s + full's
  TTFT)``: the TTFT ratio of a model whose every layer is the benchmarked one (embedding and LM head left out).

**Hybrid models** (``--shape gemma3``): Gemma-3-12B's attention shapes (16 query / 8 KV heads x 256, 48 layers) with
its layer pattern, five local layers of a 1024-token window to one global; with ``--layers 6 --first-layer 0`` the
benchmarked layers are one period of it. Every variant runs as ``kvjax.methods.plans.hybrid.for_model`` plans it on that
model (a ring buffer of the window on each local layer, the method on the global one; ``full`` keeps everything on
the global layer only), so bytes read and step time count both kinds of layer, and the causal prefill attention of a
local layer is windowed; each row's ``layer_plan`` says what its layers held. ``--shape gemma3-global`` is the same
model with every layer global (what a cache without the hybrid plan holds), the comparison.

Limits (nothing is dropped silently: a skipped row has ``status: "skipped"`` and the reason in ``skipped``):

- **memory**: before anything is allocated, each variant's states (``jax.eval_shape`` of its ``init``, per layer)
  and its compiled prefill's temporaries (``memory_analysis``) are added to the prompt's q, k, v and to full's
  states; variants are packed into groups (each with its own ``full``) that fit ``--memory-gb`` (default 60% of the
  host's RAM on CPU, the host being shared; 90% of an accelerator's ``bytes_limit``), and a variant that does not
  fit even alone with full is skipped. float32 at 128k tokens, batch 4 (prompt 12 GiB, full's cache 4 GiB per layer)
  does not fit a 24 GB host.
- **prefill time**: the prefill of h2o and LESS (accumulated attention scores over every query) and the causal
  attention are quadratic in the prompt (~80 s per layer at 32k on this CPU, x4 per doubling). Before a prefill
  runs, its seconds are estimated from the largest one of the same method and dtype measured so far in this
  process, scaled as ``(n / n_ref)^2 * (batch / batch_ref) * layers`` (quadratic: an upper bound for the linear
  ones); a method with none measured yet is first timed once at ``--calibration-len`` (4096) tokens, batch 1. A
  variant whose estimate exceeds ``--max-prefill-s`` (default 600 s) is skipped; for the causal attention only the
  TTFT columns are (``ttft_skipped``), the decode step is still measured. At the defaults h2o and LESS stop after
  64k at batch 1 and after 32k at batch 4. ``--max-prefill-s inf`` sets no cap and skips the calibrations (each
  compiles a prefill: on a GPU, most of a short run).
- **failures**: a variant that raises while compiling, prefilling or decoding (a kernel this backend cannot lower,
  say) gets a ``status: "failed"`` row with its ``error``, and the others go on; if ``full`` fails, its
  configuration's variants are recorded failed with it (they have no reference).
- **resuming** (``--resume``): a run cut short (a time limit) is run again with the same command; rows of
  ``--out`` made at the same commit with the same settings are kept and their variants not measured again (``full``
  is timed again beside each new group, so every ratio is of one group). Another commit: everything again.

Output: the JSON (``--out``; jax version, device, commit, command, load average, written after every
group of variants), a printed table, and beside the JSON a ``.txt`` of it, a ``.png`` plot (speed-up vs context per
variant, solid, with its bytes-ratio ideal ``full's bytes / its bytes`` dashed in the same colour; one panel per
batch and dtype) and the projection: an 8B model's TPOT on an H100 and a TPU v5e as (weights + bytes read) /
bandwidth, with this run's efficiency applied to each method's KV bytes (``roofline_project.projection`` states what
it assumes), beside the papers' figures (``e2e.PAPERS``).

The code: this file is the command line and the run over the grid (groups, skips, failures, ``--resume``);
``roofline_measure.py`` plans, builds and times the variants, ``roofline_project.py`` computes the ratios and the
projection, ``roofline_report.py`` prints and writes the table and merges runs, ``roofline_plot.py`` draws.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import command_line, commit, device_fields, git_dirty, load_average, write_json  # noqa: E402
from bench_common import context_label, fmt, parse_budgets, parse_contexts, parse_ints  # noqa: E402
from e2e import PAPERS, variants  # noqa: E402
from kvjax.methods.plans.hybrid import describe as describe_plan, for_model  # noqa: E402
from roofline_measure import (  # noqa: E402
    SHAPES,
    PrefillClock,
    Variant,
    attention_config,
    bandwidth_gbs,
    build,
    calibrate,
    calibrate_attention,
    compile_step,
    decode_inputs,
    error_text,
    memory_limit,
    plan_groups,
    plan_variant,
    prompt_bytes,
    time_attention,
    time_dense,
    time_runs,
)
from roofline_project import MODEL_LAYERS, PROJECTION_DEVICES, WEIGHTS_8B_BF16, add_ratios  # noqa: E402
from roofline_report import merge_runs, report, table  # noqa: E402

from kvjax import methods  # noqa: E402
from kvjax.methods.base import Capacity, tree_bytes  # noqa: E402

#: ``--quick``: the settings it overrides.
QUICK = {
    "lengths": "16k",
    "batch": "1",
    "dtypes": "float32",
    "budgets": "0.2",
    "token_budgets": "2048",
    "steps": 4,
    "rounds": 3,
}


# --------------------------------------------------------------------------------------- the JSON's header, --resume


#: what ``commit_dirty`` checks: the code a row's numbers depend on
CODE = ("kvjax", "kernels_pallas", "benchmarks")


def header(args, cfg, limit) -> dict:
    return {
        "benchmark": "roofline",
        "setting": f"attention + cache only (no weights), {'tiny' if args.tiny else args.shape} attention "
        f"shapes ({cfg.num_heads}/{cfg.num_kv_heads} heads x {cfg.head_dim})",
        **device_fields(),
        "commit": commit(),
        # a copied tree ($KVJAX_COMMIT): its commit is given, whether it differs not checked
        "commit_dirty": None if os.environ.get("KVJAX_COMMIT") else git_dirty(*CODE),
        "command": command_line(),
        "layers": args.layers,
        "first_layer": args.first_layer,
        "steps": args.steps,
        "rounds": args.rounds,
        "timing": args.timing,
        "memory_limit_bytes": limit,
        "max_prefill_s": args.max_prefill_s,
        "calibration_len": args.calibration_len,
        "projection_weights_bytes": WEIGHTS_8B_BF16,
        "projection_layers": MODEL_LAYERS,
        "projection_devices_bytes_per_s": PROJECTION_DEVICES,
        "papers": PAPERS,
        "load_average_1min": load_average(),
    }


#: what a run resumed with ``--resume`` must share with the earlier one (besides its commit)
RESUMED_SETTINGS = ("setting", "device_kind", "backend", "layers", "first_layer", "steps", "rounds", "timing")


def resumable_rows(old: dict, new: dict) -> list[dict]:
    """The earlier run's rows that ``--resume`` keeps: all of them when it ran at the same commit (known, the tree
    clean) with the same settings (:data:`RESUMED_SETTINGS`), else none (printing why: everything is measured
    again)."""
    why = None
    if not new.get("commit") or old.get("commit") != new["commit"]:
        why = f"it ran at commit {old.get('commit')}, this is {new.get('commit')}"
    elif old.get("commit_dirty") or new.get("commit_dirty"):
        why = "kvjax/, kernels_pallas/ or benchmarks/ differ from the commit"
    else:
        diff = [k for k in RESUMED_SETTINGS if old.get(k) != new.get(k)]
        why = f"other settings: {', '.join(f'{k} {old.get(k)!r} -> {new.get(k)!r}' for k in diff)}" if diff else None
    if why:
        print(f"--resume: measuring everything again ({why})", flush=True)
        return []
    print(f"--resume: keeping {len(old['rows'])} rows of the earlier run", flush=True)
    return old["rows"]


# ------------------------------------------------------------------------------------------------ the options


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--lengths", default="8k,16k,32k,64k,128k", help="prompt lengths (8k = 8192 tokens)")
    p.add_argument("--batch", default="1,4", help="batch sizes, comma-separated")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    p.add_argument("--methods", default=",".join(methods.names()), help="registered methods (full always runs)")
    p.add_argument("--budgets", default="0.1,0.2", help="budgets of every method")
    p.add_argument("--token-budgets", default="1024,2048", help="also run the recall methods at these ('' none)")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--first-layer", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="decode steps per variant per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--timing",
        choices=("loop", "calls"),
        default="loop",
        help="loop: the --steps steps in one compiled program (as the engine's decode loop; a call's fixed cost "
        "paid once); calls: one call per step (records XLA's bytes accessed)",
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=0,
        help="plan, time and write at most this many variants (besides full) at a time, so a run cut short keeps "
        "what it timed (0: all at once)",
    )
    p.add_argument(
        "--memory-gb",
        type=float,
        default=None,
        help="memory for the skip/group rule (default: 90%% of an accelerator's, 60%% of the host's RAM)",
    )
    p.add_argument(
        "--max-prefill-s",
        type=float,
        default=600.0,
        help="skip a prefill whose estimated seconds (all layers) exceed this",
    )
    p.add_argument("--calibration-len", type=int, default=4096, help="prompt of the prefill-time calibration")
    p.add_argument(
        "--model-ttft",
        action="store_true",
        help="also time one layer's projections and MLP at each prompt and report the model-level TTFT ratio",
    )
    p.add_argument(
        "--quick", action="store_true", help="a few minutes: " + ", ".join(f"{k}={v}" for k, v in QUICK.items())
    )
    p.add_argument("--tiny", action="store_true", help="a 4-head, 32-dim config (smoke tests)")
    p.add_argument(
        "--shape",
        default="llama-3.1-8b",
        choices=sorted(SHAPES),
        help="attention shapes: Llama-3.1-8B's, or Gemma-3-12B's with its local/global layers (gemma3) or with "
        "every layer global (gemma3-global)",
    )
    p.add_argument("--bandwidth-mib", type=int, default=512, help="array size of the bandwidth measurement")
    p.add_argument("--out", default="benchmarks/results/roofline_cpu.json")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep --out's rows if it ran at this commit with these settings, and measure only the variants it lacks "
        "(full is timed again beside them); a run cut by a time limit, rerun",
    )
    p.add_argument(
        "--report",
        default=None,
        metavar="JSON",
        help="only redraw the table, plot and projection of an earlier run's JSON, beside it; "
        "several (a.json,b.json): merged into --out and drawn beside it",
    )
    args = p.parse_args(argv)
    if args.quick:
        given = set(a.split("=")[0].lstrip("-").replace("-", "_") for a in (argv if argv is not None else sys.argv))
        for k, v in QUICK.items():
            if k not in given:
                setattr(args, k, v)
    try:
        args.lengths = parse_contexts(args.lengths)
        args.batch = parse_ints(str(args.batch))
        args.budgets = parse_budgets(args.budgets)
        args.token_budgets = parse_budgets(args.token_budgets)
        args.dtypes = [jnp.dtype(d.strip()).name for d in args.dtypes.split(",") if d.strip()]
    except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
        p.error(str(e))
    if args.layers < 1 or args.steps < 1 or args.rounds < 1 or args.group_size < 0:
        p.error("--layers, --steps and --rounds must be >= 1, --group-size >= 0")
    return args


# ------------------------------------------------------------------ the run: each configuration, in pieces


def cap_prefill(cfg, args, vars_, clock, n, batch, dtype, layers):
    """The prefill-time cap (module docstring, "prefill time"): marks the variants whose estimated prefill exceeds
    ``--max-prefill-s`` skipped, calibrating a method's clock first where it has none; returns the reason the
    causal-attention TTFT columns are skipped (None: they are measured)."""
    dt = jnp.dtype(dtype).name
    calibrated = set()
    capped = args.max_prefill_s != float("inf")  # inf: no cap, so no calibration (a GPU run in short steps)
    for v in vars_:  # the prefill-time cap
        if v.skipped or not capped:
            continue
        est = clock.estimate(v.name, dt, n, batch, len(layers))
        if est is None and n > args.calibration_len and v.name not in calibrated:
            print(f"  calibrating {v.name}'s prefill at {args.calibration_len} tokens", flush=True)
            calibrate(cfg, clock, v, layers[0], dtype, args.calibration_len)
            calibrated.add(v.name)
            est = clock.estimate(v.name, dt, n, batch, len(layers))
        if est is not None and est > args.max_prefill_s:
            v.skipped = (
                f"prefill estimated at {est:.0f} s > --max-prefill-s {args.max_prefill_s:.0f} "
                f"(the largest measured, scaled as (n/n_ref)^2 x batch x layers)"
            )
    ttft_skip = None
    est = clock.estimate("attention", dt, n, batch, len(layers))
    if est is None and n > args.calibration_len and capped:
        calibrate_attention(cfg, clock, layers[0], dtype, args.calibration_len)
        est = clock.estimate("attention", dt, n, batch, len(layers))
    if est is not None and est > args.max_prefill_s:
        ttft_skip = (
            f"causal attention estimated at {est:.0f} s > --max-prefill-s {args.max_prefill_s:.0f} "
            f"(quadratic in the prompt)"
        )
    return ttft_skip


def run_config(cfg, args, n, batch, dt, names, layers, clock, limit, rows, write) -> None:
    """Every variant at one (context, batch, dtype), in pieces of ``--group-size`` variants (all at once by
    default): each piece planned, built, timed beside ``full`` and written before the next is compiled, so a run
    cut short (a time limit) keeps what it timed."""
    dtype = jnp.dtype(dt)
    cap = Capacity(n, args.steps * (args.rounds + 1) + 1)
    base = {"context": n, "batch": batch, "dtype": dt, "layers": len(layers)}
    vars_ = [
        Variant(label, for_model(cfg, m), b) for label, m, b in variants(names, args.budgets, args.token_budgets, (1,))
    ]
    done = {r["label"] for r in rows if r["status"] in ("ok", "failed") and all(r.get(k) == base[k] for k in base)}
    if done:  # --resume: measured (or failed) at this commit; full is timed again beside the rest
        vars_ = vars_[:1] + [v for v in vars_[1:] if v.label not in done]
        print(f"== {context_label(n)} B={batch} {dt}: {len(done)} variants measured at this commit", flush=True)
        if len(vars_) == 1:
            return
    print(f"== {context_label(n)} B={batch} {dt}: planning {len(vars_)} variants", flush=True)
    size = args.group_size or len(vars_)
    attention_s = None
    for i in range(0, max(len(vars_) - 1, 1), size):
        piece = [vars_[0]] + vars_[1 + i : 1 + i + size]
        attention_s = _run_piece(
            cfg, args, n, batch, dtype, piece, layers, clock, limit, rows, write, base, cap, attention_s
        )
        if attention_s is False:  # full cannot run: this piece's variants are recorded, and the rest
            rows.extend(_skipped_row(base, v, "full cannot run here (its row)") for v in vars_[1 + i + size :])
            break
    write()
    print(table([r for r in rows if (r["context"], r["batch"], r["dtype"]) == (n, batch, dt)]), flush=True)


def _failed_row(base, v, error) -> dict:
    return {**base, "label": v.label, "method": v.name, "budget": v.budget, "status": "failed", "error": error}


def _full_failed(rows, base, vars_, write) -> bool:
    """Every variant of ``vars_`` recorded failed because ``full`` (``vars_[0]``), their reference, failed."""
    reason = f"full failed: {vars_[0].failed}"
    rows.append(_failed_row(base, vars_[0], vars_[0].failed))
    rows.extend(_failed_row(base, v, reason) for v in vars_[1:] if not v.failed and not v.skipped)
    print(f"  {reason}", flush=True)
    write()
    return False


def _time_each_on_failure(runs, ran, dargs, n, args, rows, base) -> dict[str, float]:
    """:func:`time_runs` of ``runs`` together; where that raises, each run timed alone and those that raise again
    recorded failed (their states, donated to the failing call, cannot run again)."""
    try:
        return time_runs(runs, dargs, n, args.steps, args.rounds)
    except Exception as e:  # noqa: BLE001
        print(f"  timing together failed ({error_text(e)}); timing each alone", flush=True)
    times = {}
    for r, v in zip(runs, ran):
        try:
            times.update(time_runs([r], dargs, n, args.steps, args.rounds))
        except Exception as e:  # noqa: BLE001
            v.failed = f"decode: {error_text(e)}"
            if v is not ran[0]:
                rows.append(_failed_row(base, v, v.failed))
            print(f"  {v.label} failed: {v.failed}", flush=True)
    return times


def _skipped_row(base, v, reason) -> dict:
    return {
        **base,
        "label": v.label,
        "method": v.name,
        "budget": v.budget,
        "status": "skipped",
        "skipped": reason,
    }


def _run_piece(cfg, args, n, batch, dtype, vars_, layers, clock, limit, rows, write, base, cap, attention_s):
    """``vars_`` (``full`` first): plan, skip with reasons, group by memory, build, time; rows appended and
    written. A variant that fails (compiling, prefilling or decoding: a kernel this backend cannot run) gets a
    ``status: "failed"`` row with its error and the others go on. Returns the causal attention's seconds (timed
    once, on the first piece), or False when ``full`` cannot run."""
    dt = dtype.name
    for v in vars_:
        if not v.prefills and not v.skipped and not v.failed:  # full is planned once, on the first piece
            plan_variant(cfg, v, layers, batch, n, cap, dtype)
            if v.failed and v is vars_[0]:
                return _full_failed(rows, base, vars_, write)
            if v.failed:
                rows.append(_failed_row(base, v, v.failed))
                print(f"  {v.label} failed: {v.failed}", flush=True)
    ttft_skip = cap_prefill(cfg, args, vars_, clock, n, batch, dtype, layers)
    full, others = vars_[0], [v for v in vars_[1:] if not v.skipped and not v.failed]
    pbytes = prompt_bytes(cfg, batch, n, dtype)
    groups, too_big = plan_groups(full, others, pbytes, limit)
    for v, reason in too_big:
        v.skipped = reason
    if full.skipped or (limit and pbytes + full.state_bytes + full.prefill_temp > limit):
        reason = full.skipped or (
            f"full alone needs {(pbytes + full.state_bytes) / 2**30:.1f} GiB (prompt + "
            f"states) > --memory-gb {limit / 2**30:.1f}"
        )
        rows.extend(_skipped_row(base, v, v.skipped or f"full cannot run: {reason}") for v in vars_)
        print(f"  skipped: {reason}", flush=True)
        return False
    done = sum(r["label"] == "full" and r["status"] == "ok" and all(r[k] == base[k] for k in base) for r in rows)
    for gi, group in enumerate(groups):  # groups earlier pieces timed come first
        if attention_s is None and ttft_skip is None:
            print("  timing the causal prefill attention", flush=True)
            attention_s = time_attention(cfg, layers, batch, n, dtype)
            clock.record("attention", dt, n, batch, attention_s / len(layers))
            if args.model_ttft:
                clock.dense[(n, batch, dt)] = time_dense(cfg, batch, n, dtype)
        dargs = decode_inputs(cfg, batch, dtype)
        pos = jnp.full((batch,), n, jnp.int32)
        runs, ran = [], []
        for v in [full] + group:
            print(f"  {v.label}: prefill", flush=True)
            try:
                run = build(cfg, v, layers, batch, n, cap, dtype)
                compile_step(run, layers, dargs, pos, args.steps if args.timing == "loop" else 1)
            except Exception as e:  # noqa: BLE001  (recorded; the other variants go on)
                v.failed = f"prefill or decode compile: {error_text(e)}"
                if v is full:
                    return _full_failed(rows, base, [full] + group, write)
                rows.append(_failed_row(base, v, v.failed))
                print(f"  {v.label} failed: {v.failed}", flush=True)
                continue
            clock.record(v.name, dt, n, batch, run.prefill_s / len(layers))
            runs.append(run)
            ran.append(v)
        times = _time_each_on_failure(runs, ran, dargs, n, args, rows, base)
        if full.label not in times:
            return _full_failed(rows, base, [full] + [v for v in ran[1:] if not v.failed], write)
        block = []
        for r, v in ((r, v) for r, v in zip(runs, ran) if r.label in times):
            read = sum(r.method.at(l).bytes_read_per_step(st, cfg.num_heads) for l, st in zip(layers, r.states))
            ttft = (
                r.prefill_s
                if methods.method_of(r.method).attends_prompt  # prefill_attend: attention included
                else None
                if attention_s is None
                else attention_s + r.prefill_s
            )
            block.append(
                {
                    **base,
                    "label": r.label,
                    "method": r.name,
                    "budget": r.budget,
                    "group": done + gi,
                    "status": "ok",
                    "layer_plan": describe_plan(
                        dataclasses.replace(
                            cfg, num_layers=len(layers), sliding_windows=tuple(cfg.sliding_windows[l] for l in layers)
                        ),
                        methods.method_of(r.method),
                    ),
                    "step_s": times[r.label],
                    "bytes_read": int(read),
                    "xla_bytes": r.xla_bytes,
                    "gbs": read / times[r.label] / 1e9,
                    "prefill_s": r.prefill_s,
                    "attention_s": attention_s,
                    "ttft_s": ttft,
                    "ttft_skipped": ttft_skip,
                    "dense_s": clock.dense.get((n, batch, dt)),
                    "state_bytes": int(sum(tree_bytes(st) for st in r.states)),
                    "estimated_state_bytes": v.state_bytes,
                    "prefill_temp_bytes": v.prefill_temp,
                    "load_average_1min": load_average(),
                }
            )
        add_ratios(block, len(rows))
        rows.extend(block)
        del runs
        write()
    rows.extend(_skipped_row(base, v, v.skipped) for v in vars_[1:] if v.skipped)
    return attention_s


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        paths = [x for x in args.report.split(",") if x]
        if len(paths) == 1:
            report(json.loads(Path(paths[0]).read_text()), Path(paths[0]))
        else:  # merged: written to --out
            data = merge_runs([json.loads(Path(x).read_text()) for x in paths], paths)
            write_json(args.out, data, default=str)
            report(data, Path(args.out))
        return 0
    cfg = attention_config(args.tiny, args.shape)
    if args.first_layer + args.layers > cfg.num_layers:
        raise ValueError(
            f"--first-layer {args.first_layer} + --layers {args.layers} exceeds the model's "
            f"{cfg.num_layers} layers; lower either"
        )
    layers = list(range(args.first_layer, args.first_layer + args.layers))
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    limit = memory_limit(args.memory_gb)
    data = {**header(args, cfg, limit), **bandwidth_gbs(args.bandwidth_mib << 20), "rows": []}
    print(
        f"read {data['read_gbs']:.1f} GB/s, copy {data['copy_gbs']:.1f} GB/s; memory limit "
        f"{fmt(limit and limit / 2**30, '.1f')} GiB",
        flush=True,
    )
    out = Path(args.out)
    if args.resume and out.exists():
        data["rows"] = resumable_rows(json.loads(out.read_text()), data)

    def write():
        write_json(out, data, default=str)

    clock = PrefillClock()
    t0 = time.perf_counter()
    for n in args.lengths:
        for batch in args.batch:
            for dt in args.dtypes:
                run_config(cfg, args, n, batch, dt, names, layers, clock, limit, data["rows"], write)
                jax.clear_caches()  # XLA:CPU maps every executable's code; dozens of them exhaust the maps
    data["wall_s"] = time.perf_counter() - t0
    write()
    report(data, out)
    print(f"wrote {out} ({data['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
