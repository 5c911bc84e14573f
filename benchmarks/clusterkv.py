"""ClusterKV benchmark: clustering's share of prefill time, and what a decode step attends and reads, vs full.

    python benchmarks/clusterkv.py --lengths 2048,4096 --out benchmarks/results/clusterkv_cpu.json

1. Prefill (paper §V-D: clustering is 6-8% of prefill time on GPU): for each prompt length (filler text from
   the Paul Graham essays) the compiled prefill (``kvjax.engine.prefill``, warm-up run excluded, median of
   ``--repeats`` runs, full and clusterkv interleaved) of ``full`` and of ``clusterkv`` at ``--prefill-budget``,
   and the clustering share ``(t_clusterkv - t_full) / t_clusterkv``. Also C0 (prompt clusters per KV head of a
   compressed layer, :meth:`ClusterKV.clusters_for`) and the K-means updates run per compressed layer (the third
   output of ``cosine_kmeans``, read by a separate, untimed traced run).
2. Per step, after prefill: for ``clusterkv``, ``quest`` and ``pqcache`` at each of ``--budgets``, the tokens
   the first decode step attends (per query head; a compressed layer's ``method.attended(n, 0)`` and the mean
   over all layers, the ``n_full`` leading full layers included) and the K/V (+ index) bytes it reads
   (``engine.bytes_read_per_step``, all layers), each vs ``full``.

JSON includes the jax version, device and git commit. ``--tiny`` uses a 2-layer random model (smoke runs).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from bench_common import commit, device_fields, write_json
from kvjax.loading import assets
from kvjax.engine import core
from kvjax import engine, methods
from kvjax.config import ModelConfig
from kvjax.loading import Model, default_dtype
from kvjax.methods.clusterkv import index as cluster_index
from kvjax.methods.base import Capacity
from kvjax.model import random_params

#: A 2-layer random model for smoke runs (``--tiny``); n_full is set to 1 so one layer is compressed.
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
MAX_NEW = 32  # decode capacity of the states (shapes only: nothing is decoded)


def prompt(ids):
    tokens, lengths = engine.pad_prompts([list(ids)], engine.bucket_length(len(ids)))
    return jnp.asarray(tokens), jnp.asarray(lengths)


def prefill(model, method, tokens, lengths, fn=engine.prefill):
    """States after the prefill of ``tokens`` (one sequence), and the seconds the compiled call took."""
    cap = Capacity(tokens.shape[1], MAX_NEW)
    states = engine.init_states(model.config, method, 1, cap, model.dtype)
    jax.block_until_ready(states)
    t0 = time.perf_counter()
    states, logits = fn(model.config, method, model.params, tokens, lengths, states)
    jax.block_until_ready((states, logits))
    return states, time.perf_counter() - t0


def kmeans_iterations(model, method, tokens, lengths) -> list[int]:
    """K-means updates run in each compressed layer's prefill clustering (an untimed, separately traced run that
    reports ``cosine_kmeans``' third output through a debug callback)."""
    got = []
    orig = cluster_index.cosine_kmeans

    def recording(*a, **kw):
        mu, labels, it = orig(*a, **kw)
        jax.debug.callback(lambda i: got.append(int(i)), it)
        return mu, labels, it

    cluster_index.cosine_kmeans = recording
    try:
        fn = jax.jit(lambda *a: core.prefill(*a), static_argnums=(0, 1))  # a fresh function: traced anew
        prefill(model, method, tokens, lengths, fn)
        jax.effects_barrier()
    finally:
        cluster_index.cosine_kmeans = orig
    return got


def attended(method, n: int) -> int:
    return method.attended(n, 0)  # the first decode step (new token at position n), new token included


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=assets.SMOLLM2_NAME)
    p.add_argument("--lengths", default="2048,4096")
    p.add_argument("--prefill-budget", type=int, default=1024, help="clusterkv budget (tokens) for the timing")
    p.add_argument(
        "--methods",
        default="clusterkv,clusterkv:gqa=query,quest,pqcache",
        help="recall methods for attended/bytes; NAME:OPT=VALUE[+OPT=VALUE] sets string options "
        "(e.g. clusterkv:gqa=query)",
    )
    p.add_argument("--skip-prefill", action="store_true", help="only the attended/bytes-read table")
    p.add_argument("--budgets", default="256,512,1024", help="token budgets for attended/bytes")
    p.add_argument("--repeats", type=int, default=5, help="timed prefill runs per method (median)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer random model (smoke runs)")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: fp32 on CPU, bf16 else)")
    p.add_argument("--out", default="results/clusterkv.json")
    return p


