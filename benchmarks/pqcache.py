"""PQCache benchmark: top-k recall on real keys, needle retrieval and decode step time vs full, in one run.

    python benchmarks/pqcache.py --length 1024 --ratios 0.2,0.1 --out benchmarks/results/pqcache_cpu.json

1. Recall (method note ``docs/notes/pqcache.md`` §8.12.9): on the embedded model's real post-RoPE keys for an
   essay prompt of ``--length`` tokens, for every layer and KV head, |PQ top-k ∩ exact top-k| / k at token ratio r,
   where the exact top-k ranks the same candidates ``[sink, L - W)`` by the same GQA rule (softmax over the candidates,
   summed over the query group) with the true keys (the authors' Oracle). The query is the prompt's last token.
2. Needle (``--needle``): the PQCache paper's needle sentence inside a Paul Graham haystack at several depths;
   greedy answer with ``full`` and with PQCache at each ratio; "found" = the answer mentions the sandwich or
   Dolores Park.
3. Agreement (``--agree N``): the retrieved sets of the default decode path (scores per code tuple, the group
   softmax's normaliser summed per tuple times its count, threshold + bit compaction; ``score_table=True``)
   against the per-slot computation it replaced (the lookup's scores per slot and query head, the normaliser
   summed per slot, ``lax.top_k``), for the last ``N`` prompt tokens' queries on every layer and KV head of the
   real keys. Both are float32; the sets may differ only where two code tuples' aggregates are within rounding.
4. Decode: compiled ``scan`` loop step time of ``full`` and PQCache (compile excluded by a warm-up run), cache
   bytes held and the K/V + index bytes each step reads (``PQCache.bytes_read_breakdown``, all layers).
JSON includes the jax version and the device. ``--random-weights`` times SmolLM2-135M shapes with random
weights (skips recall and needle).
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import kvjax
from bench_common import device_fields, time_decode_loop, write_json
from kvjax.loading import assets
from kvjax import engine, methods
from kvjax import model as M
from kvjax.methods.base import Capacity
from kvjax.methods.pqcache import PQCache

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
QUESTION = "What is the best thing to do in San Francisco?"


def layer_qk(model, ids):
    """Per layer: the last token's query ``[1, Hq, D]`` and the keys of the tokens before it ``[1, Hkv, n, D]``."""
    for qs, k in layer_qks(model, ids, 1):
        yield qs[0], k


def recall_one(method: PQCache, q, k):
    """Per KV head ``[Hkv]`` for one layer: recall of the PQ selection vs the exact (Oracle) selection, and
    mass recall: the Oracle's aggregated softmax mass on the PQ selection / its mass on its own top-k."""
    b, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    state = method.init(
        kvjax.ModelConfig(
            model_type="llama",
            vocab_size=1,
            hidden_size=hq * d,
            intermediate_size=1,
            num_layers=1,
            num_heads=hq,
            num_kv_heads=hkv,
            head_dim=d,
        ),
        b,
        Capacity(n, 1),
        0,
        jnp.float32,
    )
    lengths = jnp.asarray([n])
    state = jax.jit(lambda s, k: method.prefill(s, 0, jnp.zeros((b, hq, n, d)), k, k, lengths))(state, k)
    idx, ok = (np.asarray(x) for x in jax.jit(method.select)(state, q, lengths))
    w, kk = method.split(n)
    cand = np.arange(method.sink, n - w)
    g = hq // hkv
    qn, kn = np.asarray(q, np.float64)[0], np.asarray(k, np.float64)[0]
    out, mass = [], []
    for h in range(hkv):
        s = qn[h * g : (h + 1) * g] @ kn[h, cand].T / np.sqrt(d)
        p = np.exp(s - s.max(-1, keepdims=True))
        agg = (p / p.sum(-1, keepdims=True)).sum(0)
        top = np.argsort(-agg, kind="stable")[:kk]
        got = set(idx[0, h][ok[0, h]].tolist())
        out.append(len(set(cand[top].tolist()) & got) / max(kk, 1))
        mass.append(sum(agg[p - method.sink] for p in got) / max(agg[top].sum(), 1e-30))
    return out, mass


def layer_qks(model, ids, nq: int):
    """Per layer: the queries of the last ``nq`` tokens ``[nq, 1, Hq, D]`` and the keys of the tokens before the
    last one ``[1, Hkv, n, D]``."""
    cfg = model.config
    n = len(ids) - 1

    @jax.jit
    def run(params, tokens):
        def attend(layer, x, q, k, v, out):
            attn = M.causal_attention(q, k, v, jnp.asarray([len(ids)]), None)
            qs = jnp.moveaxis(q[:, :, n + 1 - nq : n + 1].astype(jnp.float32), 2, 0)
            return attn, out + ((qs, k[:, :, :n].astype(jnp.float32)),)

        return M.run_layers(cfg, params, M.embed(params, tokens, cfg), jnp.arange(len(ids))[None], attend, ())[1]

    yield from run(model.params, jnp.asarray([ids]))


