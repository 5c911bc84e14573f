"""ClusterKV's GQA rules side by side: ``gqa="query"`` (the authors' per-query-head selection) vs ``"group_mean"``
(one selection per KV head, kvjax's default), on the embedded SmolLM2-135M (9 query / 3 KV heads).

    python benchmarks/clusterkv_gqa.py 4096 256,1024,2048     # prompt tokens, base budgets (about 5 minutes)

An essay prompt runs once with full attention; its per-layer q, k, v feed each compressed layer (2-29) through
the method's own ``prefill``, then 4 decode probes (``selected_positions`` before each ``decode``). Per base
budget B: ``query`` at B, ``group_mean`` at B, and ``group_mean`` at the bytes ``query`` read (B times the
measured union). Reported, averaged over layers, probes and query heads: the top-B recall of ClusterKV's Fig. 11
(``eval.fidelity.topb_recall``: B = the tokens attended), the coverage of the exact top-B of the *base* budget
(the same target for all three), the prompt's attention mass the selection holds, and for ``query`` the union of
the group's selections (what a step reads once per KV head) over one head's selection. JSON:
``clusterkv_gqa_<n>.json`` in the current folder.
"""

import sys, json, time
import jax, jax.numpy as jnp, numpy as np
import kvjax
from kvjax import methods, model as M
from kvjax.methods.base import Capacity
from eval.fidelity import essay_prompt, topb_recall

n_total = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
budgets = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "256,1024,2048").split(",")]
probes = 4
mdl = kvjax.load_model("smollm2-135m-instruct", dtype=jnp.float32)
cfg = mdl.config
ids = essay_prompt(mdl, n_total)
n = n_total - probes
tokens = jnp.asarray([ids], jnp.int32)


@jax.jit
def capture(params, tokens):
    def attend(layer, x, q, k, v, out):
        return M.causal_attention(q, k, v), out + [(q, k, v)]

    return M.run_layers(cfg, params, M.embed(params, tokens, cfg), jnp.arange(tokens.shape[1])[None], attend, [])[1]


@jax.jit
def extra(sel, qi, kk, K):
    """coverage of the exact top-K (per query head) and attention mass over the prompt held by sel [1, Hq, S]."""
    b, hq, d = qi.shape
    hkv = kk.shape[1]
    logits = jnp.einsum("bhgd,bhtd->bhgt", qi.reshape(b, hkv, hq // hkv, d), kk, precision="highest").reshape(
        b, hq, -1
    ) / np.sqrt(d)
    s = sel[..., :n]
    rank = jnp.argsort(jnp.argsort(-logits, axis=-1, stable=True), axis=-1)
    cov = jnp.sum(s & (rank < K), -1) / K
    p = jax.nn.softmax(logits, -1)
    return cov.mean(), jnp.sum(jnp.where(s, p, 0.0), -1).mean()


qkv = capture(mdl.params, tokens)
layers = list(range(2, cfg.num_layers))
rows = []
for base in budgets:
    configs = [("query", base), ("group_mean", base)]
    union = None
    for gqa, budget in configs + [(None, None)]:
        if gqa is None:  # group_mean at the bytes query mode read
            gqa, budget = "group_mean", int(round(base * union))
        meth = methods.get("clusterkv", budget=budget, gqa=gqa)
        recs, covs, mass, unions, t0 = [], [], [], [], time.time()
        pre = jax.jit(lambda s, l, q, k, v: meth.prefill(s, l, q, k, v, jnp.array([n])))
        sel_fn = jax.jit(lambda s, l, qi: meth.selected_positions(s, l, qi))
        dec = jax.jit(lambda s, l, qi, ki, vi, p: meth.decode(s, l, qi, ki, vi, p)[1])
        rec_fn = jax.jit(lambda sel, qi, kk: topb_recall(sel, qi, kk, n))
        for layer in layers:
            q, k, v = qkv[layer]
            L = jnp.int32(layer)
            st = meth.init(cfg, 1, Capacity(n, probes + 1), layer, jnp.float32)
            st = pre(st, L, q[:, :, :n], k[:, :, :n], v[:, :, :n])
            for i in range(probes):
                qi = q[:, :, n + i]
                sel = sel_fn(st, L, qi)
                recs.append(float(np.asarray(rec_fn(sel, qi, k[:, :, :n])).mean()))
                c, ms = extra(sel, qi, k[:, :, :n], base)
                covs.append(float(c))
                mass.append(float(ms))
                if gqa == "query":
                    s = np.asarray(sel)[0, :, :n].reshape(cfg.num_kv_heads, -1, n)
                    unions.append(s.any(1).sum(-1).mean() / s.sum(-1).mean())
                st = dec(st, L, qi, k[:, :, n + i], v[:, :, n + i], jnp.array([n + i]))
        if unions:
            union = float(np.mean(unions))
        r = {
            "gqa": gqa,
            "budget": budget,
            "base": base,
            "n": n,
            "topb_recall": float(np.mean(recs)),
            f"top{base}_coverage": float(np.mean(covs)),
            "attention_mass": float(np.mean(mass)),
            "union_over_selection": float(np.mean(unions)) if unions else None,
        }
        rows.append(r)
        print(r, f"{time.time() - t0:.0f}s", flush=True)
json.dump(
    {
        "jax_version": jax.__version__,
        "device": str(jax.devices()[0]),
        "model": "smollm2-135m-instruct",
        "command": " ".join(sys.argv),
        "rows": rows,
    },
    open(f"clusterkv_gqa_{n_total}.json", "w"),
    indent=1,
)
