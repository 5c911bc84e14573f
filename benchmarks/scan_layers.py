"""Scan over layers: compile time of the decode loop at depth, and step time, unrolled vs scanned, in one run.

    python benchmarks/scan_layers.py --layers 30,80 --methods full,snapkv,h2o,chunkkv,chelsea,pqcache,clusterkv,less
    python benchmarks/scan_layers.py --layers 30 --methods full,snapkv --bucket 2048 --steps 32 --hidden 576

For each depth and method it builds a random-weight model (``--hidden`` / ``--heads`` / ``--kv-heads`` /
``--head-dim``; SmolLM2-like shapes by default, shrunk so that 80 layers fit a CPU), then for both layouts
(per-layer parameters and states, unrolled; stacked parameters and :class:`kvjax.engine.Stacked` states, one
``lax.fori_loop`` body per run of agreeing layers):

- trace + lower time and XLA compile time of the whole decode loop (``engine.run_loop``, ``scan`` driver),
- the step time of the compiled loop (``--steps`` tokens after a prefill of ``--prompt`` tokens),
- whether both layouts generate the same tokens.

It prints a table and writes JSON (jax version, device, commit) with ``--out``. Compile time is what
``scan_layers`` is for; the step time shows what running the layers as one loop body costs (the method's writes go
into the stacked cache in place, :mod:`kvjax.engine.inplace`).

Where the cache dominates (Llama-3.1-8B's attention shapes, long prompts) the model's own prefill would take
minutes on a CPU; ``--prefill random`` fills every layer's state through the method's own ``prefill`` with random
``q, k, v`` instead (as ``benchmarks/roofline.py`` does; nothing else changes, and the token check then compares
the two layouts on the same states)::

    python benchmarks/scan_layers.py --layers 4 --methods full,snapkv,h2o --hidden 256 --heads 32 --kv-heads 8 \
        --head-dim 128 --prompt 16384 --steps 16 --prefill random
"""

from __future__ import annotations

import argparse
import functools
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench_common import commit, load_average, write_json
from kvjax import engine, methods, model as M
from kvjax.config import ModelConfig
from kvjax.methods.base import Capacity
from kvjax.methods.plans.layers import same_as_previous
from kvjax.engine.sampling import Greedy

#: Options that make the windowed methods compress at short prompts (as the tests use).
SMALL = {
    "chelsea": dict(n_sink=4, n_recent=16, chunk=16, interval=16),
    "clusterkv": dict(sink=4, tokens_per_cluster=16, window=16, window_clusters=2),
    "quest": dict(page_size=16),
    "less": dict(hidden=64),
}


def random_prefill(cfg, method, cap: Capacity, lengths, scan: bool, seed: int = 0):
    """Every layer's state prefilled through ``method.prefill`` with random ``q [1, Hq, T, D]``, ``k, v [1, Hkv, T,
    D]`` (per-layer seeds, so both layouts hold the same values), in the layout ``init_states(..., scan_layers=scan)``
    gives (:class:`kvjax.engine.Stacked` segments for runs of agreeing layers)."""
    t, per, prev = cap.prompt_len, [], None
    for layer in range(cfg.num_layers):
        kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed * 1000 + layer), 3)
        shape = lambda h: (1, h, t, cfg.head_dim)  # noqa: E731
        q, k, v = (
            jax.random.normal(kq, shape(cfg.num_heads)),
            jax.random.normal(kk, shape(cfg.num_kv_heads)),
            jax.random.normal(kv, shape(cfg.num_kv_heads)),
        )
        m = method.at(layer)  # the layer's method (ClusterKV's and Quest's first layers run full)
        st = m.init(cfg, 1, cap, layer, jnp.float32)
        kw = {"previous": prev} if m.reuses_previous_layer and same_as_previous(method, layer) else {}
        prev = jax.jit(functools.partial(m.prefill, layer=layer))(st, q=q, k=k, v=v, lengths=lengths, **kw)
        per.append(prev)
    plan = engine.scan_runs(cfg, method, 1, cap, jnp.float32) if scan else [range(l, l + 1) for l in range(len(per))]
    return tuple(
        per[r.start]
        if len(r) == 1
        else engine.Stacked(jax.tree.map(lambda *a: jnp.stack(a), *per[r.start : r.stop]), r.start, r.stop)
        for r in plan
    )


