"""Chelsea vs StreamingLLM and SnapKV (and full) on the embedded SmolLM2-135M: attention-output error, needle
accuracy and decode step time.

    python benchmarks/chelsea.py --lengths 2048 --budget 0.2 --out benchmarks/results/chelsea_cpu.json

- Attention-output relative error: the full model runs teacher-forced over an essay prompt of ``n`` tokens
  plus ``--probes`` continuation tokens; in every layer each method compresses the prompt's K/V (its own
  ``prefill``) and then decodes the probe tokens (its own ``decode``, the exact q/k/v of the full model), and
  ``||o_method - o_full|| / ||o_full||`` is averaged over layers, heads and probes (the same inputs for every
  method, so only the cache differs). Chelsea's decode-time re-clustering is exercised when probes > g.
- Needle accuracy: a passcode sentence inserted at several depths of an essay haystack of ``n`` tokens, the
  question asked through the chat template, greedy generation; a hit is the passcode in the answer.
- Decode step time: the compiled ``scan`` loop (second run; compile excluded) per method vs full.
JSON carries the jax version and device. ``--outliers PATH`` adds Chelsea with calibrated outlier heads.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvjax  # noqa: E402
from bench_common import write_json  # noqa: E402
from eval import fidelity  # noqa: E402
from kvjax.loading import assets  # noqa: E402
from kvjax import engine, methods

NEEDLE = "The secret passcode for the vault is {code}."
QUESTION = "What is the secret passcode for the vault? Answer with the number only."


def essay_ids(tok, n: int, offset: int = 0) -> list[int]:
    text = "\n\n".join(p.read_text(errors="replace") for p in sorted(assets.essays_dir().glob("*.txt")))
    ids = tok.encode(text, add_special_tokens=False)
    return ids[offset : offset + n]


def method_set(budget, outliers):
    out = {
        "full": methods.get("full"),
        "streaming_llm": methods.get("streaming_llm", budget=budget),
        "snapkv": methods.get("snapkv", budget=budget),
        "chelsea": methods.get("chelsea", budget=budget),
    }
    if outliers:
        out["chelsea+outliers"] = methods.get("chelsea", budget=budget, outlier_heads=outliers)
    return out


def attention_errors(model, ids, probes, ms):
    """Mean relative error of each method's decode attention output vs full (``eval.fidelity.probe``)."""
    per_layer = {}
    for name, m in ms.items():
        per_layer[name] = fidelity.probe(model, ids, m, probes)["rel_error"]
        print(f"  {name}: {np.mean(per_layer[name]):.4f}", file=sys.stderr)
    return {name: float(np.mean(e)) for name, e in per_layer.items()}, per_layer


def needle(model, n, depths, ms, new_tokens=12):
    tok = model.tokenizer
    overhead = len(tok.encode_chat([{"role": "user", "content": NEEDLE.format(code="12345") + "\n\n" + QUESTION}]))
    hay = essay_ids(tok, n - overhead - 16, offset=5000)  # prompts fit the bucket n (prompt_len=n)
    res = {name: [] for name in ms}
    for i, depth in enumerate(depths):
        code = str(31000 + 7919 * (i + 3))[:5]
        cut = int(depth * len(hay))
        ctx = tok.decode(hay[:cut]) + " " + NEEDLE.format(code=code) + " " + tok.decode(hay[cut:])
        prompt = tok.encode_chat([{"role": "user", "content": ctx + "\n\n" + QUESTION}])
        for name, m in ms.items():
            if len(prompt) > n:
                raise ValueError(f"needle prompt of {len(prompt)} tokens exceeds the bucket {n}")
            # scan driver and the timing run's max_new_tokens: the compiled loop is shared with step_times
            out = engine.generate(
                model, [prompt], m, max_new_tokens=new_tokens, stop_at_eos=True, prompt_len=n, driver="scan"
            )
            res[name].append(
                {
                    "depth": depth,
                    "code": code,
                    "answer": out.text[0],
                    "hit": code in out.text[0],
                    "prompt_tokens": len(prompt),
                }
            )
        print(f"  needle depth {depth}: " + ", ".join(f"{k}={v[-1]['hit']}" for k, v in res.items()), file=sys.stderr)
    return {name: float(np.mean([r["hit"] for r in rs])) for name, rs in res.items()}, res


def step_times(model, ids, ms, steps):
    out = {}
    for name, m in ms.items():
        for _ in range(2):  # the first run may compile
            r = engine.generate(
                model, [ids], m, max_new_tokens=steps, stop_at_eos=False, driver="scan", prompt_len=len(ids)
            )
        s = r.stats[0]
        out[name] = {
            "step_ms": 1000 * s["decode_seconds"] / max(s["decode_steps"] - 1, 1),
            "cache_bytes": s["cache_bytes"],
        }
    for name in out:
        out[name]["vs_full"] = out[name]["step_ms"] / out["full"]["step_ms"]
        out[name]["bytes_vs_full"] = out[name]["cache_bytes"] / out["full"]["cache_bytes"]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=assets.SMOLLM2_NAME)
    ap.add_argument("--lengths", default="2048")
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--probes", type=int, default=72, help="decode probes for the attention error (> g = 64)")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed (and generated in the needle test)")
    ap.add_argument("--outliers", default=None, help="a calibrate-chelsea JSON: adds chelsea+outliers")
    ap.add_argument("--out", default="benchmarks/results/chelsea_cpu.json")
    args = ap.parse_args(argv)
    model = kvjax.load_model(args.model)
    ms = method_set(args.budget, args.outliers)
    result = {
        "jax_version": jax.__version__,
        "device": str(jax.devices()[0]),
        "device_kind": getattr(jax.devices()[0], "device_kind", ""),
        "platform": platform.platform(),
        "model": args.model,
        "dtype": str(model.dtype),
        "budget": args.budget,
        "methods": {k: repr(v) for k, v in ms.items()},
        "lengths": {},
    }
    for n in (int(x) for x in args.lengths.split(",")):
        t0 = time.perf_counter()
        print(f"[chelsea bench] n={n}", file=sys.stderr)
        ids = essay_ids(model.tokenizer, n + args.probes)
        err, per_layer = attention_errors(model, ids, args.probes, ms)
        acc, hits = needle(model, n, [float(x) for x in args.depths.split(",")], ms, new_tokens=args.steps)
        times = step_times(model, ids[:n], ms, args.steps)
        result["lengths"][n] = {
            "attention_rel_error": err,
            "attention_rel_error_per_layer": per_layer,
            "needle_accuracy": acc,
            "needle": hits,
            "decode": times,
            "seconds": time.perf_counter() - t0,
        }
        print(
            json.dumps({"n": n, "attention_rel_error": err, "needle_accuracy": acc, "decode": times}, indent=1),
            file=sys.stderr,
        )
    write_json(args.out, result)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
