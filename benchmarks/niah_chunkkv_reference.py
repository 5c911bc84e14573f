"""ChunkKV on the needle prompts it fails, against the numpy reference: is it the code or the setting?

    python benchmarks/niah_chunkkv_reference.py --niah benchmarks/results/niah-gemma3-270m --budget 128 \\
        --prompts 6 --out benchmarks/results/niah-gemma3-270m/chunkkv_reference.json

For up to ``--prompts`` prompts of the ``kvjax-eval niah`` folder ``--niah`` where ``chunkkv@<budget>`` scored 0 at
``--lengths`` tokens (spread over the lengths and depths), and ``--passing`` where it scored 1 (the contrast), the
model's prefill (``kvjax.engine.prefilled.prefill_once``) gives every global layer's q and k as ChunkKV's prefill
receives them (after the QK-norm and RoPE, q times the model's query scale). On each global layer:

- the code: kvjax's ChunkKV (the folder's options, ``engine.compress_prefilled``, kept positions from
  ``kvjax.analysis.mask_from_states``) against the independent numpy reference of ChunkKV (Liu et al. 2025, Alg. 1;
  ``tests/kvjax/ref_chunkkv.py``, float64, explicit loops) with the same window, chunk size, budget and mode, on the
  positions of the layer that selects them (Alg. 2, ``reuse_leader``): per KV head, whether the kept sets are equal,
  their Jaccard, and where not, whether the reference run on kvjax's own float32 votes gives kvjax's set and how
  close the last kept and the first dropped chunk score (a tie or float rounding at the cut);
- the setting: the rank (1 = best) of the chunks holding the needle answer's tokens among the reference's chunk
  scores against the number of chunks kept, and the share of the observation window's votes on the first token,
  the needle sentence (and on its answer), the question and the window itself; which prompt tokens the window's
  queries are (decoded).

Writes the JSON and a markdown table beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "tests" / "kvjax"))  # the numpy reference (after kvjax, which the folder's name shadows)

import bench_common as B  # noqa: E402
from niah_chelsea_reference import needle_span  # noqa: E402
from niah_kept import answer_span  # noqa: E402


def spread(items: list, n: int) -> list:
    """``n`` of ``items`` evenly spaced from the first to the last (all of them when there are at most ``n``)."""
    if n <= 0:
        return []
    if len(items) <= n:
        return list(items)
    if n == 1:
        return [items[0]]
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


def pick(rows: list[dict], lengths: list[int], n: int) -> list[dict]:
    """``n`` rows shared out over ``lengths`` (the first lengths take the remainder), each length's spread over
    its rows in the order given."""
    out = []
    for i, length in enumerate(lengths):
        share = n // len(lengths) + (i < n % len(lengths))
        out += spread([r for r in rows if r["length"] == length], share)
    return out


def chunk_ranks(scores: np.ndarray, chunks) -> list[int]:
    """The rank (1 = best) of each chunk of ``chunks`` among ``scores``, ties to the lower chunk index (as the
    reference's and kvjax's top-k break them)."""
    order = np.argsort(-np.asarray(scores), kind="stable")
    rank = np.empty(len(order), int)
    rank[order] = np.arange(1, len(order) + 1)
    return [int(rank[c]) for c in chunks]


def cut_gap(scores: np.ndarray, n: int) -> float | None:
    """How close the chunk selection's cut is: (the ``n``-th best score - the ``n+1``-th) / the ``n``-th best
    (0 = a tie at the cut); None where every chunk is kept."""
    s = np.sort(np.asarray(scores, np.float64))[::-1]
    if n <= 0 or n >= len(s):
        return None
    return float((s[n - 1] - s[n]) / abs(s[n - 1])) if s[n - 1] else float(s[n - 1] - s[n])


def compare_kept(got, want) -> dict:
    """kvjax's kept positions ``got`` against the reference's ``want`` (each in storage order): set equality,
    the same storage order, the Jaccard and the positions only one of them keeps."""
    a, b = set(int(x) for x in got), set(int(x) for x in want)
    return {
        "equal": a == b,
        "same_order": [int(x) for x in got] == [int(x) for x in want],
        "jaccard": 1.0 if not (a | b) else round(len(a & b) / len(a | b), 4),
        "only_kvjax": sorted(a - b),
        "only_reference": sorted(b - a),
    }


def vote_shares(votes: np.ndarray, parts: dict[str, list[int]]) -> dict[str, float]:
    """The share of ``votes [T]`` (one KV head's, over the prompt) on each named list of positions, and on the
    rest (``"rest"``)."""
    total = float(votes.sum())
    out, taken = {}, np.zeros(len(votes), bool)
    for name, pos in parts.items():
        out[name] = round(float(votes[pos].sum()) / total, 4)
        taken[pos] = True
    out["rest"] = round(float(votes[~taken].sum()) / total, 4)
    return out


def tail_length(prompt: list[int], ids: list[int]) -> int:
    """How many of the last tokens of ``prompt`` are ``ids`` (its longest suffix that ``prompt`` ends with)."""
    for cut in range(len(ids)):
        part = ids[cut:]
        if list(prompt[-len(part) :]) == list(part):
            return len(part)
    return 0


def chunk_places(chunks, chunk: int, places: dict[str, range]) -> dict[str, int]:
    """How many of ``chunks`` (indices, ``chunk`` tokens each, aligned to position 0) overlap each named range of
    positions (the first that a chunk overlaps, in the order given), the others counted as ``"haystack"``."""
    out = dict.fromkeys([*places, "haystack"], 0)
    for i in chunks:
        span = range(i * chunk, (i + 1) * chunk)
        where = next((name for name, r in places.items() if span.start < r.stop and r.start < span.stop), "haystack")
        out[where] += 1
    return out


def summary(rows: list[dict], layers: list[int]) -> list[dict]:
    """Per global layer and outcome (the run's score): n (prompt x KV head), kept sets equal to the reference,
    the mean Jaccard, the median and best rank of the needle answer's worst chunk, how often every answer chunk
    ranks within the chunks kept, and the mean vote share of the needle sentence and the question."""
    out = []
    for layer in layers:
        for score in (0.0, 1.0):
            mine = [r for r in rows if r["layer"] == layer and r["score"] == score]
            if not mine:
                continue
            worst = [max(r["answer_chunk_ranks"]) for r in mine]
            out.append(
                {
                    "layer": layer,
                    "score": score,
                    "n": len(mine),
                    "equal": sum(r["equal"] for r in mine),
                    "mean_jaccard": round(float(np.mean([r["jaccard"] for r in mine])), 4),
                    "chunks_kept": sorted({r["chunks_kept"] for r in mine}),
                    "median_worst_answer_rank": float(np.median(worst)),
                    "best_worst_answer_rank": int(min(worst)),
                    "answer_chunks_all_kept": sum(w <= r["chunks_kept"] for w, r in zip(worst, mine)),
                    "needle_vote_share": round(float(np.mean([r["vote_share"]["needle"] for r in mine])), 4),
                    "answer_vote_share": round(float(np.mean([r["answer_vote_share"] for r in mine])), 4),
                    "question_vote_share": round(float(np.mean([r["vote_share"]["question"] for r in mine])), 4),
                    "first_token_vote_share": round(float(np.mean([r["vote_share"]["first"] for r in mine])), 4),
                    "kept_chunks_in": {
                        p: int(sum(r["kept_chunks_in"][p] for r in mine)) for p in mine[0]["kept_chunks_in"]
                    },
                }
            )
    return out


def markdown(data: dict) -> str:
    gaps = [r["cut_gap"] for r in data["rows"] if r["cut_gap"] is not None] or [float("nan")]
    out = [
        f"ChunkKV ({data['config']}, window {data['options']['window']}, chunk {data['options']['chunk_size']}, "
        f"{data['options']['mode']}, reuse {data['options']['reuse']}) against the numpy reference of Alg. 1 "
        f"on {data['model']}'s global layers {data['global_layers']}; ranks among the reference's chunk scores.",
        "",
        f"Kept sets equal to the reference's in {sum(r['equal'] for r in data['rows'])} of {len(data['rows'])} "
        f"(prompt, layer, KV head), in the same storage order in {sum(r['same_order'] for r in data['rows'])}; "
        f"largest |kvjax's float32 votes - the reference's float64 votes| "
        f"{max(r['max_vote_difference'] for r in data['rows']):.1e}; closest cut (relative gap between the last "
        f"kept and the first dropped chunk score) {min(gaps):.1e}.",
        "",
        "| layer | run's score | n | kept sets equal | mean Jaccard | chunks kept | median rank of the answer's "
        "worst chunk | best | answer chunks all within the kept | votes on the needle sentence | on its answer "
        "| on the question | on the first token |",
        "|--:|--:|--:|--:|--:|--|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for s in data["summary"]:
        out.append(
            f"| {s['layer']} | {s['score']:.0f} | {s['n']} | {s['equal']} | {s['mean_jaccard']:.3f} | "
            f"{','.join(map(str, s['chunks_kept']))} | {s['median_worst_answer_rank']:g} | "
            f"{s['best_worst_answer_rank']} | {s['answer_chunks_all_kept']} | {s['needle_vote_share']:.3f} | "
            f"{s['answer_vote_share']:.3f} | "
            f"{s['question_vote_share']:.3f} | {s['first_token_vote_share']:.3f} |"
        )
    out += [
        "",
        "Where the kept chunks lie (all prompts and KV heads of a row above; `start`: the chunk of the first token, "
        "`needle`: one overlapping the needle sentence, `question`: one overlapping the question or the answer "
        "prefix before the window):",
        "",
        "| layer | run's score | " + " | ".join(data["summary"][0]["kept_chunks_in"]) + " |",
        "|--:|--:|" + "--:|" * len(data["summary"][0]["kept_chunks_in"]),
        *[
            f"| {s['layer']} | {s['score']:.0f} | " + " | ".join(map(str, s["kept_chunks_in"].values())) + " |"
            for s in data["summary"]
        ],
        "",
        "| length | depth | needle | score | chunks | layer: ranks of the answer's chunks / of the needle sentence's "
        "chunks (kept set equal to the reference's) |",
        "|--:|--:|--:|--:|--:|--|",
    ]
    for p in data["prompts"]:
        mine = [r for r in data["rows"] if [r["length"], r["depth"], r["needle"]] == list(p["cell"])]
        cells = "; ".join(
            f"{r['layer']}: {','.join(map(str, r['answer_chunk_ranks']))} / "
            f"{','.join(map(str, r['needle_chunk_ranks']))} ({'=' if r['equal'] else 'differs'})"
            for r in mine
        )
        out.append(
            f"| {p['cell'][0]} | {p['cell'][1]:g} | {p['cell'][2]} | {p['score']:.0f} | {p['chunks']} | {cells} |"
        )
    out += ["", "Observation window (the last prompt tokens, decoded):", ""]
    for text in dict.fromkeys(p["window_text"] for p in data["prompts"]):
        covers = [p["window_covers"] for p in data["prompts"] if p["window_text"] == text][0]
        out.append(f"- `{text!r}`: {covers}")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--niah", required=True, help="a kvjax-eval niah folder that ran chunkkv")
    ap.add_argument("--out", required=True, help="the JSON to write (and .md beside it)")
    ap.add_argument("--budget", default="128", help="ChunkKV's budget in the folder (a token count or a fraction)")
    ap.add_argument("--lengths", default="1024,2048", help="the prompts' lengths in tokens (comma-separated)")
    ap.add_argument("--prompts", type=int, default=6, help="failing prompts examined")
    ap.add_argument("--passing", type=int, default=4, help="prompts it answered, examined beside them")
    a = ap.parse_args(argv)

    import jax.numpy as jnp

    import kvjax
    import ref_chunkkv as ref
    from eval import harness, niah, rowstore
    from kvjax import analysis, engine
    from kvjax.engine import prefilled as P
    from kvjax.budget import budget_tokens
    from kvjax.methods.base import Capacity
    from kvjax.methods.core.scorers import make_scorer

    budget = float(a.budget) if "." in a.budget else int(a.budget)
    lengths = [int(x) for x in a.lengths.split(",")]
    settings = rowstore.read_settings(a.niah, "needle-in-a-haystack run", "kvjax-eval niah")
    key = niah.config_key("chunkkv", budget)
    records = rowstore.read_jsonl(Path(a.niah) / rowstore.ROWS)[1:]
    mine = [r for rec in records for r in rec["rows"] if r["config"] == key and r["length"] in lengths]
    chosen = pick([r for r in mine if r["score"] == 0], lengths, a.prompts)
    chosen += pick([r for r in mine if r["score"] == 1], lengths, a.passing)
    if not chosen:
        raise SystemExit(f"{a.niah}: no {key} prompt of {lengths} tokens")
    options = settings.get("options", {}).get("chunkkv")
    model = kvjax.load_model(settings["model"])
    cfg, tok = model.config, model.tokenizer
    method = harness.make_method("chunkkv", budget, options)
    run = engine.as_run(cfg, method)
    w, c, mode = method.window, method.chunk_size, method.mode
    if method.scorer != "snapkv":
        raise SystemExit(f"the reference scores with the observation window; the folder's scorer is {method.scorer}")
    global_layers = list(cfg.global_layers)
    gamma = settings["max_new_tokens"]
    rows, prompts, t0 = [], [], time.perf_counter()
    for r in chosen:
        e = niah.build_example(model, r["length"], r["depth"], r["needle"], settings["chat"])
        prompt, needle = list(e.prompt), niah.NEEDLES[r["needle"]]
        n = len(prompt)
        bucket = engine.bucket_length(r["length"])
        tokens, lengths_b = engine.pad_prompts([prompt], bucket)
        pre = P.prefill_once(model, tokens, lengths_b)
        states = engine.init_states(cfg, run, 1, Capacity(bucket, gamma), model.dtype)
        states, _ = engine.compress_prefilled(cfg, run, pre, states, tokens, np.asarray(lengths_b))
        held = engine.layer_states(states)
        mask = analysis.mask_from_states([held[l] for l in global_layers], lengths_b, bucket).mask  # [L, 1, H, T]
        answer = answer_span(prompt, tok.encode(" " + needle.answer))
        sentence = list(needle_span(prompt, tok.encode(needle.sentence)))
        question = list(needle_span(prompt, tok.encode(needle.question)))
        window_pos = list(range(n - w, n))
        in_prefix = tail_length(prompt, tok.encode(needle.prefix))
        parts = {"first": [0], "needle": sentence, "question": question, "window": window_pos}
        places = {"start": range(1), "needle": range(sentence[0], sentence[-1] + 1), "question": range(question[0], n)}
        tokens_budget = budget if isinstance(budget, int) else math.ceil(budget * n)  # kvjax.budget.budget_tokens
        slots = int(np.asarray(held[global_layers[0]].pos).shape[-1])
        for li, layer in enumerate(global_layers):
            leader = ref.reuse_leader(layer, method.reuse)  # Alg. 2: the layer whose positions this one keeps
            q = np.asarray(pre.q[leader][0, :, :n], np.float64)
            k = np.asarray(pre.k[leader][0, :, :n], np.float64)
            votes = ref.observation_votes(q, k, n, w)
            want, scores, nsel = ref.chunkkv_keep(q, k, n, w, c, tokens_budget, mode, votes=votes)
            budgets = jnp.minimum(budget_tokens(method.budget, jnp.asarray(lengths_b)), slots)
            windows = method.windows(budgets)
            scorer = make_scorer(method.scorer, w, kernel=1)  # what ChunkKV.select scores with
            kv_votes = scorer(pre.q[leader], pre.k[leader], jnp.asarray(lengths_b), jnp.asarray(lengths_b) - windows)
            kv_votes = np.asarray(kv_votes[0, :, :n], np.float64)
            pos = np.asarray(held[layer].pos)[0]
            for h in range(cfg.num_kv_heads):
                got = [int(x) for x in pos[h] if 0 <= x < n]
                cmp = compare_kept(got, want[h])
                on_kv_votes = ref.chunkkv_keep(q, k, n, w, c, tokens_budget, mode, votes=kv_votes)[0][h]
                limit = n - w if mode == "prefix_exclusive" else n
                answer_chunks = sorted({p // c for p in answer if p < limit})
                ranks = chunk_ranks(scores[h], answer_chunks)
                kept_chunks = ref.top_chunks(scores[h], nsel)
                rows.append(
                    {
                        "length": r["length"],
                        "depth": r["depth"],
                        "needle": r["needle"],
                        "score": r["score"],
                        "layer": layer,
                        "leader": leader,
                        "kv_head": h,
                        **cmp,
                        "equal_on_kvjax_votes": set(got) == set(on_kv_votes),
                        "max_vote_difference": float(np.abs(kv_votes[h] - votes[h]).max()),
                        "cut_gap": cut_gap(scores[h], nsel),
                        "chunks": len(scores[h]),
                        "chunks_kept": nsel,
                        "answer_chunks": answer_chunks,
                        "answer_chunk_ranks": ranks,
                        "answer_kept_by_kvjax": round(float(mask[li, 0, h, answer].mean()), 3),
                        "needle_chunk_ranks": chunk_ranks(scores[h], sorted({p // c for p in sentence if p < limit})),
                        "vote_share": vote_shares(votes[h], parts),
                        "answer_vote_share": vote_shares(votes[h], {"answer": answer})["answer"],
                        "kept_chunk_starts": [i * c for i in kept_chunks],
                        "kept_chunks_in": chunk_places(kept_chunks, c, places),
                        "best_chunks_text": [
                            tok.decode(prompt[i * c : min((i + 1) * c, limit)])
                            for i in np.argsort(-scores[h], kind="stable")[:3]
                        ],
                    }
                )
                print(json.dumps({k_: rows[-1][k_] for k_ in list(rows[-1])[:16]}), flush=True)
        prompts.append(
            {
                "cell": [r["length"], r["depth"], r["needle"]],
                "score": r["score"],
                "prompt_tokens": n,
                "chunks": len(scores[0]),
                "answer_positions": answer,
                "needle_positions": [sentence[0], sentence[-1]],
                "question_positions": [question[0], question[-1]],
                "window_text": tok.decode(prompt[n - w :]),
                "window_tokens": [tok.decode([t]) for t in prompt[n - w :]],
                "window_covers": f"{min(w, in_prefix)} of {w} tokens in the answer prefix {needle.prefix!r} "
                f"(its last {in_prefix} tokens end the prompt), {max(0, w - in_prefix)} before it "
                f"(the question ends at {question[-1]}, the window starts at {n - w})",
            }
        )
        print(f"[niah_chunkkv_reference] {len(prompts)}/{len(chosen)}: {time.perf_counter() - t0:.0f} s", flush=True)
    data = {
        "what": "ChunkKV's prefill on needle prompts it fails (and some it answers), against the numpy reference "
        "of Alg. 1, with where the needle's chunks rank",
        "niah": a.niah,
        "model": settings["model"],
        "config": key,
        "options": {"window": w, "chunk_size": c, "mode": mode, "reuse": method.reuse, "scorer": method.scorer},
        "budget_tokens": tokens_budget,
        "global_layers": global_layers,
        "lengths": lengths,
        "all_equal": all(x["equal"] for x in rows),
        "summary": summary(rows, global_layers),
        "prompts": prompts,
        "rows": rows,
    }
    B.write_measured(a.out, data, markdown, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
