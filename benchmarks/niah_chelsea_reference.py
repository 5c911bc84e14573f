"""Chelsea on the needle prompts it fails, against the numpy reference: is it the code or the setting?

    python benchmarks/niah_chelsea_reference.py --niah benchmarks/results/niah-gemma3-270m \
        --out benchmarks/results/niah-gemma3-270m/chelsea_reference.json

For up to ``--prompts`` prompts of the ``kvjax-eval niah`` folder ``--niah`` where ``chelsea@<budget>`` scored 0 at
``--length`` tokens, the model's prefill (``kvjax.engine.prefilled.prefill_once``) gives every global layer's keys and
values; Chelsea's prefill (the folder's options: its needle settings) merges them, and so does the independent numpy
reference of Alg. 1 (``tests/kvjax/ref_chelsea.py``, float64, explicit loops) with the same budget, windows, chunk and
schedule. Per prompt, layer and KV head the JSON records whether the slot counts are equal and the largest key
difference (the code), and, by merging the one-hot rows of the positions with the reference (a slot's row is then the
weight of each prompt token in it), into how many slots the needle sentence's tokens went, how many of them kept a
token alone, and the slots' counts (the setting: how much of the needle the merges average away).
"""

from __future__ import annotations

import argparse
import json
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "tests" / "kvjax"))  # the numpy reference (after kvjax, which the folder's name shadows)

import bench_common as B  # noqa: E402


def needle_span(prompt: list[int], needle: list[int]) -> range:
    """The positions of the needle sentence's tokens in the prompt (its first token may merge with the space before:
    matched from its second)."""
    body = needle[1:]
    for s in range(len(prompt) - len(body) + 1):
        if prompt[s : s + len(body)] == body:
            return range(s - 1, s + len(body))
    raise ValueError("the needle sentence is not in the prompt")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--niah", required=True, help="a kvjax-eval niah folder that ran chelsea")
    ap.add_argument("--out", required=True, help="the JSON to write")
    ap.add_argument("--length", type=int, default=1024, help="the prompts' length in tokens")
    ap.add_argument("--budget", type=float, default=0.25, help="Chelsea's budget in the folder")
    ap.add_argument("--prompts", type=int, default=4, help="failing prompts examined")
    a = ap.parse_args(argv)

    import jax.numpy as jnp

    import kvjax
    import ref_chelsea as ref
    from eval import niah, rowstore
    from kvjax.engine import pad_prompts
    from kvjax.engine import prefilled as P
    from kvjax.methods.chelsea import schedule as chelsea_schedule
    from kvjax.methods.base import Capacity

    settings = rowstore.read_settings(a.niah, "needle-in-a-haystack run", "kvjax-eval niah")
    key = niah.config_key("chelsea", a.budget)
    records = rowstore.read_jsonl(Path(a.niah) / rowstore.ROWS)[1:]
    failed = [r for rec in records for r in rec["rows"] if r["config"] == key and r["length"] == a.length]
    failed = [r for r in failed if r["score"] == 0][: a.prompts]
    if not failed:
        raise SystemExit(f"{a.niah}: no {key} prompt of {a.length} tokens scored 0")
    options = settings["options"].get("chelsea", {})
    model = kvjax.load_model(settings["model"])
    method = kvjax.methods.get(
        "chelsea", budget=a.budget, **{k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    )
    r_init, alpha, m_sched = (
        chelsea_schedule.PRESETS[method.schedule] if isinstance(method.schedule, str) else method.schedule
    )
    schedule = (Fraction(r_init).limit_denominator(1000), Fraction(alpha).limit_denominator(1000), m_sched)
    global_layers = list(model.config.global_layers)
    gamma = settings["max_new_tokens"]
    out = []
    for r in failed:
        e = niah.build_example(model, r["length"], r["depth"], r["needle"], settings["chat"])
        prompt = list(e.prompt)
        n = len(prompt)
        tokens, lengths = pad_prompts([prompt], a.length)
        pre = P.prefill_once(model, tokens, lengths)
        span = needle_span(prompt, model.tokenizer.encode(niah.NEEDLES[r["needle"]].sentence))
        budget = int(np.floor(Fraction(a.budget).limit_denominator(10000) * (n + gamma)))
        for layer in global_layers:
            st = method.init(model.config, 1, Capacity(a.length, gamma), layer, jnp.float32)
            st = method.prefill(st, layer, pre.q[layer], pre.k[layer], pre.v[layer], jnp.asarray(lengths))
            held = int(np.asarray(st.length)[0])
            for h in range(model.config.num_kv_heads):
                k = np.asarray(pre.k[layer][0, h, :n])
                v = np.asarray(pre.v[layer][0, h, :n])
                cfg = (method.n_sink, method.n_recent, method.chunk)
                K2, _, N2 = ref.chelsea_call(k, v, np.ones(n), budget, *cfg, schedule=schedule)
                _, member, _ = ref.chelsea_call(k, np.eye(n), np.ones(n), budget, *cfg, schedule=schedule)
                slots = sorted({int(np.argmax(member[:, p])) for p in span})
                out.append(
                    {
                        "depth": r["depth"],
                        "needle": r["needle"],
                        "answer": r["answer"],
                        "layer": layer,
                        "kv_head": h,
                        "slots_held": held,
                        "reference_slots": len(N2),
                        "counts_equal": bool(held == len(N2) and np.array_equal(np.asarray(st.n)[0, h, :held], N2)),
                        "max_key_difference": float(np.abs(np.asarray(st.k)[0, h, :held] - K2).max()),
                        "needle_tokens": len(span),
                        "needle_slots": len(slots),
                        "needle_tokens_alone": int(sum(N2[s] == 1 for s in slots)),
                        "needle_slot_counts": [int(N2[s]) for s in slots],
                        "largest_slot": int(N2.max()),
                    }
                )
                print(json.dumps(out[-1]), flush=True)
    B.write_json(
        a.out,
        {
            "what": "Chelsea's prefill on needle prompts it fails, against the numpy reference of Alg. 1",
            "niah": a.niah,
            "config": key,
            "options": options,
            "length": a.length,
            "rows": out,
            "all_equal": all(x["counts_equal"] and x["max_key_difference"] < 1e-4 for x in out),
            **B.device_fields(),
            "commit": B.commit(),
            "command": B.command_line(),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
