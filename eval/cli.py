"""``kvjax-eval``: compare KV-cache methods on a model; write JSON, a markdown table and PNG plots.

kvjax-eval main                                   # the README's main job on the embedded SmolLM2
kvjax-eval needle --methods full,snapkv --budgets 0.1,0.2 --lengths 1024,2048 --depths 0,0.5,1
kvjax-eval perplexity --prefix 1024 --continuation 256
kvjax-eval ruler --lengths 1024
kvjax-eval niah --methods full,chelsea,chunkkv,snapkv --lengths 1024,2048   # needle heatmaps, the papers' budgets
kvjax-eval leaderboard --protocol question-in-context                      # RULER, the question compressed too
kvjax-eval longgen --methods full,snapkv,h2o --budgets 0.2 --option snapkv.decode_budget=256 --option snapkv.every=64
kvjax-eval longbench --data LongBench/data --datasets qasper,hotpotqa --samples 8
kvjax-eval fidelity --methods snapkv,chunkkv --budgets 0.2 --lengths 1024
kvjax-eval main --methods full,snapkv,less --budgets 0.2,256 --equal-bytes less   # memory-matched
kvjax-eval main --mesh data=2,model=4            # sharded over 8 devices: batch over data, heads over model
kvjax-eval needle --methods snapkv,chunkkv --option window=16 --option chunkkv.chunk_size=4   # method options
kvjax-eval plot runs/eval/results.json            # redraw the table and plots from a results file
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

from kvjax.loading import assets
from kvjax.cli import (
    HelpFormatter,
    add_plugin_option,
    budget_type,
    names_help,
    parse_qualified_option,
    parse_with_plugins,
    run_cli,
)

#: the main job: the five papers' methods first (Chelsea, ClusterKV, PQCache, ChunkKV, LESS), then the baselines
MAIN_METHODS = "full,chelsea,clusterkv,pqcache,chunkkv,less,streaming_llm,h2o,snapkv,pyramidkv,quest"

#: what the main job's tables show that a reader would otherwise report as a bug (results.md, after the header)
MAIN_NOTES = (
    "Known behaviours on this model: SnapKV and PyramidKV score ~0% on the passkey because their observation "
    "window's pooled scores keep only some digits of the 5-digit key (NVIDIA kvpress's SnapKV does the same on "
    "this model); ChunkKV keeps whole 10-token chunks and recovers the key, the failure its paper starts from. "
    "StreamingLLM keeps only sinks and the most recent tokens, so it finds the key only when it is near the end. "
    "Chelsea's 16 sinks + 64 recent tokens (its paper's setting) are more than 0.2 of a 256-512-token prompt, so at "
    "this budget it keeps little beyond them (kvjax warns); its paper runs at 16k-64k tokens. "
    "LESS runs with the kernels shipped in `kvjax/data/less-smollm2` (trained by `kvjax-train-less` with H2O at "
    "103 tokens, 0.2 of 512; used here at 0.2 of each prompt; command and validation loss in its README); the "
    "recall methods (PQCache, ClusterKV, Quest) hold every token and read a "
    "fraction of it per step, so they have no equal-bytes row."
)


#: LESS's kernels were trained with H2O at 0.2 of 512 tokens: the warning that they run at another budget only.
LESS_BUDGET_WARNING = (
    r"kernels=.* were trained for another sparse policy setting: budget: "
    r"trained \d+( tokens( of \d+-token sequences)?)?, requested \d+(\.\d+)?( \([^)]*\))?\. LESS kernels"
)


def less_defaults(model: str) -> tuple[dict, tuple[str, ...]]:
    """The kernels shipped for an embedded model (``kvjax.loading.assets.LESS_KERNELS``), trained with H2O at 0.2 of
    512 tokens: ``kvjax-eval main`` uses them at 0.2 of each prompt and says so once (its notes) instead of warning
    per prompt length that they were trained at another budget."""
    shipped = assets.LESS_KERNELS.get(model)
    return ({"kernels": str(shipped)}, (LESS_BUDGET_WARNING,)) if shipped is not None else ({}, ())


#: Per method name, ``fn(model) -> (options, warnings)``: the options a run of the method on ``model`` (a model name,
#: as ``--model`` takes it) gets where the user gives none of them, and the warning messages (regular expressions)
#: those defaults make expected, which ``kvjax-eval main`` silences. A plugin adds its own entry.
MODEL_DEFAULTS = {"less": less_defaults}


def model_defaults(name: str, model: str) -> tuple[dict, tuple[str, ...]]:
    """:data:`MODEL_DEFAULTS`'s ``(options, warnings)`` for method ``name`` on ``model``; ``({}, ())`` for a method
    without an entry."""
    fn = MODEL_DEFAULTS.get(name)
    return fn(model) if fn is not None else ({}, ())


#: needle: 2 lengths x 5 depths = 10 trials per cell, in 2 batches of 5 (one per length: a batch of 256-token prompts
#: prefills only 256 positions); perplexity: 5 sequences of 512 + 16 tokens. Both tasks have the same batch, bucket
#: (512) and decode capacity (16), so each method compiles its prefill and decode step once for the two tasks (a
#: 5-digit answer takes 6-7 tokens). The model's prefill of each batch runs once for all configurations
#: (``--share-prefill``); the job's time is each configuration's compiles, compression and decode.
MAIN_BATCH, MAIN_TRIALS, MAIN_SEQUENCES, MAIN_NEW = 5, 1, 5, 16

#: The shortest needle prompt at which ``full`` finds the passkey reliably on the embedded model (measured, 10
#: trials per length, depths 0-1: 20% at 128 tokens, 60% at 160, 40% at 192, 90% at 224 and 256, 100% at 288, 384,
#: 512, 1024 and 2048; 320 was a weak spot, 10-20% in two seeds). Shorter needle lengths warn.
NEEDLE_SIGNAL = 256
NEEDLE_LENGTHS_HELP = (
    "context lengths in tokens; on the embedded model even full finds the passkey reliably only from "
    f"{NEEDLE_SIGNAL} tokens (measured: 20-60%% of trials at 128-192, 90-100%% at 224-288 and 384-2048, 10-20%% "
    "at 320), and shorter lengths warn"
)


def needle_length_warning(model: str, lengths) -> str | None:
    """The warning for needle ``lengths`` too short for ``full`` itself to answer on the embedded model, or None
    (another model: its own threshold is unknown)."""
    short = [n for n in lengths if n < NEEDLE_SIGNAL]
    if model != assets.SMOLLM2_NAME or not short:
        return None
    return (
        f"--lengths {','.join(map(str, short))}: below {NEEDLE_SIGNAL} tokens even full finds the passkey in only "
        f"20-60% of trials on the embedded model, so the methods' scores carry little signal; use lengths >= "
        f"{NEEDLE_SIGNAL} (the main job runs 256,512)"
    )


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated numbers, e.g. 0.2,0.5")


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated integers, e.g. 512,1024")


def _methods(text: str, main: bool) -> list[str]:
    from kvjax import methods

    names = [n.strip() for n in text.split(",") if n.strip()]
    if main:  # the main job's default list includes methods only once they are registered
        names = [n for n in names if n in methods.REGISTRY]
    return names


def method_options(names, options) -> dict[str, dict]:
    """``--option [METHOD.]KEY=VALUE`` pairs as ``{method: {key: value}}`` for the methods ``names`` of a run.
    ``METHOD.KEY`` sets one method's option; a bare ``KEY`` sets it on every method of ``names`` that has it.
    A ValueError (before any model loads) for a method not in the run, an option no such method has, or
    ``budget`` (that is ``--budgets``)."""
    import dataclasses

    from kvjax import methods

    fields = {n: {f.name for f in dataclasses.fields(methods.REGISTRY[n])} for n in names}
    for n in names:  # composition options: a decode budget over a method that re-selects what it holds
        if methods.REGISTRY[n].recompressible:
            fields[n] |= {"decode_budget", "every", "threshold"}
    out: dict[str, dict] = {n: {} for n in names}
    for key, value in options:
        method, _, field = key.rpartition(".")
        shown = f"--option {key}={value!r}"
        if field == "budget":
            raise ValueError(f"{shown}: set budgets with --budgets (e.g. --budgets 0.2,256)")
        if method and method not in out:
            raise ValueError(
                f"{shown}: {method!r} is not one of --methods ({', '.join(names)}); add it or drop the option"
            )
        targets = [method] if method else [n for n in names if field in fields[n]]
        if not targets or field not in fields[targets[0]]:
            has = sorted(fields[method] - {"budget"}) if method else []
            raise ValueError(
                f"{shown}: "
                + (
                    f"method {method!r} has no option {field!r}; its options are {has}"
                    if method
                    else f"no method of --methods ({', '.join(names)}) has an option {field!r}"
                )
            )
        for n in targets:
            out[n][field] = value
    return {n: kw for n, kw in out.items() if kw}


def _tasks(args):
    from eval import runner

    tasks = []
    if args.command in ("main", "needle"):
        tasks.append(
            runner.NeedleTask(
                tuple(args.lengths), tuple(args.depths), args.batch, args.max_new_tokens, args.seed, args.trials
            )
        )
    if args.command in ("main", "perplexity"):
        tasks.append(runner.PerplexityTask(args.sequences, args.prefix, args.continuation, args.book))
    if args.command == "longgen":
        tasks.append(runner.LongGenTask(args.sequences, args.prefix, tuple(args.continuations), args.book))
    if args.command == "fidelity":
        from eval import fidelity

        tasks.append(fidelity.FidelityTask(tuple(args.lengths), args.probes))
    if args.command == "longbench":
        from eval import longbench

        tasks.append(
            longbench.LongBenchTask(
                args.data,
                tuple(longbench.check_dataset(d.strip()) for d in args.datasets.split(",") if d.strip()),
                args.samples,
                args.max_length,
                args.batch,
            )
        )
    if args.command == "ruler":
        from eval import ruler

        tasks.append(
            ruler.RulerTask(
                tuple(args.lengths),
                tuple(args.ruler_tasks.split(",")),
                args.samples,
                args.batch,
                args.max_new_tokens,
                args.seed,
                args.questions_per_context,
                args.chat,
            )
        )
    return tasks


def _check_mesh_batches(model, args) -> None:
    """Every batch a task runs (``--batch``, ``--sequences``) must split over the mesh's ``data`` axis; checked
    before anything runs, naming the option. (Fidelity probes one prompt at a time: only ``model`` splits it.)"""
    from kvjax import sharding

    for option in ("batch", "sequences"):
        n = getattr(args, option, None)
        if n is not None:
            try:
                sharding.check_mesh(model.mesh, model.config, n)
            except ValueError as e:
                raise ValueError(f"--{option} {n}: {e}") from None


def _also_equal_bytes(args, names) -> str | None:
    """The main job's second pass: ``--also-equal-bytes`` as given ('' for none), by default h2o when it runs."""
    ref = getattr(args, "also_equal_bytes", None)
    if ref is None and args.command == "main":
        return "h2o" if "h2o" in names and len(set(names) - {"full"}) > 1 else None
    return ref or None


