"""Decode benchmark: step time and tokens/s of every method vs the full cache, in one run.

    python benchmarks/decode.py --lengths 1024,2048,4096,8192 --budget 0.2 --out results/decode.json

For each prompt length (filler text from the Paul Graham essays) and every registered method
(``kvjax.methods.names()``, or ``--methods``; ``full`` always first), it times the compiled decode loop
(``kvjax.engine.run_loop``, ``scan`` driver, fixed steps, compile excluded by a warm-up run), and reports step
time, tokens/s, the cache bytes held, the tokens held per sequence, the K/V (+ index) bytes one step reads by
the method's own plan (``engine.bytes_read_per_step``; plus the weights for the total), the ratios of each
method to ``full`` in the same run, and the fraction of the device's memory bandwidth (known GPUs are detected; else
``--bandwidth-gbs``). JSON includes the jax version and device.

``--random-weights`` uses SmolLM2-135M's shapes with random weights and random token ids (no GGUF file
needed): step time does not depend on the weights' values, so the timings are those of the real model.
``--tiny`` uses a 2-layer random model (smoke runs).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from bench_common import device_fields, parse_budget, time_decode_loop, write_json
from kvjax.loading import assets
from kvjax import engine, methods
from kvjax.config import ModelConfig, RopeConfig
from kvjax.loading import Model, default_dtype
from kvjax.methods.base import Capacity
from kvjax.model import random_params


#: SmolLM2-135M-Instruct's shapes (what the embedded GGUF holds), for ``--random-weights``.
SMOLLM2_135M = ModelConfig(
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope=RopeConfig(theta=100000.0),
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
#: A 2-layer random model for smoke runs (``--tiny``).
TINY = ModelConfig(
    model_type="llama",
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    max_position_embeddings=8192,
)
#: Peak HBM bandwidth in GB/s by ``device_kind`` substring.
PEAK_GBS = {
    "H200": 4800.0,
    "H100": 3350.0,
    "A100": 2039.0,
    "TPU v5 lite": 819.0,
    "TPU v5": 2765.0,
    "TPU v4": 1228.0,
    "TPU v6": 1640.0,
}


def peak_bandwidth_gbs(device) -> float | None:
    kind = getattr(device, "device_kind", "")
    return next((v for k, v in PEAK_GBS.items() if k in kind), None)


def cannot_run(model, method, n, steps) -> str | None:
    """Why ``method`` cannot build its cache for an ``n``-token prompt + ``steps`` (its ``init`` refuses the
    capacity, e.g. too few slots for Chelsea's sink + recent windows), else None. Shapes only, nothing runs."""
    cap = Capacity(engine.bucket_length(n), steps + 1)
    try:
        engine.check_method(model.config, method)
        jax.eval_shape(lambda: engine.init_states(model.config, method, 1, cap, model.dtype))
    except ValueError as e:
        return str(e)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None  # init is not abstractly evaluable (it runs concretely in run_one)
    return None


def run_one(model, ids, method, steps, batch=1):
    """Time ``steps`` decode steps of ``method`` after a prompt ``ids`` (``batch`` copies), compile excluded."""
    cfg = model.config
    bucket = engine.bucket_length(len(ids))
    tokens, lengths = engine.pad_prompts([list(ids)] * batch, bucket)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    cap = Capacity(bucket, steps + 1)
    engine.check_method(cfg, method)
    step, states = time_decode_loop(model, method, tokens, lengths, cap, steps)
    held = engine.memory_bytes(method, states)
    kv_read = engine.bytes_read_per_step(method, states, cfg.num_heads)  # the method's own plan, all layers
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.params))
    return {
        "step_seconds": step,
        "tokens_per_second": batch / step,
        "cache_bytes": held,
        "cache_bytes_per_seq": held / batch,
        "tokens_held_per_seq": float(np.mean(engine.tokens_held(method, states))),
        "kv_bytes_read_per_step": kv_read,
        "bytes_read_per_step": kv_read + weights,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=assets.SMOLLM2_NAME)
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument(
        "--methods",
        default=",".join(methods.names()),
        help="comma-separated registered methods (default: all; full is always timed first)",
    )
    p.add_argument("--budget", type=parse_budget, default=0.2, help="fraction in (0, 1] or token count")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--random-weights", action="store_true", help="SmolLM2-135M shapes, random weights/tokens")
    p.add_argument("--tiny", action="store_true", help="a 2-layer random model (smoke runs, seconds per method)")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: fp32 on CPU, bf16 else)")
    p.add_argument("--bandwidth-gbs", type=float, default=None, help="device memory bandwidth, GB/s")
    p.add_argument(
        "--impl",
        default=None,
        choices=("xla", "pallas_tpu", "pallas_gpu"),
        help="decode-attention kernel for every method (default: by backend; sets $KVJAX_DECODE_ATTENTION_IMPL)",
    )
    p.add_argument("--out", default="results/decode.json")
    return p