def main(argv=None):
    args = _parser().parse_args(argv)

    extra = {}
    if args.tiny:
        dtype = jnp.dtype(args.dtype) if args.dtype else default_dtype()
        model = Model(TINY, random_params(TINY, jax.random.PRNGKey(0), dtype), None, "tiny (random weights)")
        text_ids = np.random.default_rng(0).integers(0, TINY.vocab_size, 1 << 14).tolist()
        extra = {"n_full": 1}
    else:
        model = kvjax.load_model(args.model, dtype=args.dtype)
        text_ids = model.tokenizer.encode(assets.essays_text())
    cfg = model.config
    nl = cfg.num_layers
    budgets = [int(b) for b in args.budgets.split(",")]
    names = [x for x in args.methods.split(",") if x]
    prefill_rows, step_rows = [], []

    def write():
        write_json(
            args.out,
            {
                **device_fields(),
                "commit": commit() or "unknown",
                "python": platform.python_version(),
                "model": model.name,
                "dtype": str(model.dtype),
                "num_layers": nl,
                "repeats": args.repeats,
                "prefill_budget": args.prefill_budget,
                "prefill": prefill_rows,
                "per_step": step_rows,
            },
            indent=2,
        )

    print(f"{model.name}: {nl} layers, {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    _prefill_table(model, args, text_ids, extra, prefill_rows, write)
    _step_table(model, args, text_ids, extra, names, budgets, step_rows, write)
    print(f"wrote {args.out}")


def _prefill_table(model, args, text_ids, extra, rows, write):
    """The clustering share of ClusterKV's prefill against full's, per prompt length (timed, interleaved)."""
    nl = model.config.num_layers
    print("\n== prefill: clustering share ==")
    print(f"{'n':>6} {'full ms':>9} {'clusterkv ms':>13} {'share':>7} {'C0':>4}  kmeans updates per compressed layer")
    for n in [int(x) for x in args.lengths.split(",")] if not args.skip_prefill else []:
        tokens, lengths = prompt(text_ids[:n])
        full = methods.get("full")
        ck = methods.get("clusterkv", budget=args.prefill_budget, **extra)
        for m in (full, ck):  # warm-up (compile)
            prefill(model, m, tokens, lengths)
        tf, tc = [], []
        for _ in range(args.repeats):  # interleaved, so drifting load hits both alike
            tf.append(prefill(model, full, tokens, lengths)[1])
            tc.append(prefill(model, ck, tokens, lengths)[1])
        t_full, t_ck = statistics.median(tf), statistics.median(tc)
        its = kmeans_iterations(model, ck, tokens, lengths)
        row = {
            "prompt_len": n,
            "full_seconds": t_full,
            "clusterkv_seconds": t_ck,
            "full_runs": tf,
            "clusterkv_runs": tc,
            "clustering_share": (t_ck - t_full) / t_ck,
            "c0_per_layer": ck.clusters_for(n),
            "compressed_layers": list(range(ck.n_full, nl)),
            "kmeans_iterations_per_layer": its,
            "kmeans_max_iters": ck.iters,
        }
        rows.append(row)
        write()
        print(
            f"{n:6d} {t_full * 1e3:9.1f} {t_ck * 1e3:13.1f} {100 * row['clustering_share']:6.1f}% "
            f"{row['c0_per_layer']:4d}  {its}",
            flush=True,
        )


def _step_table(model, args, text_ids, extra, names, budgets, rows, write):
    """Tokens attended and bytes read by the first decode step of each recall method, against full's."""
    cfg = model.config
    nl = cfg.num_layers
    print("\n== first decode step: attended tokens and bytes read vs full ==")
    print(
        f"{'n':>6} {'method':10s} {'budget':>6} {'att/layer':>9} {'x full':>7} {'att mean':>9} {'x full':>7} "
        f"{'KV read MiB':>11} {'x full':>7}"
    )
    for n in [int(x) for x in args.lengths.split(",")]:
        tokens, lengths = prompt(text_ids[:n])
        full = methods.get("full")
        st, _ = prefill(model, full, tokens, lengths)
        base_read = engine.bytes_read_per_step(full, st, cfg.num_heads)
        base_att = n + 1
        rows.append(
            {
                "prompt_len": n,
                "method": "full",
                "budget": None,
                "attended_compressed_layer": base_att,
                "attended_mean_layers": base_att,
                "bytes_read_per_step": base_read,
            }
        )
        print(
            f"{n:6d} {'full':10s} {'-':>6} {base_att:9d} {1:7.3f} {base_att:9.1f} {1:7.3f} "
            f"{base_read / 2**20:11.2f} {1:7.3f}",
            flush=True,
        )
        for spec in names:
            name, _, opts = spec.partition(":")
            opt = dict(o.split("=", 1) for o in opts.split("+") if o) if opts else {}
            for b in budgets:
                kw = dict(extra if name in ("clusterkv", "quest") else {}, **opt)
                m = methods.get(name, budget=b, **kw)
                st, _ = prefill(model, m, tokens, lengths)
                read = engine.bytes_read_per_step(m, st, cfg.num_heads)
                att = attended(m, n)
                nf = min(getattr(m, "n_full", 0), nl)
                mean = (nf * base_att + (nl - nf) * att) / nl
                r = {
                    "prompt_len": n,
                    "method": spec,
                    "budget": b,
                    "n_full": nf,
                    "attended_compressed_layer": att,
                    "attended_ratio_vs_full": att / base_att,
                    "attended_mean_layers": mean,
                    "attended_mean_ratio_vs_full": mean / base_att,
                    "bytes_read_per_step": read,
                    "read_ratio_vs_full": read / base_read,
                }
                rows.append(r)
                write()
                print(
                    f"{n:6d} {spec:10s} {b:6d} {att:9d} {att / base_att:7.3f} {mean:9.1f} {mean / base_att:7.3f} "
                    f"{read / 2**20:11.2f} {read / base_read:7.3f}",
                    flush=True,
                )


if __name__ == "__main__":
    sys.exit(main())