def cmd_run(args) -> int:
    import jax

    import kvjax
    from eval import report, runner

    t0 = time.perf_counter()
    if args.command in ("main", "needle") and (warn := needle_length_warning(args.model, args.lengths)):
        print(f"kvjax-eval: warning: {warn}", file=sys.stderr, flush=True)
    names = _methods(args.methods, args.command == "main" and args.methods == MAIN_METHODS)
    from eval import harness

    grid = harness.method_grid(names, args.budgets)  # fail before loading the model
    options = method_options(list(dict.fromkeys(n for n, _ in grid)), args.option)
    for name in names:  # what a method takes by default on this model (LESS: the kernels shipped for it)
        defaults, expected = model_defaults(name, args.model)
        if defaults and not set(defaults) & set(options.get(name, {})):
            options[name] = {**options.get(name, {}), **defaults}
            for message in expected:
                warnings.filterwarnings("ignore", message=message)
    for name, b in grid:
        _check_method(name, b, options.get(name))  # bad option values fail here too
    also_equal_bytes = _also_equal_bytes(args, names)
    runner.check_equal_bytes_refs(grid, {"--equal-bytes": args.equal_bytes, "--also-equal-bytes": also_equal_bytes})
    model = kvjax.load_model(args.model, mesh=args.mesh, scan_layers=args.scan_layers)
    print(
        f"[kvjax-eval] {args.model}: {model.config.num_layers} layers, loaded in {model.load_seconds:.1f}s",
        file=sys.stderr,
    )
    if model.mesh is not None:
        _check_mesh_batches(model, args)
        print(f"[kvjax-eval] {kvjax.sharding.describe(model.mesh, model.config)}", file=sys.stderr)
    config = {k: v for k, v in vars(args).items() if k != "func"}
    if args.command == "main":
        config["notes"] = MAIN_NOTES
    results = runner.run(
        model,
        _tasks(args),
        names,
        args.budgets,
        config,
        progress=not args.no_progress,
        equal_bytes=args.equal_bytes,
        options=options,
        also_equal_bytes=also_equal_bytes,
        share_prefill=args.share_prefill,
        # one process keeps the folder's rows (several, under jax.distributed, run every cell again)
        out=args.out if jax.process_count() == 1 else None,
        restart=args.restart,
    )
    results["timings"]["wall_seconds"] = time.perf_counter() - t0
    if not kvjax.sharding.is_primary():  # several processes (jax.distributed): process 0 writes and prints
        return 0
    paths = report.write_all(results, args.out)
    print(report.markdown_table(results))
    print(f"\nwall time {results['timings']['wall_seconds']:.0f}s; wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def cmd_plot(args) -> int:
    from eval import report

    results = report.load(args.results)
    paths = report.write_all(results, args.out or Path(args.results).parent)
    print(report.markdown_table(results))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _option_argument(sp) -> None:
    """``--option [METHOD.]KEY=VALUE``, as every run subcommand takes it."""
    sp.add_argument(
        "--option",
        type=parse_qualified_option,
        action="append",
        default=[],
        metavar="[METHOD.]KEY=VALUE",
        help="a method config option, repeatable: KEY=VALUE sets it on every method of --methods that "
        "has it (--option window=16), METHOD.KEY=VALUE on one (--option snapkv.window=32)",
    )


def _common(
    sp,
    methods,
    budgets,
    out,
    *,
    lengths=None,
    batch=None,
    max_new=None,
    seed=False,
    equal_bytes=True,
    scan=False,
    lengths_help="context lengths in tokens",
):
    """The options every run shares; ``lengths``/``batch``/``max_new``/``seed``/``equal_bytes`` only where the
    subcommand's task uses them (argparse then refuses the others by name instead of ignoring them)."""
    sp.add_argument(
        "--model",
        default=assets.SMOLLM2_NAME,
        help="HF folder, hub id, .gguf or an embedded model (default; or gemma3-270m)",
    )
    sp.add_argument("--methods", default=methods, help=names_help("comma-separated methods"))
    sp.add_argument(
        "--budgets",
        type=budget_type("--budgets", many=True),
        default=budgets,
        help="comma-separated budgets: fractions of each prompt in (0, 1] (0.2) and/or token counts (256)",
    )
    _option_argument(sp)
    if equal_bytes:
        sp.add_argument(
            "--equal-bytes",
            default=None,
            metavar="REF",
            help="a method of --methods (e.g. less, snapkv): every other compressed method runs at "
            "the token budget whose cache bytes per sequence are closest to, not above, REF's "
            "at each nominal budget (chosen budgets are recorded in results.json)",
        )
    if lengths is not None:
        sp.add_argument("--lengths", type=_ints, default=lengths, help=lengths_help)
    if batch is not None:
        sp.add_argument("--batch", type=int, default=batch, help="sequences per batch (fixed shape)")
    if max_new is not None:
        sp.add_argument("--max-new-tokens", type=int, default=max_new, help="tokens generated per answer")
    if seed:
        sp.add_argument("--seed", type=int, default=0, help="seed of the generated needles / tasks")
    sp.add_argument(
        "--mesh",
        default=None,
        metavar="data=N,model=M",
        help="run sharded over a device mesh (kvjax.sharding): batch over 'data', heads over "
        "'model'; --batch / --sequences must be multiples of the 'data' size",
    )
    sp.add_argument(
        "--scan-layers",
        action=argparse.BooleanOptionalAction,
        default=scan,
        help="stack the layers and run them as one compiled loop body (faster compiles of deep models; same results)",
    )
    sp.add_argument(
        "--share-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="needle, perplexity and ruler: run the model's prefill of each batch once and let every "
        "method compress it (kvjax.engine.prefilled; same results up to float rounding; "
        "--no-share-prefill prefills per method)",
    )
    sp.add_argument(
        "--out",
        default=out,
        help="output folder (rows.jsonl, results.json, results.md, *.png); a run into a folder that holds one "
        "resumes it, computing only the cells it lacks, and may add methods, budgets and options",
    )
    sp.add_argument("--restart", action="store_true", help="start again even if --out holds a run (default: resume)")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    sp.set_defaults(func=cmd_run, equal_bytes=None)


def _needle_options(sp, depths, trials=1):
    sp.add_argument("--depths", type=_floats, default=depths, help="needle depths in [0, 1]")
    sp.add_argument("--trials", type=int, default=trials, help="passkeys per (length, depth) cell")


def _perplexity_options(sp, sequences, prefix, continuation):
    sp.add_argument("--sequences", type=int, default=sequences, help="held-out sequences scored")
    sp.add_argument("--prefix", type=int, default=prefix, help="prefilled (compressed) tokens per sequence")
    sp.add_argument("--continuation", type=int, default=continuation, help="teacher-forced scored tokens")
    sp.add_argument(
        "--book", default="John", help="King James book used as held-out text, or 'essays' (the Paul Graham essays)"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvjax-eval",
        description=__doc__.split("\n\n")[0].replace("``", ""),
        formatter_class=HelpFormatter,
        epilog="examples:\n" + __doc__.split("\n\n", 1)[1],
    )
    add_plugin_option(p)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, help):  # every subcommand: defaults and --plugin in its --help, its help line as its description
        sp = sub.add_parser(
            name, help=help, description=help[0].upper() + help[1:] + ".", formatter_class=HelpFormatter
        )
        add_plugin_option(sp)
        return sp

    _add_main(add)
    _add_tasks(add)
    _add_leaderboard(add)
    _add_niah(add)
    pl = add("plot", help="redraw the markdown table and plots from a results.json")
    pl.add_argument("results", help="a results.json written by kvjax-eval")
    pl.add_argument("--out", default=None, help="output folder (default: beside the JSON)")
    pl.set_defaults(func=cmd_plot)
    return p


