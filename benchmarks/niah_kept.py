"""Is a needle that a method misses evicted, or kept and still missed? The prompts of a ``kvjax-eval niah`` run
(its ``rows.jsonl``), prefilled once per batch and compressed by each configuration, with the fraction of the
needle answer's tokens that every compressed layer keeps (``kvjax.analysis``), joined with the answer's score in
that run.

Where a method scores 0 with the whole answer kept in every layer, the model fails on the kept context (the model,
not the selection); where it scores 0 with the answer evicted, the selection lost it. For the papers' budgets of
ChunkKV Table 10 (96-512 tokens)::

    python benchmarks/niah_kept.py --rows benchmarks/results/niah-gemma3-270m/rows.jsonl \\
        --configs chunkkv@96,chunkkv@128,chunkkv@512,snapkv@96,snapkv@128,snapkv@512 --lengths 1024,2048,4096 \\
        --out benchmarks/results/niah_kept_gemma3-270m.json

Writes the JSON (per prompt and configuration: the kept fraction per compressed layer and the score; per
configuration: the mean score where the answer is kept whole in every layer and where it is not, with n) and a
markdown table beside it."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_common as bc  # noqa: E402


def answer_span(prompt: list[int], answer_ids: list[int]) -> list[int]:
    """Positions of the needle answer's tokens in ``prompt``: the last occurrence of the longest run of
    ``answer_ids`` (without its first token, which may merge with the word before it) found in it."""
    for cut in range(1, len(answer_ids)):
        part = answer_ids[cut:]
        for start in range(len(prompt) - len(part), -1, -1):
            if prompt[start : start + len(part)] == part:
                return list(range(start, start + len(part)))
    raise ValueError("the needle's answer is not in the prompt")


def kept_fraction(mask: np.ndarray, span: list[int]) -> np.ndarray:
    """``[L]``: per layer, the fraction of ``span``'s positions kept by every KV head (``mask [L, Hkv, T]``)."""
    return mask[:, :, span].all(axis=1).mean(axis=-1)


def summary(rows: list[dict]) -> list[dict]:
    """Per configuration: n, the mean score, and the mean score where the answer is kept whole in every
    compressed layer (``kept``) and where it is not (``lost``), with their n."""
    out = []
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config]
        whole = [r for r in mine if min(r["kept"]) == 1.0]
        part = [r for r in mine if min(r["kept"]) < 1.0]
        mean = lambda rs: round(float(np.mean([r["score"] for r in rs])), 3) if rs else None  # noqa: E731
        out.append(
            {
                "config": config,
                "n": len(mine),
                "score": mean(mine),
                "answer_kept_whole": len(whole),
                "score_when_kept": mean(whole),
                "score_when_lost": mean(part),
                "mean_kept_fraction": round(float(np.mean([np.mean(r["kept"]) for r in mine])), 3),
            }
        )
    return out


def markdown(data: dict) -> str:
    rows = [
        "| config | n | score | answer kept whole in every layer | score when kept | score when not "
        "| mean fraction kept |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for s in data["summary"]:
        f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        rows.append(
            f"| {s['config']} | {s['n']} | {f(s['score'])} | {s['answer_kept_whole']} | {f(s['score_when_kept'])} | "
            f"{f(s['score_when_lost'])} | {f(s['mean_kept_fraction'])} |"
        )
    return "\n".join(rows) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", required=True, help="rows.jsonl of a kvjax-eval niah run")
    p.add_argument("--configs", required=True, help="comma-separated method@budget keys of that run")
    p.add_argument("--lengths", default="1024,2048,4096", help="the run's lengths to read (comma-separated)")
    p.add_argument("--model", default=None, help="the run's model (default: the one its settings name)")
    p.add_argument("--out", required=True, help="JSON to write (and .md beside it)")
    args = p.parse_args(argv)

    import kvjax
    from eval import harness, niah, rowstore
    from kvjax import analysis, engine
    from kvjax.engine import prefilled as P
    from kvjax.methods.base import Capacity

    lines = rowstore.read_jsonl(Path(args.rows))
    settings, rows_run = lines[0]["settings"], [r for rec in lines[1:] for r in rec["rows"]]
    scores = {(r["config"], r["length"], r["depth"], r["needle"]): r["score"] for r in rows_run}
    config_of = {r["config"]: (r["method"], r["budget"]) for r in rows_run}
    configs = args.configs.split(",")
    missing = [c for c in configs if c not in config_of]
    if missing:
        raise SystemExit(f"--configs: {missing} have no rows in the run ({sorted(config_of)})")
    lengths = [int(x) for x in args.lengths.split(",")]
    model = kvjax.load_model(args.model or settings["model"])
    cfg, options = model.config, settings.get("options", {})
    made = {}
    for c in configs:
        name, budget = config_of[c]
        made[c] = engine.as_run(cfg, harness.make_method(name, budget, options.get(name)))
    compressed = list(cfg.global_layers)
    rows, t0 = [], time.perf_counter()
    for n in lengths:
        examples = [
            niah.build_example(model, n, d, k, settings["chat"])
            for d in settings["depths"]
            for k in settings["needles"]
        ]
        bucket = engine.bucket_length(n)
        for i in range(0, len(examples), settings["batch"]):
            batch = examples[i : i + settings["batch"]]
            padded, _ = harness.pad_batch(list(batch), settings["batch"])  # one shape: compiled once
            tokens, lengths_b = engine.pad_prompts([list(e.prompt) for e in padded], bucket)
            pre = P.prefill_once(model, tokens, lengths_b)
            for c, method in made.items():
                cap = Capacity(bucket, settings["max_new_tokens"])
                states = engine.init_states(cfg, method, len(padded), cap, model.dtype)
                states, _ = engine.compress_prefilled(cfg, method, pre, states, tokens, np.asarray(lengths_b))
                held = engine.layer_states(states)
                mask = analysis.mask_from_states([held[l] for l in compressed], lengths_b, bucket).mask
                for j, e in enumerate(batch):
                    needle = niah.NEEDLES[e.needle]
                    span = answer_span(list(e.prompt), model.tokenizer.encode(" " + needle.answer))
                    kept = kept_fraction(mask[:, j], span)
                    rows.append(
                        {
                            "config": c,
                            "length": e.length,
                            "depth": e.depth,
                            "needle": e.needle,
                            "answer_tokens": len(span),
                            "kept": [round(float(x), 3) for x in kept],
                            "score": scores[(c, e.length, e.depth, e.needle)],
                        }
                    )
            print(
                f"[niah_kept] {n} tokens, batch {i // settings['batch'] + 1}: {time.perf_counter() - t0:.0f} s",
                flush=True,
            )
    data = {
        "rows_file": args.rows,
        "model": settings["model"],
        "compressed_layers": compressed,
        "lengths": lengths,
        "summary": summary(rows),
        "rows": rows,
    }
    bc.write_measured(args.out, data, markdown, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
