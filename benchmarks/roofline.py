"""Roofline of the decode step where the KV cache dominates: step time against bytes read, every method vs full.

    python benchmarks/roofline.py --lengths 32k --methods full,snapkv,pqcache --budgets 0.2 --token-budgets 2048

The setting is **attention + cache only**: Llama-3.1-8B's attention shapes (32 query / 8 KV heads x 128) and no
weights at all. Each of ``--layers`` layers (numbered from ``--first-layer``, default 2: past ClusterKV's and
Quest's full layers, in a 32-layer model, so PyramidKV's and ChunkKV's per-layer rules see a real depth) gets a
random prompt ``q [B, 32, n, 128]``, ``k, v [B, 8, n, 128]`` that goes through the method's own ``prefill``,
then every decode step calls each layer's ``method.decode`` (the public interface, nothing method-specific here)
with fixed random ``q, k, v`` in one jitted, state-donating step. With no weights, a step reads only what the
method reads, so the ratios below are the methods' own, not diluted by an 8B model's 16 GB of weights (the
projection section adds those back).

Timing: every method's states are built first; then ``--rounds`` rounds each run ``--steps`` steps of every method
in a rotated order (compile and the first round excluded) and the step time is the median over rounds, so a
change in machine load hits every method alike. Per method and context (JSON keys in brackets):

- step time [``step_s``], and the method's own bytes read per step [``bytes_read``]: the sum over layers of
  ``method.bytes_read_per_step`` (the K/V blocks, codes, centroids, scores... each method counts);
- XLA's ``cost_analysis()["bytes accessed"]`` of the compiled step [``xla_bytes``] beside it (XLA:CPU counts a
  dynamic-update-slice's whole operand, so it over-counts in-place writes);
- achieved GB/s [``gbs``] = bytes / step time, and the machine's measured read and copy bandwidth in the header;
- **efficiency** [``efficiency``] = (step time / full's step time) / (bytes read / full's bytes read): 1.0 means
  the step costs exactly what it reads; speed-up [``speedup``] = full's time / the method's.

``full`` runs first at every (context, batch, dtype), so every ratio compares rows of the same run. JSON after
every context (jax version, device, commit, command line).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shlex
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import LLAMA31_8B, _dirty, parse_contexts, variants  # noqa: E402
from scan_layers import commit  # noqa: E402

from kvjax import methods  # noqa: E402
from kvjax.methods.base import Capacity  # noqa: E402


def attention_config(cfg=LLAMA31_8B):
    """The model config the methods see: the 8B's heads, head dim, depth and context (nothing else is used)."""
    return cfg


@dataclasses.dataclass
class Run:
    """One method's states over the benchmarked layers and its jitted decode step."""

    label: str
    method: object
    budget: object
    states: list
    step: object
    prefill_s: float


def _prompt(key, batch, n, cfg, dtype):
    kq, kk, kv = jax.random.split(key, 3)
    shape = lambda h: (batch, h, n, cfg.head_dim)  # noqa: E731
    return (jax.random.normal(kq, shape(cfg.num_heads), dtype), jax.random.normal(kk, shape(cfg.num_kv_heads), dtype),
            jax.random.normal(kv, shape(cfg.num_kv_heads), dtype))


def build(cfg, label, method, budget, layers, batch, n, steps, dtype, seed=0) -> Run:
    """Prefill every layer of ``layers`` with a random prompt of ``n`` tokens (per-layer seeds) and jit the step."""
    cap = Capacity(n, steps)
    lengths = jnp.full((batch,), n, jnp.int32)
    states, prev, t0 = [], None, time.perf_counter()
    for layer in layers:
        q, k, v = _prompt(jax.random.PRNGKey(seed * 1000 + layer), batch, n, cfg, dtype)
        st = method.init(cfg, batch, cap, layer, dtype)
        pre = jax.jit(functools.partial(method.prefill, layer=layer), static_argnames=())
        kw = {"previous": prev} if method.reuses_previous_layer else {}
        st = pre(st, q=q, k=k, v=v, lengths=lengths, **kw)
        jax.block_until_ready(st)
        prev = st
        states.append(st)
        del q, k, v
    prefill_s = time.perf_counter() - t0

    def step(states, q, k, v, pos):
        outs, new = [], []
        for layer, st in zip(layers, states):
            o, st = method.decode(st, layer, q, k, v, pos)
            outs.append(o)
            new.append(st)
        return sum(o.sum() for o in outs), new

    return Run(label, method, budget, states, jax.jit(step, donate_argnums=0), prefill_s)


def decode_inputs(cfg, batch, dtype, seed=7):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(kq, (batch, cfg.num_heads, cfg.head_dim), dtype),
            jax.random.normal(kk, (batch, cfg.num_kv_heads, cfg.head_dim), dtype),
            jax.random.normal(kv, (batch, cfg.num_kv_heads, cfg.head_dim), dtype))


def xla_bytes(run: Run, args) -> float | None:
    """``cost_analysis()["bytes accessed"]`` of the compiled step (None where the backend gives none)."""
    try:
        ca = run.step.lower(run.states, *args).compile().cost_analysis()
    except Exception:  # noqa: BLE001  (a backend without cost analysis)
        return None
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return float(ca.get("bytes accessed", 0.0)) if ca else None