def _add_main(add) -> None:
    """``kvjax-eval main``: the main job's subcommand (``add(name, help)`` makes a subparser)."""
    m = add(
        "main",
        help="the main job: every method at budget 0.2 and at H2O's bytes, on needle and perplexity (embedded model)",
    )
    _common(
        m,
        MAIN_METHODS,
        [0.2],
        "runs/eval-main",
        lengths=[256, 512],
        lengths_help=NEEDLE_LENGTHS_HELP,
        batch=MAIN_BATCH,
        max_new=MAIN_NEW,
        seed=True,
        scan=True,
    )
    _needle_options(m, [0.0, 0.25, 0.5, 0.75, 1.0], trials=MAIN_TRIALS)
    _perplexity_options(m, MAIN_SEQUENCES, 512, MAIN_NEW)
    m.add_argument(
        "--also-equal-bytes",
        default=None,
        metavar="REF",
        help="after the nominal runs, run every other compressed method again at the token budget whose "
        "bytes match REF's (default: h2o when it runs; '' for none)",
    )


def _add_tasks(add) -> None:
    """The task subcommands: needle, perplexity, ruler, fidelity, longbench."""
    n = add("needle", help="needle-in-a-haystack / passkey over the Paul Graham essays")
    _common(
        n,
        "full,streaming_llm,h2o,snapkv,pyramidkv",
        [0.1, 0.2, 0.5],
        "runs/eval-needle",
        lengths=[1024, 2048],
        lengths_help=NEEDLE_LENGTHS_HELP,
        batch=4,
        max_new=8,
        seed=True,
    )
    _needle_options(n, [0.0, 0.25, 0.5, 0.75, 1.0])

    pp = add("perplexity", help="streaming perplexity of held-out text under a compressed cache")
    _common(pp, "full,streaming_llm,h2o,snapkv,pyramidkv", [0.1, 0.2, 0.5], "runs/eval-perplexity")
    _perplexity_options(pp, 4, 1024, 256)

    lg = add(
        "longgen",
        help="long generation: perplexity of a long teacher-forced continuation, bytes held along it "
        "(a decode budget: --option decode_budget=D --option every=E)",
    )
    _common(lg, "full,h2o,snapkv", [0.2], "runs/eval-longgen")
    lg.add_argument("--sequences", type=int, default=2, help="held-out sequences scored")
    lg.add_argument("--prefix", type=int, default=512, help="prefilled (compressed) tokens per sequence")
    lg.add_argument(
        "--continuations",
        type=lambda s: [int(x) for x in s.split(",") if x.strip()],
        default=[512, 2048],
        help="continuation lengths at which bytes held are read (ascending; the last is scored whole)",
    )
    lg.add_argument("--book", default="Genesis", help="King James book used as held-out text")

    r = add("ruler", help="RULER-style synthetic tasks (context compressed, question not)")
    _common(
        r,
        "full,streaming_llm,h2o,snapkv,pyramidkv",
        [0.2, 0.5],
        "runs/eval-ruler",
        lengths=[1024],
        batch=4,
        max_new=32,
        seed=True,
    )
    r.add_argument(
        "--ruler-tasks",
        default="multikey,variable_tracking,common_words",
        help="comma-separated tasks of single_needle, multikey, multivalue, variable_tracking, common_words",
    )
    r.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap context and question in the model's chat template (--no-chat: plain text, for a base model)",
    )
    r.add_argument("--samples", type=int, default=4, help="examples per (task, length)")
    r.add_argument(
        "--questions-per-context",
        type=int,
        default=1,
        help="multikey only: ask this many questions (distinct needles) per context; the context is compressed "
        "once and its questions answered in one batch (kvjax.engine.questions)",
    )

    f = add(
        "fidelity",
        help="per-layer attention error, top-k recall (kept after prefill), "
        "top-B recall (recall methods) and layer Jaccard vs full",
    )
    _common(
        f,
        "streaming_llm,h2o,snapkv,pyramidkv,chunkkv",
        [0.1, 0.2],
        "runs/eval-fidelity",
        lengths=[1024],
        equal_bytes=False,
    )
    f.add_argument("--probes", type=int, default=8, help="decode tokens whose attention is compared")

    lb = add("longbench", help="LongBench (official jsonl, prompts, truncation and metrics)")
    _common(lb, "full,snapkv", [0.2], "runs/eval-longbench", batch=1, equal_bytes=False)
    lb.add_argument("--data", required=True, help="folder of LongBench jsonl files, or the hub id THUDM/LongBench")
    lb.add_argument("--datasets", default="qasper,hotpotqa,triviaqa", help="comma-separated LongBench datasets")
    lb.add_argument("--samples", type=int, default=8, help="examples per dataset")
    lb.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="prompt tokens before middle truncation (default: context - longest generation)",
    )