def _ratios(r: dict, base: dict, bandwidth) -> dict:
    """``r`` with its ratios to ``full``'s row of the same length (``base``) and, given the device's ``bandwidth``
    (GB/s), the fraction of it the step's bytes reach."""
    r["speedup_vs_full"] = base["step_seconds"] / r["step_seconds"]
    r["cache_ratio_vs_full"] = r["cache_bytes"] / base["cache_bytes"]
    r["kv_read_ratio_vs_full"] = r["kv_bytes_read_per_step"] / base["kv_bytes_read_per_step"]
    r["read_ratio_vs_full"] = r["bytes_read_per_step"] / base["bytes_read_per_step"]
    if bandwidth:
        r["bandwidth_fraction"] = r["bytes_read_per_step"] / r["step_seconds"] / (bandwidth * 1e9)
    return r


def _print_row(r: dict, bandwidth) -> None:
    print(
        f"{r['prompt_len']:6d} {r['method']:14s} step {r['step_seconds'] * 1e3:8.2f} ms  "
        f"{r['tokens_per_second']:7.1f} tok/s  x{r['speedup_vs_full']:.2f} speed  "
        f"cache {r['cache_bytes'] / 2**20:7.2f} MiB (x{r['cache_ratio_vs_full']:.2f})  "
        f"held {r['tokens_held_per_seq']:7.1f} tok/seq  "
        f"KV read {r['kv_bytes_read_per_step'] / 2**20:7.2f} MiB/step (x{r['kv_read_ratio_vs_full']:.2f})  "
        f"total {r['bytes_read_per_step'] / 2**20:7.1f} MiB/step"
        + (f"  {100 * r['bandwidth_fraction']:.0f}% of HBM" if bandwidth else ""),
        flush=True,
    )


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.impl:
        os.environ["KVJAX_DECODE_ATTENTION_IMPL"] = args.impl  # read by attention.attend at trace time

    if args.random_weights or args.tiny:
        cfg, label = (TINY, "tiny (random weights)") if args.tiny else (SMOLLM2_135M, "smollm2-135m (random weights)")
        dtype = jnp.dtype(args.dtype) if args.dtype else default_dtype()
        model = Model(cfg, random_params(cfg, jax.random.PRNGKey(0), dtype), None, label)
        text_ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 1 << 15).tolist()
    else:
        model = kvjax.load_model(args.model, dtype=args.dtype)
        text_ids = model.tokenizer.encode(assets.essays_text())
    bandwidth = args.bandwidth_gbs or peak_bandwidth_gbs(jax.devices()[0])
    rows = []

    def write():
        write_json(
            args.out,
            {
                **device_fields(),
                "batch": args.batch,
                "random_weights": args.random_weights or args.tiny,
                "model_label": model.name,
                "peak_bandwidth_gbs": bandwidth,
                "python": platform.python_version(),
                "model": args.model,
                "dtype": str(model.dtype),
                "budget": args.budget,
                "steps": args.steps,
                "attention_impl": args.impl or "by backend",
                "rows": rows,
            },
            indent=2,
        )

    for n in [int(x) for x in args.lengths.split(",")]:
        if n + args.steps + 1 > model.config.max_position_embeddings:
            raise ValueError(
                f"--lengths {n} + --steps {args.steps} + 1 exceeds the model context "
                f"({model.config.max_position_embeddings}); use a shorter length (e.g. 8000 for 8k)"
            )
        names = args.methods.split(",")
        names = ["full"] + [m for m in names if m != "full"]  # the baseline of every ratio, in the same run
        base = None
        for name in names:
            method = methods.at_budget(name, args.budget)
            reason = cannot_run(model, method, n, args.steps)
            if reason:  # a documented skip (e.g. chelsea's sink + recent exceed its budget at a short prompt)
                rows.append({"prompt_len": n, "method": name, "skipped": reason})
                write()
                print(f"{n:6d} {name:14s} skipped: {reason}", flush=True)
                continue
            r = {"prompt_len": n, "method": name, **run_one(model, text_ids[:n], method, args.steps, args.batch)}
            base = r if name == "full" else base
            rows.append(_ratios(r, base, bandwidth))
            write()  # after every row, so an interrupted run keeps what it measured
            _print_row(r, bandwidth)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