def agree_one(method: PQCache, qs, k):
    """``(cases, differing cases, differing tokens, retrieved tokens)`` over the queries ``qs [nq, 1, Hq, D]`` and
    KV heads of one layer: ``method`` (``score_table=True``) against the per-slot path with ``lax.top_k`` on the
    same prefilled state."""
    _, _, hq, d = qs.shape
    hkv, n = k.shape[1], k.shape[2]
    cfg = kvjax.ModelConfig(
        model_type="llama",
        vocab_size=1,
        hidden_size=hq * d,
        intermediate_size=1,
        num_layers=1,
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
    )
    state = method.init(cfg, 1, Capacity(n, 1), 0, jnp.float32)
    lengths = jnp.asarray([n])
    state = jax.jit(lambda s, k: method.prefill(s, 0, jnp.zeros((1, hq, n, d)), k, k, lengths))(state, k)
    w, kk = method.split(n)

    @jax.jit
    def per_slot(state, q):  # the previous decode path: scores per slot and query head, softmax, lax.top_k
        s_hat = method.scores(state, q, jnp.asarray([n - w]))[..., method.sink :]
        cand = (jnp.arange(method.sink, method.sink + s_hat.shape[-1]) < n - w)[None, None, None, :]
        z = jnp.where(cand, s_hat / jnp.sqrt(jnp.float32(d)), -1e30)
        p = jnp.where(cand, jnp.exp(z - jnp.max(z, axis=-1, keepdims=True)), 0.0)
        agg = (p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)).sum(axis=2) if hq > hkv else z[:, :, 0]
        vals, idx = jax.lax.top_k(jnp.where(cand[:, :, 0], agg, -1e30), kk)
        return idx + method.sink, vals > -1e29

    select = jax.jit(method.select)
    cases = diff = tokens = total = 0
    for q in qs:
        a_idx, a_ok = (np.asarray(x) for x in select(state, q, lengths))
        b_idx, b_ok = (np.asarray(x) for x in per_slot(state, q))
        for h in range(hkv):
            a, b = set(a_idx[0, h][a_ok[0, h]].tolist()), set(b_idx[0, h][b_ok[0, h]].tolist())
            cases, diff, tokens, total = cases + 1, diff + (a != b), tokens + len(a ^ b) // 2, total + len(b)
    return cases, diff, tokens, total


def time_decode(model, ids, method, steps):
    cfg = model.config
    bucket = engine.bucket_length(len(ids))
    tokens, lengths = engine.pad_prompts([ids], bucket)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    step, states = time_decode_loop(model, method, tokens, lengths, Capacity(bucket, steps + 1), steps)
    row = {"step_seconds": step, "cache_bytes": sum(method.memory_bytes(s) for s in states)}
    if isinstance(method, PQCache):
        # Per part, all layers, for the next step of the final state (PQCache.bytes_read_breakdown: codes below
        # the candidate end, centroids, LUT, score buffers, gathered K/V rows, attention; ``total`` is
        # bytes_read_per_step; ``full_kv`` is what full attention over the same live slots would read).
        reads = [method.bytes_read_breakdown(s, cfg.num_heads) for s in states]
        row["bytes_read_per_step"] = {k: sum(r[k] for r in reads) for k in reads[0]}
    return row


def needle_prompt(model, length, depth):
    hay = model.tokenizer.encode(assets.essays_text(), add_special_tokens=False)
    needle = model.tokenizer.encode(" " + NEEDLE + " ", add_special_tokens=False)
    body = hay[: length - len(needle) - 64]
    cut = int(len(body) * depth)
    context = model.tokenizer.decode(body[:cut] + needle + body[cut:])
    return f"{context}\n\nAnswer using the text above. {QUESTION}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=assets.SMOLLM2_NAME)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--ratios", default="0.2,0.1")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--needle", action="store_true", help="also run the needle test")
    p.add_argument("--depths", default="0.1,0.5,0.9")
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--bits", type=int, default=6, help="bits per code for the recall measurement")
    p.add_argument("--skip-decode", action="store_true", help="recall (and needle) only")
    p.add_argument(
        "--agree",
        type=int,
        default=0,
        metavar="N",
        help="compare the retrieved sets with the per-slot path for the last N prompt queries",
    )
    p.add_argument("--out", default="benchmarks/results/pqcache.json")
    return p