#: the leaderboard's default model: a base model that reads 4k tokens, installed by ``kvjax install-assets``
LEADERBOARD_MODEL = "gemma3-270m"


def _add_leaderboard(add) -> None:
    """``kvjax-eval leaderboard``: kvpress's RULER leaderboard protocol (:mod:`eval.leaderboard`)."""
    from eval import leaderboard

    b = add(
        "leaderboard",
        help="RULER at 4k tokens at kvpress's compression ratios, every method, one prefill per context, resumable",
    )
    b.add_argument(
        "--model",
        default=LEADERBOARD_MODEL,
        help="a base model (plain-text prompts); default the embedded Gemma 3 270M",
    )
    b.add_argument("--methods", default=MAIN_METHODS, help=names_help("comma-separated methods"))
    b.add_argument(
        "--ratios",
        type=_floats,
        default=list(leaderboard.RATIOS),
        help="compression ratios: the fraction of each context removed (a method keeps 1 - ratio)",
    )
    b.add_argument("--tasks", default=",".join(leaderboard.TASKS), help="comma-separated RULER tasks")
    b.add_argument("--length", type=int, default=4096, help="context length in tokens (a power of two: the bucket)")
    b.add_argument("--contexts", type=int, default=10, help="contexts per task (each cell: tasks x contexts)")
    b.add_argument(
        "--batch",
        type=int,
        default=10,
        help="contexts per batch (fixed shape; 10: the whole run in about 1 h 51 min on 2 CPU cores, 5: 2 h 41 min)",
    )
    b.add_argument("--max-new-tokens", type=int, default=40, help="tokens generated per answer")
    b.add_argument("--seed", type=int, default=0, help="seed of the generated contexts")
    b.add_argument(
        "--protocol",
        default=leaderboard.AFTER,
        help=f"comma-separated: {leaderboard.AFTER} (kvpress's: the question fed after the compressed context) or "
        f"{leaderboard.IN_CONTEXT} (the papers': compressed with it); a run into a folder that holds the other adds "
        "its rows, and the tables show both",
    )
    _option_argument(b)
    b.add_argument(
        "--scan-layers",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="stack the layers and run each run of agreeing layers as one compiled loop body (faster compiles of "
        "the 41 configurations, same results; models whose layers all agree, not Gemma 3's local/global ones)",
    )
    b.add_argument("--out", default="runs/leaderboard", help="output folder (rows.jsonl, leaderboard.json/.md/.png)")
    b.add_argument("--restart", action="store_true", help="start again even if --out holds a run (default: resume)")
    b.add_argument(
        "--report",
        action="store_true",
        help="write leaderboard.json/.md/.png from what --out holds (a stopped run), running nothing",
    )
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument(
        "--compile-cache",
        default=str(assets.cache_dir() / "jax-compile"),
        metavar="DIR",
        help="JAX's persistent compilation cache, so a resumed run loads the programs it compiled before instead of "
        "compiling them again ('off': none; $JAX_COMPILATION_CACHE_DIR, when set, is used instead)",
    )
    b.set_defaults(func=cmd_leaderboard)


