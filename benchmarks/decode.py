"""Decode benchmark: step time and tokens/s of every method vs the full cache, in one run.

    python benchmarks/decode.py --lengths 1024,2048,4096,8192 --budget 0.2 --out results/decode.json

For each prompt length (filler text from the Paul Graham essays) and method, it times the compiled decode
loop (``scan`` driver, fixed steps, compile excluded by a warm-up run), and reports the cache bytes held,
the bytes of K/V read per step (valid slots x layers), the ratio of each method to ``full``, and the fraction of
the device's memory bandwidth when ``--bandwidth-gbs`` is given. JSON includes the jax version and device.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax import assets, engine, methods
from kvjax.methods.base import Capacity


def run_one(model, ids, method, steps):
    cfg = model.config
    lengths = jnp.asarray([len(ids)], jnp.int32)
    bucket = engine.bucket_length(len(ids))
    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, : len(ids)] = ids
    cap = Capacity(bucket, steps + 1)
    loop = engine._Loop(cfg, method, kvjax.sampling.Greedy(), steps + 1, ())
    times = []
    for _ in range(2):  # first run compiles
        states = engine.init_states(cfg, method, 1, cap, model.dtype)
        states, logits = engine.prefill(cfg, method, model.params, jnp.asarray(tokens), lengths, states)
        first = jnp.argmax(logits, -1).astype(jnp.int32)
        jax.block_until_ready(states)
        t0 = time.perf_counter()
        out, n, states = engine._generate_compiled(loop, "scan", model.params, states, first, lengths,
                                                   jax.random.PRNGKey(0))
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    step = times[-1] / steps
    held = sum(method.memory_bytes(s) for s in states)
    valid = sum(int((s.pos >= 0).sum()) for s in states)  # slots holding a token after the run
    itemsize = jnp.dtype(model.dtype).itemsize
    read = valid * cfg.head_dim * 2 * itemsize  # K and V of valid slots (all layers, KV heads)
    return {"step_seconds": step, "tokens_per_second": 1.0 / step, "cache_bytes": held,
            "kv_bytes_read_per_step": read}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=assets.SMOLLM2_NAME)
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--methods", default="full,streaming_llm,h2o,snapkv,pyramidkv")
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--bandwidth-gbs", type=float, default=None, help="device memory bandwidth, GB/s")
    p.add_argument("--out", default="results/decode.json")
    args = p.parse_args(argv)

    model = kvjax.load_model(args.model)
    text_ids = model.tokenizer.encode(assets.essays_text())
    rows = []
    for n in [int(x) for x in args.lengths.split(",")]:
        if n + args.steps + 1 > model.config.max_position_embeddings:
            raise ValueError(f"--lengths {n} + --steps exceeds the model context")
        base = None
        for name in args.methods.split(","):
            method = methods.get(name) if name == "full" else methods.get(name, budget=args.budget)
            r = {"prompt_len": n, "method": name, **run_one(model, text_ids[:n], method, args.steps)}
            if name == "full":
                base = r
            if base is not None:
                r["speedup_vs_full"] = base["step_seconds"] / r["step_seconds"]
                r["cache_ratio_vs_full"] = r["cache_bytes"] / base["cache_bytes"]
            if args.bandwidth_gbs:
                r["bandwidth_fraction"] = r["kv_bytes_read_per_step"] / r["step_seconds"] / (args.bandwidth_gbs * 1e9)
            rows.append(r)
            print(f"{n:6d} {name:14s} step {r['step_seconds'] * 1e3:8.2f} ms  {r['tokens_per_second']:7.1f} tok/s  "
                  f"cache {r['cache_bytes'] / 2**20:7.1f} MiB  x{r.get('speedup_vs_full', float('nan')):.2f} speed  "
                  f"x{r.get('cache_ratio_vs_full', float('nan')):.2f} memory", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"jax_version": jax.__version__, "device": str(jax.devices()[0]),
                               "backend": jax.default_backend(), "python": platform.python_version(),
                               "model": args.model, "dtype": str(model.dtype), "budget": args.budget,
                               "steps": args.steps, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
