"""Measure LESS on the embedded model: train kernels, then held-out perplexity for Full, Baseline (H2O),
Baseline+ (H2O with the memory of H as R/2 extra tokens) and LESS, teacher-forced through
``kvjax.engine.prefill`` / ``decode_step`` (1-token prompt, then every token streamed through the compressed
cache — the setting the kernels were trained on).

    python -m train_less.measure --out /tmp/less-run --seq-len 256 --budget 26 --num-seqs 16 --epochs 2
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax import engine, methods
from kvjax.methods.base import Capacity
from train_less import cli, data


@jax.jit
def _logprob(logits, target):
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), target[:, None], axis=-1)[:, 0]


def teacher_forced_nll(model, method, seqs: np.ndarray):
    """Mean NLL per sequence of tokens 1..S-1, and the cache bytes per sequence."""
    n, s = seqs.shape
    bucket = engine.MIN_BUCKET
    states = engine.init_states(model.config, method, n, Capacity(bucket, s), model.dtype)
    cache_bytes = engine.memory_bytes(method, states) // n
    tokens = np.zeros((n, bucket), np.int32)
    tokens[:, 0] = seqs[:, 0]
    lengths = jnp.ones((n,), jnp.int32)
    states, logits = engine.prefill(model.config, method, model.params, jnp.asarray(tokens), lengths, states)
    nll = []
    for t in range(1, s):
        target = jnp.asarray(seqs[:, t])
        nll.append(-np.asarray(_logprob(logits, target)))
        if t < s - 1:
            logits, states = engine.decode_step(
                model.config, method, model.params, states, target, jnp.full((n,), t, jnp.int32)
            )
    return np.stack(nll, 1).mean(1), cache_bytes


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--budget", type=int, default=26)
    p.add_argument("--num-seqs", type=int, default=16)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--eval-seqs", type=int, default=8)
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more kvjax-train-less arguments")
    a = p.parse_args(argv)
    train_args = [
        "--out",
        a.out,
        "--seq-len",
        str(a.seq_len),
        "--budget",
        str(a.budget),
        "--num-seqs",
        str(a.num_seqs),
        "--epochs",
        str(a.epochs),
        *a.extra,
    ]
    t0 = time.perf_counter()
    if not a.skip_train:
        cli.main(train_args)
    train_wall = time.perf_counter() - t0
    meta = json.loads(open(f"{a.out}/less_config.json").read())
    rank = meta["kernel"]["rank"]
    model = kvjax.load_model("smollm2-135m-instruct")
    seqs = data.sequences(model.tokenizer, data.heldout_sources(), a.seq_len, a.eval_seqs)
    runs = {
        "full": methods.get("full"),
        f"h2o (Baseline, {a.budget} tokens)": methods.get("h2o", budget=a.budget),
        f"h2o (Baseline+, {a.budget + rank // 2} tokens)": methods.get("h2o", budget=a.budget + rank // 2),
        f"less (h2o {a.budget} tokens + H, R={rank})": methods.get(
            "less", policy="h2o", budget=a.budget, kernels=a.out
        ),
    }
    result = {
        "train_command": "kvjax-train-less " + " ".join(train_args),
        "train_wall_seconds": train_wall,
        "epochs_done": meta["epochs_done"],
        "eval_sequences": int(seqs.shape[0]),
        "seq_len": a.seq_len,
        "val_loss_mean": float(np.mean(meta["val_loss"])),
        "val_loss_sparse_mean": float(np.mean(meta["val_loss_sparse"])),
        "val_loss_baseline_plus_mean": float(np.mean(meta["val_loss_baseline_plus"])),
        "jax": jax.__version__,
        "device": str(jax.devices()[0]),
        "ppl": {},
    }
    for name, m in runs.items():
        t = time.perf_counter()
        nll, nbytes = teacher_forced_nll(model, m, seqs)
        # sequences alternate essays / John (round-robin)
        result["ppl"][name] = {
            "ppl": math.exp(float(nll.mean())),
            "ppl_essays": math.exp(float(nll[0::2].mean())),
            "ppl_bible": math.exp(float(nll[1::2].mean())),
            "cache_bytes_per_seq": int(nbytes),
            "seconds": time.perf_counter() - t,
        }
        print(name, result["ppl"][name], flush=True)
    full = result["ppl"]["full"]["ppl"]
    names = list(runs)
    base, plus, less = (result["ppl"][n]["ppl"] for n in names[1:])
    result["gap_closed_vs_baseline"] = (base - less) / (base - full) if base != full else None
    result["gap_closed_baseline_plus_vs_baseline"] = (base - plus) / (base - full) if base != full else None
    with open(f"{a.out}/measure.json", "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