def persistent_compile_cache(where: str) -> str | None:
    """Turn on JAX's persistent compilation cache in ``where`` (created; at most 4 GiB, least recently used out)
    unless ``where`` is ``"off"`` or ``$JAX_COMPILATION_CACHE_DIR`` is set (JAX then uses that). Returns the folder in
    use, or None."""
    import os

    import jax

    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or where == "off":
        return os.environ.get("JAX_COMPILATION_CACHE_DIR")
    path = Path(where).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_compilation_cache_max_size", 4 << 30)
    return str(path)


def cmd_leaderboard(args) -> int:
    import kvjax
    from eval import leaderboard

    t0 = time.perf_counter()
    if args.report:
        results = leaderboard.report_only(args.out)
        print(leaderboard.markdown(results))
        return 0
    from eval import harness

    names = harness.check_methods(_methods(args.methods, args.methods == MAIN_METHODS))
    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    options = method_options(names, args.option)
    kernels = assets.LESS_KERNELS.get(args.model)
    board = leaderboard.Board(
        model=args.model,
        methods=tuple(names),
        ratios=tuple(args.ratios),
        tasks=tasks,
        length=args.length,
        contexts=args.contexts,
        batch=args.batch,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        options=tuple((m, tuple(sorted(kv.items()))) for m, kv in sorted(options.items())),
        protocols=tuple(p.strip() for p in args.protocol.split(",") if p.strip()),
    )
    for name, budget, _, _ in board.configs():
        _check_method(name, budget, options.get(name))  # bad methods and options fail before the model loads
    cache = persistent_compile_cache(args.compile_cache)
    model = kvjax.load_model(args.model, scan_layers=args.scan_layers)
    print(
        f"[kvjax-eval] {args.model}: {model.config.num_layers} layers, loaded in {model.load_seconds:.1f}s; "
        f"compiled programs cached in {cache or 'none (--compile-cache off)'}",
        file=sys.stderr,
    )
    results = leaderboard.run(
        model, board, args.out, progress=not args.no_progress, restart=args.restart, kernels=kernels
    )
    print(leaderboard.markdown(results))
    print(f"wall time {time.perf_counter() - t0:.0f}s; wrote {args.out}/leaderboard.json, .md, .png")
    return 0


