"""Where a method's perplexity gap comes from: the tokens that only the far context predicts, or the rest.

The perplexity task's windows (``eval.perplexity.build``) are prefilled once and compressed by each configuration
(``method@budget``); every continuation token's NLL is compared with full's on the same window. A token is a **far
copy** when the ``--ngram`` tokens ending in it occur earlier in the window only beyond the model's local window
(more than ``W`` tokens back, ``W`` its sliding window, 0 on a model without one), so that only the compressed global
layers can copy it; **near copy** when they occur within the last ``W`` tokens; **new** otherwise. Per configuration
and class: n, full's mean NLL and the mean ΔNLL against full with its 95% interval over tokens, and the share of the
configuration's whole excess NLL that the class carries::

    python benchmarks/perplexity_tokens.py --model gemma3-270m --configs chelsea@0.1,snapkv@0.1 \\
        --sequences 4 --prefix 4096 --continuation 64 --book essays \\
        --out benchmarks/results/perplexity_tokens_gemma3-270m-4k.json

Writes the JSON (per configuration and class, and every token's ΔNLL and class) and a markdown table beside it."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_common as bc  # noqa: E402

CLASSES = ("far copy", "near copy", "new")


def token_classes(seq: np.ndarray, prefix: int, ngram: int, window: int) -> list[str]:
    """The class of each continuation token ``seq[prefix:]`` (module docstring): where the ``ngram`` tokens ending
    in it last occurred earlier in ``seq``, relative to its own position and the local ``window``."""
    out = []
    for t in range(prefix, len(seq)):
        gram = tuple(seq[t - ngram + 1 : t + 1])
        ends = [e for e in range(ngram - 1, t) if tuple(seq[e - ngram + 1 : e + 1]) == gram]
        if not ends:
            out.append("new")
        elif window and max(ends) >= t - window:
            out.append("near copy")
        else:
            out.append("far copy")
    return out


def summarise(delta: np.ndarray, full_nll: np.ndarray, classes: list[str]) -> list[dict]:
    """Per class: n, full's mean NLL, the mean ΔNLL with its Student-t 95% interval over tokens, and the class's
    share of the summed ΔNLL (``delta``, ``full_nll``: flat over tokens; ``classes`` beside them)."""
    from eval.report import t_interval

    total = float(delta.sum())
    rows = []
    for c in CLASSES:
        sel = np.asarray([k == c for k in classes])
        d = delta[sel]
        n = int(sel.sum())
        rows.append(
            {
                "class": c,
                "n": n,
                "full_nll": round(float(full_nll[sel].mean()), 3) if n else None,
                "delta_nll": round(float(d.mean()), 3) if n else None,
                "ci": [round(x, 3) for x in t_interval([float(x) for x in d])] if n > 1 else None,
                "share_of_excess": round(float(d.sum()) / total, 3) if total else None,
            }
        )
    return rows


def markdown(data: dict) -> str:
    lines = [
        "| config | class | n | full's NLL | ΔNLL vs full [95% CI] | share of the excess |",
        "|---|---|--:|--:|--:|--:|",
    ]
    for config, rows in data["summary"].items():
        for r in rows:
            ci = f" [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]" if r["ci"] else ""
            d = "-" if r["delta_nll"] is None else f"{r['delta_nll']:.3f}{ci}"
            share = "-" if r["share_of_excess"] is None else f"{r['share_of_excess']:.2f}"
            full = "-" if r["full_nll"] is None else f"{r['full_nll']:.2f}"
            lines.append(f"| {config} | {r['class']} | {r['n']} | {full} | {d} | {share} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", required=True, help="comma-separated method@budget (e.g. chelsea@0.1,snapkv@1024)")
    p.add_argument("--ngram", type=int, default=3, help="tokens ending in a token that make it a copy")
    bc.add_window_args(p, sequences=4)  # the continuation's tokens are scored
    args = p.parse_args(argv)
    if args.ngram < 1:
        raise SystemExit(f"--ngram={args.ngram} must be >= 1")

    import kvjax
    from eval import harness, perplexity
    from kvjax.engine import prefilled as P

    t0 = time.perf_counter()
    model = kvjax.load_model(args.model)
    cfg = model.config
    configs = args.configs.split(",")
    made = {}
    for c in configs:
        name, _, budget = c.partition("@")
        if not budget:
            raise SystemExit(f"--configs: {c!r} is not method@budget (e.g. snapkv@0.1)")
        made[c] = harness.make_method(name, bc.parse_budget(budget), None)
    seqs = perplexity.build(model, args.sequences, args.prefix, args.continuation, args.book)
    window = max((w for w in cfg.sliding_windows if w is not None), default=0)
    classes = [c for s in seqs for c in token_classes(s, args.prefix, args.ngram, window)]
    lengths = np.full((len(seqs),), args.prefix, np.int32)
    pre = P.prefill_once(model, seqs[:, : args.prefix], lengths)
    full_nll = perplexity.streaming_nll(model, kvjax.methods.get("full"), seqs, args.prefix, prefilled=pre).ravel()
    print(f"[perplexity_tokens] full: {time.perf_counter() - t0:.0f} s", flush=True)
    summary, tokens = {}, {}
    for c, method in made.items():
        nll = perplexity.streaming_nll(model, method, seqs, args.prefix, prefilled=pre).ravel()
        delta = nll - full_nll
        summary[c] = summarise(delta, full_nll, classes)
        tokens[c] = [round(float(x), 4) for x in delta]
        print(f"[perplexity_tokens] {c}: {time.perf_counter() - t0:.0f} s", flush=True)
    data = {
        **bc.window_fields(args),
        "ngram": args.ngram,
        "local_window": window,
        "summary": summary,
        "classes": classes,
        "full_nll": [round(float(x), 4) for x in full_nll],
        "delta_nll": tokens,
    }
    bc.write_measured(args.out, data, markdown, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