def main(argv=None):
    args = _parser().parse_args(argv)
    ratios = [float(r) for r in args.ratios.split(",")]

    if args.random_weights:
        sys.path.insert(0, str(Path(__file__).parent))
        from decode import SMOLLM2_135M
        from kvjax.loading import Model, default_dtype

        cfg = SMOLLM2_135M
        model = Model(cfg, M.random_params(cfg, jax.random.PRNGKey(0), default_dtype()), None, "random")
        ids = np.random.default_rng(0).integers(0, cfg.vocab_size, args.length).tolist()
    else:
        model = kvjax.load_model(args.model)
        ids = model.tokenizer.encode(assets.essays_text())[: args.length]
    result = {
        **device_fields(),
        "python": platform.python_version(),
        "model": model.name,
        "dtype": str(model.dtype),
        "prompt_len": len(ids),
        "ratios": ratios,
        "pqcache": {"m": 2, "bits": args.bits, "sink": 32, "iters": 10},
    }

    if not args.random_weights:
        _recall(model, ids, args, ratios, result)
        if args.agree:
            _agreement(model, ids, args, ratios, result)
        if args.needle:
            _needle(model, ids, args, ratios, result)

    rows = []
    timed = (
        []
        if args.skip_decode
        else [("full", methods.get("full"))] + [(f"pqcache r={r}", PQCache(budget=r)) for r in ratios]
    )
    for name, method in tqdm(timed, desc="decode timing"):
        row = {"method": name, **time_decode(model, ids, method, args.steps)}
        rows.append(row)
    for row in rows:
        row["speedup_vs_full"] = rows[0]["step_seconds"] / row["step_seconds"]
        print(
            f"{row['method']:14s} step {row['step_seconds'] * 1e3:8.2f} ms  x{row['speedup_vs_full']:.2f}  "
            f"cache {row['cache_bytes'] / 2**20:.1f} MiB"
        )
    result["decode"] = rows
    write_json(args.out, result, indent=2)
    print(f"wrote {Path(args.out)}")


def _recall(model, ids, args, ratios, result):
    """Top-k recall (and attention-mass recall) of PQCache's retrieval per layer, at every ratio."""
    per = {r: [] for r in ratios}
    mass = {r: [] for r in ratios}
    for q, k in tqdm(layer_qk(model, ids), total=model.config.num_layers, desc="recall (layers)"):
        for r in ratios:
            rec, ms = recall_one(PQCache(budget=r, bits=args.bits), q, k)
            per[r].append(rec)
            mass[r].append(ms)
    result["recall"] = {
        str(r): {
            "mean": float(np.mean(per[r])),
            "mass_mean": float(np.mean(mass[r])),
            "per_layer": [float(np.mean(x)) for x in per[r]],
        }
        for r in ratios
    }
    for r in ratios:
        print(
            f"recall r={r}: {result['recall'][str(r)]['mean']:.3f}  "
            f"mass recall {result['recall'][str(r)]['mass_mean']:.3f}"
        )


def _agreement(model, ids, args, ratios, result):
    """Retrieved sets of the score table against the per-slot path, for the last ``--agree`` queries."""
    agree = {}
    for r in ratios:
        tot = np.zeros(4, np.int64)
        for qs, k in tqdm(layer_qks(model, ids, args.agree), total=model.config.num_layers, desc=f"agree r={r}"):
            tot += agree_one(PQCache(budget=r, bits=args.bits, score_table=True), qs, k)
        agree[str(r)] = dict(zip(("cases", "cases_differing", "tokens_differing", "tokens_retrieved"), tot.tolist()))
        print(f"agreement r={r}: {agree[str(r)]}")
    result["agreement_vs_per_slot"] = agree


def _needle(model, ids, args, ratios, result):
    """The needle test: full and PQCache at every ratio, at each depth."""
    rows = []
    for depth in tqdm([float(x) for x in args.depths.split(",")], desc="needle"):
        prompt = needle_prompt(model, args.length, depth)
        for name, method in [("full", methods.get("full"))] + [(f"pqcache r={r}", PQCache(budget=r)) for r in ratios]:
            ans = engine.generate(model, [prompt], method, max_new_tokens=24, chat=True).text[0]
            found = any(w in ans.lower() for w in ("sandwich", "dolores"))
            rows.append({"depth": depth, "method": name, "found": found, "answer": ans})
            print(f"needle depth {depth} {name:14s} found={found}  {ans[:80]!r}")
    result["needle"] = rows


if __name__ == "__main__":
    sys.exit(main())
