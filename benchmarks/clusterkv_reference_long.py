"""ClusterKV on a long prompt against the numpy reference: is its perplexity gap at 32k the code or the method?

    python benchmarks/clusterkv_reference_long.py --model gemma3-270m --sequences 1 --prefix 32000 \\
        --continuation 64 --book essays --out benchmarks/results/clusterkv_reference_gemma3-270m-32k.json

The perplexity task's windows (``eval.perplexity.build``) run through the model with full attention
(``kvjax.engine.prefilled.prefill_once``): every global layer's keys, values and queries as ClusterKV receives them.
At each global layer, kvjax's ClusterKV prefill (default settings at ``--budget``) clusters the prompt, and the
float64 numpy reference (``tests/kvjax/ref_clusterkv.py``: Lloyd K-means under cosine distance, paper §III-B;
selection by ``q·mu``, §III-C) clusters the same keys from the same init rows. Per KV head:

- ``clusters equal``: the share of kvjax's clusters the reference has as the same set of positions;
- for each continuation query (the group's mean query selects, ``gqa="group_mean"``): the Jaccard of the prompt
  positions kvjax and the reference select, and for each selection, and for the oracle (the ``bsel`` positions with
  the most exact attention of the group), the exact attention mass of the group's query heads on what is attended
  (sinks, selection, the continuation so far) and the output error ``||o - o_exact|| / ||o_exact||``.

Equal selections with equal errors say the code is the method; the oracle's error says what a perfect selection of
the same size gives. Writes the JSON and a markdown table beside it."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kvjax"))
import bench_common as bc  # noqa: E402
import ref_clusterkv as ref  # noqa: E402


def attended_stats(q, k, v, keep) -> tuple[float, float]:
    """(exact attention mass on ``keep``, relative output error of attention restricted to it), averaged over the
    query heads ``q [G, D]``; ``k, v [T, D]`` every position the step may attend, ``keep [T]`` bool."""
    w = bc.softmax(q @ k.T / np.sqrt(q.shape[-1]))
    exact = w @ v
    mass = (w * keep).sum(-1)
    got = (w * keep) @ v / mass[:, None]
    err = np.linalg.norm(got - exact, axis=-1) / np.linalg.norm(exact, axis=-1)
    return float(mass.mean()), float(err.mean())


def markdown(data: dict) -> str:
    lines = [
        "| layer | clusters equal | selection Jaccard | mass: kvjax / reference / oracle "
        "| output error: kvjax / reference / oracle |",
        "|--:|--:|--:|--:|--:|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['layer']} | {r['clusters_equal']:.3f} | {r['jaccard']:.3f} | "
            f"{r['mass_kvjax']:.3f} / {r['mass_reference']:.3f} / {r['mass_oracle']:.3f} | "
            f"{r['err_kvjax']:.3f} / {r['err_reference']:.3f} / {r['err_oracle']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=bc.parse_budget, default=1024, help="ClusterKV's budget (tokens or a fraction)")
    bc.add_window_args(p, sequences=1)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import kvjax
    from eval import harness, perplexity
    from kvjax import engine
    from kvjax.engine import prefilled as P
    from kvjax.methods.base import Capacity
    from kvjax.methods.clusterkv import index as cluster_index

    t0 = time.perf_counter()
    model = kvjax.load_model(args.model)
    cfg, n = model.config, args.prefix
    seqs = perplexity.build(model, args.sequences, n, args.continuation, args.book)
    cap, lengths = Capacity(n, args.continuation), jnp.full((1,), n, jnp.int32)
    hkv, group = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    per: dict[int, list[dict]] = {layer: [] for layer in cfg.global_layers}
    for w, tokens in enumerate(seqs):
        pre = P.prefill_once(model, tokens[None], [len(tokens)])
        for layer in cfg.global_layers:
            m = engine.as_run(cfg, harness.make_method("clusterkv", args.budget)).at(layer)
            q, k, v = (np.asarray(x[layer, 0], np.float32) for x in (pre.q, pre.k, pre.v))  # [H, T, D]
            qp, kp, vp = (jnp.asarray(x[None, :, :n]) for x in (q, k, v))
            fresh = m.init(cfg, 1, cap, layer, model.dtype)
            st = jax.jit(lambda a, b, c, m=m, layer=layer, s0=fresh: m.prefill(s0, layer, a, b, c, lengths))(qp, kp, vp)
            chosen = jax.jit(lambda qq, m=m, layer=layer, s=st: m.selected_positions(s, layer, qq))
            sink, bsel = int(st.sinks[0]), int(st.bsel[0])
            ncl = m.clusters_for(n)
            grid = jnp.arange(n)[None]
            init = np.asarray(cluster_index.init_rows(m.seed, layer, hkv, grid, (grid >= sink) & (grid < n), st.c0))[0]
            pos, size, start = (np.asarray(x[0]) for x in (st.pos, st.csize, st.cstart))
            for h in range(hkv):
                ours = [pos[h, start[h, c] : start[h, c] + size[h, c]] for c in range(ncl)]
                mu, labels = ref.cosine_kmeans(k[h, sink:n], init[h, :ncl] - sink, m.iters)
                theirs = [sink + np.flatnonzero(labels == c) for c in range(ncl)]
                same = {tuple(sorted(c.tolist())) for c in theirs if len(c)}
                equal = np.mean([tuple(sorted(c.tolist())) in same for c in ours if len(c)])
                refc = [(mu[c], theirs[c]) for c in range(ncl)]
                stats = []
                for i in range(args.continuation):
                    t = n + i
                    qs = q[h * group : (h + 1) * group, t]  # [G, D]
                    kk, vv = k[h, : t + 1], v[h, : t + 1]
                    base = np.zeros(t + 1, bool)
                    base[:sink], base[n:] = True, True  # the sinks and the continuation so far
                    got = np.asarray(chosen(jnp.asarray(q[None, :, t])))[0, h * group]  # [S] by position
                    sel_k = np.flatnonzero(got[:n]).tolist()
                    sel_k = [x for x in sel_k if x >= sink]
                    sel_r = ref.select(qs.mean(0), refc, bsel)
                    score = bc.softmax(qs @ kk[:n].T / np.sqrt(qs.shape[-1])).mean(0)
                    score[:sink] = -1.0
                    oracle = np.argsort(-score, kind="stable")[:bsel]
                    row = {"jaccard": len(set(sel_k) & set(sel_r)) / max(len(set(sel_k) | set(sel_r)), 1)}
                    for name, sel in (("kvjax", sel_k), ("reference", sel_r), ("oracle", oracle)):
                        keep = base.copy()
                        keep[np.asarray(sel, int)] = True
                        row[f"mass_{name}"], row[f"err_{name}"] = attended_stats(qs, kk, vv, keep)
                    stats.append(row)
                per[layer].append({"clusters_equal": float(equal), **bc.mean_stats(stats, digits=4)})
            print(
                f"[clusterkv_reference_long] window {w + 1}/{len(seqs)} layer {layer}: {time.perf_counter() - t0:.0f} s"
            )
    rows = [{"layer": layer, **bc.mean_stats(rs, digits=4)} for layer, rs in per.items()]
    data = {**bc.window_fields(args), "budget": args.budget, "rows": rows}
    bc.write_measured(args.out, data, markdown, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
