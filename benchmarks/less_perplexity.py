"""LESS vs its sparse policy at equal memory: streaming perplexity of held-out text (LESS paper, Table 2 setting).

    kvjax-train-less --out runs/less-h2o --seq-len 256 --num-seqs 24 --epochs 5 --batch 2 --hidden 128
    python benchmarks/less_perplexity.py --kernels runs/less-h2o --out benchmarks/results/less_perplexity_cpu.json

Methods, all at the trained kernels' policy and budget (``less_config.json``):
- Full; Baseline = the sparse policy alone (e.g. H2O with ``budget`` tokens);
- Baseline+ = the same policy with the extra tokens that take the bytes of LESS's state
  (``policy.baseline_plus_budget`` in the kernels' config: H [R, D] + z [R] per KV head = R(D+1)/(2D) tokens);
- LESS = the policy plus the learned low-rank state (``methods.get("less", kernels=...)``).
Held-out text (never in the training data, ``train_less.data.heldout_sources``): the Gospel of John and the last
essays. Each sequence is ``--prefix`` prefilled tokens then ``--continuation`` teacher-forced tokens through the
jitted decode step, so the cache is compressed as the text is consumed (``eval.perplexity.streaming_nll``).
JSON: perplexity per method and text, the gap closed ``(ppl_base - ppl_less) / (ppl_base - ppl_full)``, the
jax version and the device.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvjax  # noqa: E402
from bench_common import write_json  # noqa: E402
from eval import perplexity  # noqa: E402
from kvjax import methods  # noqa: E402
from train_less import data  # noqa: E402


def heldout_windows(tok, which: str, n: int, length: int) -> np.ndarray:
    docs = data.heldout_sources()[which]
    seqs = data.windows(tok, docs, length, n)
    if seqs.shape[0] < n:
        raise ValueError(f"held-out {which} text gives {seqs.shape[0]} windows of {length} tokens, fewer than {n}")
    return seqs[:n]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", required=True, help="output folder of kvjax-train-less")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prefix", type=int, default=32)
    p.add_argument("--continuation", type=int, default=224)
    p.add_argument("--sequences", type=int, default=8, help="per held-out text")
    p.add_argument("--out", default="benchmarks/results/less_perplexity.json")
    args = p.parse_args(argv)

    meta = json.loads((Path(args.kernels) / "less_config.json").read_text())
    pol = meta["policy"]
    opts = {"recent": pol["recent"]} if pol["policy"] == "h2o" else {"sinks": pol["sinks"]}
    sparse = "h2o" if pol["policy"] == "h2o" else "streaming_llm"
    ms = {
        "full": methods.get("full"),
        "baseline": methods.get(sparse, budget=pol["budget"], **opts),
        "baseline+": methods.get(sparse, budget=pol["baseline_plus_budget"], **opts),
        "less": methods.get("less", policy=pol["policy"], budget=pol["budget"], kernels=args.kernels, **opts),
    }
    model = kvjax.load_model(args.model)
    out = {
        "jax_version": jax.__version__,
        "device": str(jax.devices()[0]),
        "platform": platform.platform(),
        "model": model.name,
        "kernels": args.kernels,
        "kernel_config": meta["kernel"],
        "train": meta["train"],
        "policy": pol,
        "prefix": args.prefix,
        "continuation": args.continuation,
        "sequences": args.sequences,
        "methods": {k: repr(m) for k, m in ms.items()},
        "perplexity": {},
        "seconds": {},
    }
    for which in ("bible", "essays"):
        seqs = heldout_windows(model.tokenizer, which, args.sequences, args.prefix + args.continuation)
        ppl = {}
        for name, m in ms.items():
            t0 = time.perf_counter()
            ppl[name] = perplexity.perplexity(perplexity.streaming_nll(model, m, seqs, args.prefix))
            out["seconds"][f"{which}/{name}"] = time.perf_counter() - t0
            print(
                f"{which:7s} {name:10s} ppl {ppl[name]:8.3f}  ({out['seconds'][f'{which}/{name}']:.0f}s)",
                file=sys.stderr,
            )
        gap = ppl["baseline"] - ppl["full"]
        out["perplexity"][which] = {
            **ppl,
            "gap_closed_by_less": (ppl["baseline"] - ppl["less"]) / gap if gap else None,
            "gap_closed_by_baseline+": (ppl["baseline"] - ppl["baseline+"]) / gap if gap else None,
        }
    write_json(args.out, out)
    print(json.dumps(out["perplexity"], indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