def one(cfg, params, method, prompt, steps, scan: bool, repeats: int = 3, prefill: str = "model") -> dict:
    """Time lowering and compiling the decode loop of one layout, then its step time (best of ``repeats`` runs,
    each on freshly prefilled states: the loop donates them). ``prefill``: ``"model"`` (the engine's prefill of a
    ``prompt``-token prompt) or ``"random"`` (:func:`random_prefill`, the first token fixed)."""
    p = M.stack_layers(params) if scan else M.unstack_layers(params)
    bucket = engine.bucket_length(prompt)
    tokens, lengths = engine.pad_prompts([list(range(1, prompt + 1))], bucket)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)

    def prefilled():
        if prefill == "random":
            return random_prefill(cfg, method, Capacity(bucket, steps), lengths, scan), jnp.ones((1,), jnp.int32)
        states = engine.init_states(cfg, method, 1, Capacity(bucket, steps), jnp.float32, scan_layers=scan)
        states, logits = engine.prefill(cfg, method, p, tokens, lengths, states)
        return states, jnp.argmax(logits, -1).astype(jnp.int32)

    states, first = prefilled()
    loop = engine.DecodeLoop(cfg, method, Greedy(), steps, ())
    t0 = time.perf_counter()
    lowered = engine.run_loop.lower(loop, "scan", p, states, first, lengths, jax.random.PRNGKey(0))
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    best, out = float("inf"), None
    for _ in range(repeats):
        states, first = prefilled()
        jax.block_until_ready(states)
        t3 = time.perf_counter()
        out, _, states = compiled(p, states, first, lengths, jax.random.PRNGKey(0))  # static args are baked in
        out.block_until_ready()
        best = min(best, time.perf_counter() - t3)
    return {
        "lower_s": t1 - t0,
        "compile_s": t2 - t1,
        "step_ms": 1e3 * best / max(steps - 1, 1),
        "tokens": np.asarray(out)[0].tolist(),
        "segments": [s.stop - s.start if isinstance(s, engine.Stacked) else 1 for s in states],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="30,80", help="comma-separated depths")
    ap.add_argument("--methods", default="full,snapkv,h2o,chunkkv,chelsea,pqcache,clusterkv,quest,less")
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=200, help="prompt tokens")
    ap.add_argument("--steps", type=int, default=16, help="decode steps of the loop")
    ap.add_argument(
        "--prefill",
        choices=("model", "random"),
        default="model",
        help="model: the engine's prefill; random: each layer's method.prefill on random q, k, v",
    )
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args(argv)

    rows = []
    for depth in [int(x) for x in args.layers.split(",")]:
        cfg = ModelConfig(
            "llama",
            args.vocab,
            args.hidden,
            2 * args.hidden,
            depth,
            args.heads,
            args.kv_heads,
            args.head_dim,
            max_position_embeddings=max(8192, 2 * (args.prompt + args.steps)),
        )
        params = M.random_params(cfg, jax.random.PRNGKey(0), scale=0.1)
        for name in args.methods.split(","):
            method = methods.at_budget(name, args.budget, **SMALL.get(name, {}))
            res = {
                layout: one(cfg, params, method, args.prompt, args.steps, layout == "scan", prefill=args.prefill)
                for layout in ("unrolled", "scan")
            }
            u, s = res["unrolled"], res["scan"]
            row = {
                "layers": depth,
                "method": name,
                "same_tokens": u["tokens"] == s["tokens"],
                "scan_segments": s["segments"],
                **{f"{k}_{lay}": res[lay][k] for lay in res for k in ("lower_s", "compile_s", "step_ms")},
            }
            row["load_average_1min"] = load_average()  # other work on the machine skews the timings
            rows.append(row)
            print(
                f"L={depth:3d} {name:14s} lower {u['lower_s']:6.1f}s -> {s['lower_s']:5.1f}s | compile "
                f"{u['compile_s']:6.1f}s -> {s['compile_s']:5.1f}s | step {u['step_ms']:7.2f} -> "
                f"{s['step_ms']:7.2f} ms | segments {s['segments']} | same tokens {row['same_tokens']}",
                flush=True,
            )
    if args.out:
        out = {
            "jax_version": jax.__version__,
            "device": str(jax.devices()[0].device_kind),
            "platform": platform.platform(),
            "commit": commit(),
            "args": vars(args),
            "rows": rows,
        }
        write_json(args.out, out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