#: ``kvjax-eval niah``'s methods: the five papers' and the baselines they compare with on the needle test
NIAH_METHODS = "full,chelsea,clusterkv,pqcache,chunkkv,streaming_llm,h2o,snapkv,pyramidkv,quest"


def _budget_pair(text: str) -> tuple[str, list]:
    """``METHOD=B1,B2`` (``--budget``): the method and its budgets (floats are fractions, ints token counts)."""
    name, eq, rest = text.partition("=")
    if not eq or not name.strip() or not rest.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} must be METHOD=BUDGET[,BUDGET...], e.g. snapkv=128,256 or chelsea=0.25"
        )
    try:
        return name.strip(), [budget_type("--budget")(b.strip()) for b in rest.split(",") if b.strip()]
    except (ValueError, argparse.ArgumentTypeError) as e:
        raise argparse.ArgumentTypeError(f"--budget {text}: {e}") from None


def _add_niah(add) -> None:
    """``kvjax-eval niah``: needle in a haystack as the papers run it (:mod:`eval.niah`)."""
    from eval import niah

    n = add(
        "niah",
        help="needle in a haystack as the papers run it: the question compressed with the essays, a length x depth "
        "heatmap per method at its paper's budgets; resumable, and a later run may add methods, budgets, lengths",
    )
    n.add_argument("--model", default=LEADERBOARD_MODEL, help="default the embedded Gemma 3 270M (a base model)")
    n.add_argument("--methods", default=NIAH_METHODS, help=names_help("comma-separated methods"))
    n.add_argument(
        "--budget",
        type=_budget_pair,
        action="append",
        default=[],
        metavar="METHOD=B[,B...]",
        help="a method's budgets instead of its paper's (repeatable; "
        + ", ".join(
            f"{m}: {','.join(format(b, 'g') for b in bs)}" for m, bs in niah.PAPER_BUDGETS.items() if m != "full"
        )
        + ")",
    )
    n.add_argument("--lengths", type=_ints, default=list(niah.LENGTHS), help="context lengths in tokens")
    n.add_argument("--depths", type=_floats, default=list(niah.DEPTHS), help="needle depths, fractions of the haystack")
    n.add_argument("--needles", type=int, default=2, help=f"needle sentences per cell (1..{len(niah.NEEDLES)})")
    n.add_argument("--batch", type=int, default=4, help="prompts per batch (one model prefill serves every method)")
    n.add_argument("--max-new-tokens", type=int, default=24, help="tokens generated per answer")
    n.add_argument("--chat", action="store_true", help="the chat template (a chat model); default plain text")
    _option_argument(n)
    n.add_argument("--out", default="runs/niah", help="output folder (rows.jsonl, niah.json/.md/.png, heatmaps/)")
    n.add_argument("--restart", action="store_true", help="start again even if --out holds a run (default: resume)")
    n.add_argument("--report", action="store_true", help="write the outputs from what --out holds, running nothing")
    n.add_argument("--no-progress", action="store_true", help="no progress bar")
    n.add_argument(
        "--compile-cache",
        default=str(assets.cache_dir() / "jax-compile"),
        metavar="DIR",
        help="JAX's persistent compilation cache ('off': none)",
    )
    n.set_defaults(func=cmd_niah)


