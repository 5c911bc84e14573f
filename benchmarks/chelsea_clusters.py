"""How large Chelsea's clusters grow: the token counts of its merged slots after prefill, per budget and layer.

Chelsea merges a prompt by rounds of chunked soft matching (Hu et al., 2025, Alg. 1; a slot's key and value are the
count-weighted means of its tokens, Eq. 2 weights it by ``log N``). The perplexity task's windows
(``eval.perplexity.build``) are prefilled once and compressed at each ``--budgets``; for every compressed layer the
slots' counts ``n`` (``ChelseaState.n``) give the live slots, the largest and the median count, and the share of the
prompt's tokens that sit in slots of at least 16 and 64 tokens, and in the largest slot, averaged over windows and
KV heads::

    python benchmarks/chelsea_clusters.py --model gemma3-270m --budgets 0.1,0.4,0.5,0.65,0.9 \\
        --sequences 4 --prefix 4096 --book essays --out benchmarks/results/chelsea_clusters_gemma3-270m-4k.json

Writes the JSON and a markdown table beside it."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_common as bc  # noqa: E402


def slot_stats(n: np.ndarray) -> dict:
    """Statistics of one head's slot counts ``n [S]`` (0 = an empty slot): live slots, the largest and median count,
    the share of its tokens in slots of >= 16 and >= 64 tokens and in the largest slot."""
    live = n[n > 0]
    total = live.sum()
    return {
        "slots": int(live.size),
        "largest": int(live.max()),
        "median": float(np.median(live)),
        "share_in_16": float(live[live >= 16].sum() / total),
        "share_in_64": float(live[live >= 64].sum() / total),
        "share_in_largest": float(live.max() / total),
    }


def markdown(data: dict) -> str:
    lines = [
        "| budget | layer | live slots | largest slot (tokens) | median | share in slots >= 16 | >= 64 "
        "| in the largest |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['budget']} | {r['layer']} | {r['slots']:.0f} | {r['largest']:.0f} | {r['median']:.1f} | "
            f"{r['share_in_16']:.2f} | {r['share_in_64']:.2f} | {r['share_in_largest']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", type=bc.parse_budgets, default=[0.1, 0.5], help="Chelsea's budgets, comma-separated")
    bc.add_window_args(p, sequences=4, continuation=None)
    args = p.parse_args(argv)

    import kvjax
    from eval import harness, perplexity
    from kvjax import engine
    from kvjax.engine import prefilled as P
    from kvjax.methods.base import Capacity

    t0 = time.perf_counter()
    model = kvjax.load_model(args.model)
    cfg = model.config
    seqs = perplexity.build(model, args.sequences, args.prefix, 2, args.book)[:, : args.prefix]
    lengths = np.full((len(seqs),), args.prefix, np.int32)
    pre = P.prefill_once(model, seqs, lengths)
    compressed = list(cfg.global_layers)
    rows = []
    for budget in args.budgets:
        method = engine.as_run(cfg, harness.make_method("chelsea", budget))
        states = engine.init_states(cfg, method, len(seqs), Capacity(args.prefix, 1), model.dtype)
        states, _ = engine.compress_prefilled(cfg, method, pre, states, seqs, lengths)
        held = engine.layer_states(states)
        for layer in compressed:
            n = np.asarray(held[layer].n)  # [B, Hc, S]
            stats = [slot_stats(n[b, h]) for b in range(n.shape[0]) for h in range(n.shape[1])]
            rows.append({"budget": budget, "layer": layer, **bc.mean_stats(stats)})
        print(f"[chelsea_clusters] budget {budget}: {time.perf_counter() - t0:.0f} s", flush=True)
    data = {
        **bc.window_fields(args),
        "chelsea": bc.CHELSEA_DEFAULTS,
        "rows": rows,
    }
    bc.write_measured(args.out, data, markdown, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