def time_runs(runs: list[Run], args, n, steps: int, rounds: int, progress=print) -> dict[str, float]:
    """Median step seconds per run label: ``rounds`` rounds (after one warm-up round) of ``steps`` steps of every
    run, the order rotated each round. Positions advance from ``n`` (the method's next token) and wrap every
    ``steps`` decode steps' worth of capacity."""
    times = {r.label: [] for r in runs}
    pos0 = jnp.full((args[0].shape[0],), n, jnp.int32)
    used = {r.label: 0 for r in runs}
    for rnd in range(rounds + 1):
        order = runs[rnd % len(runs):] + runs[: rnd % len(runs)]
        for r in order:
            t0 = time.perf_counter()
            for _ in range(steps):
                out, r.states = r.step(r.states, *args, pos0 + used[r.label])
                used[r.label] += 1
            jax.block_until_ready(out)
            if rnd:
                times[r.label].append((time.perf_counter() - t0) / steps)
        progress(f"  round {rnd}/{rounds}")
    return {k: float(np.median(v)) for k, v in times.items()}


def bandwidth_gbs(nbytes: int = 512 << 20, repeats: int = 10) -> dict:
    """The machine's measured read bandwidth (sum of a ``nbytes`` float32 array) and copy bandwidth (read + write
    of ``x + 1``), GB/s, medians."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    read = jax.jit(jnp.sum)
    copy = jax.jit(lambda a: a + 1.0, donate_argnums=0)  # in place: no fresh pages to fault in
    out = {}
    for name, fn, moved in (("read_gbs", read, nbytes), ("copy_gbs", copy, 2 * nbytes)):
        ts = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            y = jax.block_until_ready(fn(x))
            if i:
                ts.append(time.perf_counter() - t0)
            if name == "copy_gbs":
                x = y  # the input was donated
        out[name] = moved / float(np.median(ts)) / 1e9
    return out


def add_ratios(rows: list[dict]) -> None:
    full = next(r for r in rows if r["method"] == "full")
    for r in rows:
        r["speedup"] = full["step_s"] / r["step_s"]
        r["time_ratio"] = r["step_s"] / full["step_s"]
        r["bytes_ratio"] = r["bytes_read"] / full["bytes_read"]
        r["efficiency"] = r["time_ratio"] / r["bytes_ratio"]


def table(rows: list[dict]) -> str:
    head = (f"{'context':>8s} {'B':>2s} {'dtype':8s} {'method':26s} {'step ms':>8s} {'MiB/step':>9s} "
            f"{'XLA MiB':>8s} {'GB/s':>6s} {'time/full':>9s} {'bytes/full':>10s} {'eff':>5s} {'speedup':>7s}")
    lines = [head]
    for r in rows:
        xla = "-" if r.get("xla_bytes") is None else f"{r['xla_bytes'] / 2**20:8.1f}"
        lines.append(f"{r['context']:8d} {r['batch']:2d} {r['dtype']:8s} {r['label']:26s} {r['step_s'] * 1e3:8.2f} "
                     f"{r['bytes_read'] / 2**20:9.1f} {xla:>8s} {r['gbs']:6.1f} {r['time_ratio']:9.3f} "
                     f"{r['bytes_ratio']:10.3f} {r['efficiency']:5.2f} {r['speedup']:7.2f}")
    return "\n".join(lines)


def header(args) -> dict:
    dev = jax.devices()[0]
    return {"benchmark": "roofline", "setting": "attention + cache only (no weights), Llama-3.1-8B attention shapes",
            "jax_version": jax.__version__, "device": str(dev), "device_kind": dev.device_kind,
            "backend": jax.default_backend(), "commit": commit(), "commit_dirty": _dirty(),
            "command": shlex.join([sys.executable] + sys.argv), "layers": args.layers,
            "first_layer": args.first_layer, "steps": args.steps, "rounds": args.rounds,
            "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def _budgets(text):
    from e2e import _budgets as parse
    return parse(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--lengths", type=parse_contexts, default=parse_contexts("32k"), help="prompt lengths (8k, 16k...)")
    p.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1])
    p.add_argument("--dtypes", default="float32", help="comma-separated: float32, bfloat16")
    p.add_argument("--methods", default=",".join(methods.names()))
    p.add_argument("--budgets", type=_budgets, default=_budgets("0.2"))
    p.add_argument("--token-budgets", type=_budgets, default=_budgets("2048"),
                   help="also run the recall methods at these token budgets")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--first-layer", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="decode steps per method per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/roofline_cpu.json")
    args = p.parse_args(argv)

    cfg = attention_config()
    layers = list(range(args.first_layer, args.first_layer + args.layers))
    names = [m for m in args.methods.split(",") if m]
    data = {**header(args), **bandwidth_gbs(), "rows": []}
    print(f"read {data['read_gbs']:.1f} GB/s, copy {data['copy_gbs']:.1f} GB/s", flush=True)
    out = Path(args.out)
    for n in args.lengths:
        for batch in args.batch:
            for dt in args.dtypes.split(","):
                dtype = jnp.dtype(dt)
                steps_cap = args.steps * (args.rounds + 1) + 1
                runs = []
                for label, method, budget in variants(names, args.budgets, args.token_budgets, (1,)):
                    print(f"{n} B={batch} {dt} {label}: prefill", flush=True)
                    runs.append(build(cfg, label, method, budget, layers, batch, n, steps_cap, dtype))
                dargs = decode_inputs(cfg, batch, dtype)
                xla = {r.label: xla_bytes(r, dargs + (jnp.full((batch,), n, jnp.int32),)) for r in runs}
                times = time_runs(runs, dargs, n, args.steps, args.rounds)
                rows = []
                for r in runs:
                    read = sum(r.method.bytes_read_per_step(st, cfg.num_heads) for st in r.states)
                    rows.append({"context": n, "batch": batch, "dtype": dt, "label": r.label, "method": r.method.name,
                                 "budget": r.budget, "step_s": times[r.label], "bytes_read": int(read),
                                 "xla_bytes": xla[r.label], "gbs": read / times[r.label] / 1e9,
                                 "prefill_s": r.prefill_s})
                add_ratios(rows)
                print(table(rows), flush=True)
                data["rows"].extend(rows)
                del runs
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(data, indent=1, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