def cmd_niah(args) -> int:
    import kvjax
    from eval import harness, niah

    t0 = time.perf_counter()
    if args.report:
        print(niah.markdown(niah.report_only(args.out)))
        return 0
    names = harness.check_methods(args.methods.split(","))
    budgets = dict(args.budget)
    for m in budgets:
        if m not in names:
            raise ValueError(f"--budget {m}=...: {m} is not one of --methods ({', '.join(names)}); add it")
    configs = niah.paper_configs(names, budgets)
    options = {m: dict(o) for m, o in niah.PAPER_OPTIONS.items() if m in names}
    for m, kv in method_options(names, args.option).items():
        options[m] = {**options.get(m, {}), **kv}
    grid = niah.Grid(
        model=args.model,
        configs=configs,
        lengths=tuple(args.lengths),
        depths=tuple(args.depths),
        needles=args.needles,
        batch=args.batch,
        max_new_tokens=args.max_new_tokens,
        chat=args.chat,
        options=tuple((m, tuple(sorted(kv.items()))) for m, kv in sorted(options.items())),
    )
    for name, budget in configs:
        _check_method(name, budget, options.get(name))  # bad methods and options fail before the model loads
    cache = persistent_compile_cache(args.compile_cache)
    model = kvjax.load_model(args.model)
    print(
        f"[kvjax-eval] {args.model}: {model.config.num_layers} layers, loaded in {model.load_seconds:.1f}s; "
        f"compiled programs cached in {cache or 'none (--compile-cache off)'}",
        file=sys.stderr,
    )
    kernels = assets.LESS_KERNELS.get(args.model)
    results = niah.run(model, grid, args.out, progress=not args.no_progress, restart=args.restart, kernels=kernels)
    print(niah.markdown(results))
    print(f"wall time {time.perf_counter() - t0:.0f}s; wrote {args.out}/niah.json, .md, .png and heatmaps/")
    return 0


def _check_method(name, budget, options):
    """``harness.make_method``, its ValueError naming ``--option`` when options were given."""
    from eval import harness

    try:
        return harness.make_method(name, budget, options)
    except ValueError as e:
        raise ValueError(f"--option {name}: {e}" if options else str(e)) from None


def main(argv=None) -> int:
    args, code = parse_with_plugins("kvjax-eval", build_parser, argv)
    return code if args is None else run_cli("kvjax-eval", args.func, args)


if __name__ == "__main__":
    sys.exit(main())
