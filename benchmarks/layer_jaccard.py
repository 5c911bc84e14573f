"""Adjacent-layer Jaccard of kept prompt positions (ChunkKV paper, Table 2) and ChunkKV's index-reuse saving.

    python benchmarks/layer_jaccard.py --lengths 1024,960 --budget 0.2 --repeats 3 \
        --out benchmarks/results/layer_jaccard_cpu.json

1. Jaccard: the embedded SmolLM2-135M-Instruct prefills a batch of Paul Graham essays (each cut to its first
   ``--lengths`` tokens; the first essays in name order that are long enough) with SnapKV, H2O and ChunkKV at the
   same budget (a fraction of each prompt, window included; H2O's recent window = the same ``--window``
   tokens, as in the paper's prefill harness). For every adjacent layer pair the Jaccard index of the kept
   prompt positions is averaged over sequences and KV heads (``kvjax.analysis.adjacent_layer_jaccard``);
   reported with the window positions (kept by every layer) and without them, per pair and averaged.
2. Reuse timing, in the same run: the jitted, warm engine prefill (``kvjax.engine.prefill``, whole model) of the
   same batch with ChunkKV ``reuse=1`` and ``reuse=2``, ``--repeats`` interleaved repeats after a warm-up (median
   and min). Also the selection alone: all layers' ``ChunkKV.prefill`` on fixed random q/k/v of the model's
   shapes (jitted, warm), which is what index reuse saves (paper App. B.1.1: ``T_compress`` vs ``T_select``).
The JSON records jax's version and the device.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import jax.numpy as jnp
from tqdm import tqdm

import kvjax
from bench_common import write_json
from kvjax import analysis, engine, methods
from kvjax.loading import assets
from kvjax.methods.base import Capacity
from kvjax.methods.plans.layers import same_as_previous


def essay_batch(model, lengths):
    """Token ids of the first essays (name order) with at least ``max(lengths)`` tokens, cut to ``lengths``."""
    out, names = [], []
    for name in assets.essay_names():
        ids = model.tokenizer.encode(assets.essay(name), add_special_tokens=True)
        if len(ids) >= max(lengths):
            out.append(ids[: lengths[len(out)]])
            names.append(name)
        if len(out) == len(lengths):
            return out, names
    raise ValueError(f"not enough essays with >= {max(lengths)} tokens; lower --lengths")


def time_prefill(model, method, tokens, lengths, bucket):
    states = engine.init_states(model.config, method, tokens.shape[0], Capacity(bucket, 1), model.dtype)
    jax.block_until_ready(states)
    t0 = time.perf_counter()
    states, logits = engine.prefill(model.config, method, model.params, tokens, lengths, states)
    jax.block_until_ready((states, logits))
    return time.perf_counter() - t0


def selection_only(model, method, batch, bucket, key):
    """A jitted function running ``method.prefill`` for every layer on fixed random q/k/v (no model)."""
    cfg = model.config
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (batch, cfg.num_heads, bucket, cfg.head_dim), model.dtype)
    k = jax.random.normal(kk, (batch, cfg.num_kv_heads, bucket, cfg.head_dim), model.dtype)
    v = jax.random.normal(kv, (batch, cfg.num_kv_heads, bucket, cfg.head_dim), model.dtype)

    @jax.jit
    def run(states, lengths):
        out = []
        for layer, st in enumerate(states):
            m = method.at(layer)  # the layer's method (a per-layer plan)
            prev = out[-1] if same_as_previous(method, layer) else None
            out.append(m.prefill(st, layer, q * (1 + layer), k, v, lengths, previous=prev))
        return tuple(out)

    def once(lengths):
        states = engine.init_states(cfg, method, batch, Capacity(bucket, 1), model.dtype)
        jax.block_until_ready(states)
        t0 = time.perf_counter()
        jax.block_until_ready(run(states, lengths))
        return time.perf_counter() - t0

    return once


def _jaccard(model, configs, ids, bucket: int, w: int) -> dict:
    """Adjacent-layer Jaccard of each config's kept prompt positions (with and without the last ``w``, the
    window), printed as a table."""
    out = {}
    for name, m in tqdm(configs.items(), desc="jaccard"):
        kept = analysis.kept_prompt_positions(model, m, ids, prompt_len=bucket)
        with_win = analysis.adjacent_layer_jaccard(kept)
        no_win = analysis.adjacent_layer_jaccard(kept, exclude_last=w)
        out[name] = {
            "method": repr(m),
            "mean_with_window": float(with_win.mean()),
            "mean_without_window": float(no_win.mean()),
            "per_pair_with_window": with_win.round(4).tolist(),
            "per_pair_without_window": no_win.round(4).tolist(),
            "kept_per_head_mean": float(kept.counts().mean()),
        }
    print("\nadjacent-layer Jaccard (mean over layer pairs, sequences, KV heads):")
    print(f"{'method':16s} {'with window':>12s} {'without':>10s}")
    for name, r in out.items():
        print(f"{name:16s} {100 * r['mean_with_window']:11.2f}% {100 * r['mean_without_window']:9.2f}%")
    return out


def _reuse_timing(model, args, ids, tokens, lengths, bucket: int) -> dict:
    """Seconds of ChunkKV's prefill with index reuse 1 and 2 (and full's, ``--with-full``), engine prefill and
    selection alone, interleaved so machine-load drift hits every config alike: label -> config -> runs."""
    w, c = args.window, args.chunk_size
    r1 = methods.get("chunkkv", budget=args.budget, window=w, chunk_size=c, reuse=1)
    r2 = methods.get("chunkkv", budget=args.budget, window=w, chunk_size=c, reuse=2)
    full = methods.get("full")
    timing = {}
    for label, fn in (("engine_prefill", lambda m: time_prefill(model, m, tokens, lengths, bucket)),):
        todo = (("full", full),) if args.with_full else ()
        todo += (("reuse1", r1), ("reuse2", r2))
        runs = {key: [] for key, _ in todo}
        for _, m in todo:
            fn(m)  # compile + warm
        for _ in tqdm(range(args.repeats), desc="prefill timing"):
            for key, m in todo:  # interleaved, so machine-load drift hits every config alike
                runs[key].append(fn(m))
        timing[label] = runs
    sel = {
        key: selection_only(model, m, len(ids), bucket, jax.random.PRNGKey(0))
        for key, m in (("reuse1", r1), ("reuse2", r2))
    }
    runs = {"reuse1": [], "reuse2": []}
    for key in sel:
        sel[key](lengths)
    for _ in tqdm(range(args.repeats), desc="selection timing"):
        for key in sel:
            runs[key].append(sel[key](lengths))
    timing["selection_only_all_layers"] = runs
    return timing


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1024,960", help="prompt length of each essay (comma separated)")
    ap.add_argument("--budget", type=float, default=0.2, help="kept fraction of each prompt (window included)")
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--chunk-size", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--with-full", action="store_true", help="also time the full cache's prefill")
    ap.add_argument("--out", default="benchmarks/results/layer_jaccard_cpu.json")
    args = ap.parse_args(argv)
    lengths_list = [int(x) for x in args.lengths.split(",")]

    model = kvjax.load_model("smollm2-135m-instruct")
    ids, names = essay_batch(model, lengths_list)
    bucket = engine.bucket_length(max(lengths_list))
    tokens, lengths = (jnp.asarray(x) for x in engine.pad_prompts(ids, bucket))
    w, c = args.window, args.chunk_size
    configs = {
        "h2o": methods.get("h2o", budget=args.budget, recent=w),
        "snapkv": methods.get("snapkv", budget=args.budget, window=w),  # avg pool, kernel 5 (class default)
        "snapkv_nopool": methods.get("snapkv", budget=args.budget, window=w, kernel=1),
        "chunkkv": methods.get("chunkkv", budget=args.budget, window=w, chunk_size=c),
    }
    result = {
        "jax": jax.__version__,
        "device": str(jax.devices()[0]),
        "platform": platform.platform(),
        "model": "smollm2-135m-instruct",
        "essays": names,
        "lengths": lengths_list,
        "bucket": bucket,
        "budget": args.budget,
        "window": w,
        "chunk_size": c,
        "jaccard": {},
    }
    print(
        f"jax {jax.__version__} on {jax.devices()[0]}; essays {names}, lengths {lengths_list}, budget "
        f"{args.budget}, window {w}, chunk {c}"
    )
    result["jaccard"] = _jaccard(model, configs, ids, bucket, w)
    timing = _reuse_timing(model, args, ids, tokens, lengths, bucket)
    result["timing_seconds"] = {
        label: {
            k: {"median": statistics.median(v), "min": min(v), "all": [round(x, 4) for x in v]} for k, v in runs.items()
        }
        for label, runs in timing.items()
    }
    print(
        f"\nprefill seconds (batch {len(ids)}, bucket {bucket}, {model.config.num_layers} layers; median / min "
        f"of {args.repeats}):"
    )
    for label, runs in result["timing_seconds"].items():
        for k, v in runs.items():
            print(f"  {label:28s} {k:7s} {v['median']:.4f} / {v['min']:.4f}")
        if "reuse1" in runs:
            a, b = runs["reuse1"]["median"], runs["reuse2"]["median"]
            print(f"  {label:28s} reuse=2 saves {a - b:+.4f} s ({100 * (a - b) / a:+.1f}%) vs reuse=1 (median)")
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
