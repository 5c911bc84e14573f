"""kvjax's bounded SnapKV against kvpress's ``DecodingPress(SnapKVPress)`` on the same model and text.

    python benchmarks/kvpress_decoding.py --prefix 512 --continuation 7000 --decode-budget 1024 --every 128 \
        --torch-python /path/to/venv/bin/python --out benchmarks/results/kvpress_decoding_smollm2_cpu.json

**Model and text.** The embedded SmolLM2-135M-Instruct GGUF dequantised to float32, written once as a Hugging Face
folder (``benchmarks/prefill_vs_torch.py``'s export), loaded by kvjax (``kvjax.load_model(folder)``) and by
transformers (``LlamaForCausalLM``, float32). The text: the King James Genesis, ``--prefix`` tokens prefilled, then
``--continuation`` tokens teacher-forced one per step (each scored by the log-probability the model gave it at the
step before); perplexity over the continuation.

**Settings that coincide.** kvpress: ``DecodingPress(SnapKVPress(window_size=W, kernel_size=K),
compression_interval=E, target_size=D)`` (the prompt is kept whole, every ``E`` decode steps the cache is cut to
``D`` tokens per layer and KV head); kvjax: ``methods.get("snapkv", budget=1.0, window=W, kernel=K,
decode_budget=D, every=E)`` (the prompt kept whole since ``--prefix <= D``; the same schedule). The unbounded runs:
kvjax ``full`` and transformers without a press.

``kvpress_rope`` (a diagnostic run): kvpress with its buffered window queries rotated at their own positions. In
decoding, ``SnapKVPress.compute_window_attention`` rotates the last ``W`` buffered hidden states' queries with
``position_embeddings[:, -W:]`` of the current forward, which holds the current token's position only, so every
window query is rotated as if it were the current token.

**Kept positions.** kvpress keeps no positions; a subclass of ``SnapKVPress`` records the indices its ``compress``
keeps and carries the positions alongside (kept positions of the held ones, then the positions appended since).
kvjax's are its state's ``pos``. Compared per re-compression on layers 0, L/2 and L-1: Jaccard of the kept sets per
KV head.

**Time.** Per teacher-forced token, each side's Python loop over its jitted/eager step (kvjax: ``engine.decode_step``;
transformers: ``model(...)`` under ``torch.inference_mode``), after a warm-up; ``--threads 1`` (the default) pins each
worker process to one core and torch to one thread (on a loaded 2-core machine torch at 2 threads took 2.4 s per
token instead of 65 ms: its OpenMP threads contend). Each side runs
in its own process (the torch side in ``--torch-python``, a virtual environment with kvpress and its transformers).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LAYERS = None  # set from the config: (0, L // 2, L - 1)


def _layers(n: int) -> list[int]:
    return sorted({0, n // 2, n - 1})


# ------------------------------------------------------------------------------------------------------- torch side


def torch_side(a) -> dict:
    import torch
    from transformers import DynamicCache, LlamaForCausalLM

    torch.set_num_threads(a.threads)
    ids = json.loads(Path(a.ids).read_text())
    model = LlamaForCausalLM.from_pretrained(a.hf_dir, torch_dtype=torch.float32).eval()
    n_layers = model.config.num_hidden_layers
    layers = _layers(n_layers)
    record = {}
    press = None
    if a.mode in ("kvpress", "kvpress_rope"):
        from kvpress import DecodingPress, SnapKVPress

        held = {}  # layer -> [H, n] positions of the held keys
        nxt = {}

        class RecordingSnapKV(SnapKVPress):
            def compress(self, module, hidden_states, keys, values, attentions, kwargs):
                layer = module.layer_idx
                if self.compression_ratio == 0:
                    return keys, values
                k_len = keys.shape[2]
                if a.mode == "kvpress_rope":  # the buffered queries rotated at their own positions, not the current one
                    now = (
                        nxt.get(layer, a.prefix_len)
                        + k_len
                        - (a.prefix_len if held.get(layer) is None else held[layer].shape[1])
                        - 1
                    )
                    buf = hidden_states.shape[1]
                    position_ids = torch.arange(now - buf + 1, now + 1)[None]
                    kwargs = dict(kwargs, position_embeddings=model.model.rotary_emb(hidden_states, position_ids))
                scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
                n_kept = int(k_len * (1 - self.compression_ratio))
                indices = scores.topk(n_kept, dim=-1).indices  # [1, H, n_kept]
                pos = held.get(layer)
                start = nxt.get(layer, a.prefix_len)
                h = keys.shape[1]
                before = a.prefix_len if pos is None else pos.shape[1]
                new = torch.arange(start, start + k_len - before).expand(h, -1)
                pos = torch.arange(a.prefix_len).expand(h, -1) if pos is None else pos
                pos = torch.cat([pos, new], dim=1)
                held[layer] = torch.gather(pos, 1, indices[0])
                nxt[layer] = start + k_len - before
                if layer in layers:
                    record.setdefault(str(layer), []).append([sorted(map(int, x)) for x in held[layer].tolist()])
                idx = indices.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)
                return keys.gather(2, idx).contiguous(), values.gather(2, idx).contiguous()

        press = DecodingPress(
            base_press=RecordingSnapKV(window_size=a.window, kernel_size=a.kernel),
            compression_interval=a.every,
            target_size=a.decode_budget,
            hidden_states_buffer_size=max(256, a.window + 1),
        )
    p = a.prefix_len
    x = torch.tensor([ids])
    nll, times = [], []
    import contextlib

    ctx = press(model) if press is not None else contextlib.nullcontext()
    with torch.inference_mode(), ctx:
        cache = DynamicCache()
        out = model(input_ids=x[:, :p], past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1]
        for i in range(len(ids) - p):
            lp = torch.log_softmax(logits.float(), -1)[ids[p + i]]
            nll.append(-float(lp))
            if i == len(ids) - p - 1:
                break
            t0 = time.perf_counter()
            out = model(input_ids=x[:, p + i : p + i + 1], past_key_values=cache, position_ids=torch.tensor([[p + i]]))
            logits = out.logits[0, -1]
            times.append(time.perf_counter() - t0)
        held_tokens = cache.layers[0].keys.shape[2]
    return dict(nll=nll, step_seconds=times, kept=record, held_tokens_layer0=int(held_tokens), layers=layers)


# ------------------------------------------------------------------------------------------------------- kvjax side


def kvjax_side(a) -> dict:
    import jax
    import jax.numpy as jnp

    import kvjax
    from kvjax import engine, methods
    from kvjax.methods.base import Capacity

    ids = json.loads(Path(a.ids).read_text())
    model = kvjax.load_model(a.hf_dir, dtype=jnp.float32, tokenizer=False)
    cfg = model.config
    layers = _layers(cfg.num_layers)
    if a.mode == "kvjax":
        m = methods.get(
            "snapkv", budget=1.0, window=a.window, kernel=a.kernel, decode_budget=a.decode_budget, every=a.every
        )
    else:
        m = methods.get("full")
    p = a.prefix_len
    n = len(ids) - p
    seq = jnp.asarray([ids], jnp.int32)
    states = engine.init_states(cfg, m, 1, Capacity(p, n), jnp.float32)
    states, logits = engine.prefill(cfg, m, model.params, seq[:, :p], jnp.asarray([p], jnp.int32), states)
    logprob = jax.jit(lambda lg, t: jax.nn.log_softmax(lg, -1)[0, t])
    nll, times, record = [], [], {}
    held_len = p
    for i in range(n):
        nll.append(-float(logprob(logits, ids[p + i])))
        if i == n - 1:
            break
        t0 = time.perf_counter()
        logits, states = engine.decode_step(cfg, m, model.params, states, seq[:, p + i], jnp.asarray([p + i]))
        logits.block_until_ready()
        times.append(time.perf_counter() - t0)
        steps = i + 1
        held_len += 1  # layer 0 after this step's append
        if a.mode == "kvjax" and steps % a.every == 0:
            cut = held_len > a.decode_budget  # this step re-compressed
            per = engine.layer_states(states)
            held_len = int(per[0].cache.length[0])
            if cut:
                for layer in layers:
                    pos = np.asarray(per[layer].cache.pos[0])
                    record.setdefault(str(layer), []).append([sorted(int(x) for x in row if x >= 0) for row in pos])
    held = float(engine.tokens_held(m, states)[0])
    return dict(
        nll=nll,
        step_seconds=times,
        kept=record,
        held_tokens_mean=held,
        layers=layers,
        held_bytes=int(engine.held_bytes(m, states)[0]),
        cache_bytes=int(engine.memory_bytes(m, states)),
    )


# ------------------------------------------------------------------------------------------------------- driver


def _jaccard(a, b) -> float:
    a, b = set(a), set(b)
    return len(a & b) / max(len(a | b), 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--continuation", type=int, default=2048)
    ap.add_argument("--decode-budget", type=int, default=1024)
    ap.add_argument("--every", type=int, default=128)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--kernel", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hf-dir", default="/tmp/kvjax-smollm2-f32")
    ap.add_argument("--torch-python", default=sys.executable)
    ap.add_argument("--runs", default="kvjax,kvpress,kvpress_rope,full,torch_full")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="keep a run's result from an earlier invocation when it was made with the same settings and text "
        "(each run's JSON in $TMPDIR/kvpress_decoding carries them): an interrupted comparison resumes",
    )
    ap.add_argument("--side", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ids", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prefix-len", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.side:  # a worker process
        if a.threads == 1 and hasattr(os, "sched_setaffinity"):  # one core: XLA sizes its thread pool from it
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        res = torch_side(a) if a.side == "torch" else kvjax_side(a)
        Path(a.result).write_text(json.dumps(res))
        return
    if a.prefix > a.decode_budget:
        raise SystemExit("--prefix must be <= --decode-budget (kvpress keeps the prompt whole until its first cut)")
    import jax

    import kvjax
    from kvjax.loading import assets

    hf = Path(a.hf_dir)
    if not (hf / "ok.npy").exists():
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from prefill_vs_torch import export

        export(hf, None)
    tok = kvjax.load_model("smollm2-135m-instruct").tokenizer
    text = tok.encode(assets.bible_text("Genesis"))
    need = a.prefix + a.continuation
    if len(text) < need:
        text = text + tok.encode(assets.bible_text())[: need - len(text)]
    ids = [int(x) for x in text[:need]]
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "kvpress_decoding"
    work.mkdir(exist_ok=True)
    (work / "ids.json").write_text(json.dumps(ids))
    out, reused = {}, []
    settings = dict(
        ids=hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16],
        **{
            k: getattr(a, k)
            for k in ("prefix", "continuation", "decode_budget", "every", "window", "kernel", "threads")
        },
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for run in a.runs.split(","):
        side = "torch" if run in ("kvpress", "kvpress_rope", "torch_full") else "kvjax"
        python = a.torch_python if side == "torch" else sys.executable
        res_path = work / f"{run}.json"
        cmd = [
            python,
            __file__,
            "--side",
            side,
            "--mode",
            run,
            "--ids",
            str(work / "ids.json"),
            "--prefix-len",
            str(a.prefix),
            "--result",
            str(res_path),
            "--hf-dir",
            a.hf_dir,
            "--decode-budget",
            str(a.decode_budget),
            "--every",
            str(a.every),
            "--window",
            str(a.window),
            "--kernel",
            str(a.kernel),
            "--threads",
            str(a.threads),
        ]
        old = json.loads(res_path.read_text()) if a.reuse and res_path.exists() else {}
        if old.get("settings") == settings:
            out[run] = old
            reused.append(run)
        else:
            t0, load0 = time.perf_counter(), os.getloadavg()[0]
            subprocess.run(cmd, check=True, env=env)
            out[run] = json.loads(res_path.read_text())
            out[run]["wall_seconds"] = time.perf_counter() - t0
            out[run]["load_average"] = [load0, os.getloadavg()[1]]  # 1-min before, 5-min after: a shared machine
            out[run]["settings"] = settings
            res_path.write_text(json.dumps(out[run]))
        r = out[run]
        warm = r["step_seconds"][16:] or r["step_seconds"]
        print(
            f"{run}: perplexity {np.exp(np.mean(r['nll'])):.4f}, {1e3 * np.median(warm):.2f} ms/token (median), "
            f"{r['wall_seconds']:.0f} s",
            flush=True,
        )
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_common import commit

    summary = dict(
        command=shlex.join(["python", *sys.argv]),
        commit=commit(),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        reused=reused,  # runs kept from an earlier invocation with the same settings (--reuse)
        model="SmolLM2-135M-Instruct (embedded GGUF, float32)",
        prefix=a.prefix,
        continuation=a.continuation,
        decode_budget=a.decode_budget,
        every=a.every,
        window=a.window,
        kernel=a.kernel,
        threads=a.threads,
        device=str(jax.devices()[0]),
        jax=jax.__version__,
        runs={},
    )
    for run, r in out.items():
        warm = r["step_seconds"][16:] or r["step_seconds"]
        summary["runs"][run] = dict(
            perplexity=float(np.exp(np.mean(r["nll"]))),
            ms_per_token_median=1e3 * float(np.median(warm)),
            ms_per_token_mean=1e3 * float(np.mean(warm)),
            **{
                k: r[k]
                for k in ("held_tokens_mean", "held_tokens_layer0", "held_bytes", "cache_bytes", "load_average")
                if k in r
            },
        )
    for other in ("kvpress", "kvpress_rope"):
        if "kvjax" not in out or other not in out:
            continue
        jac = {}
        for layer, ours in out["kvjax"]["kept"].items():
            theirs = out[other]["kept"].get(layer, [])
            jac[layer] = [float(np.mean([_jaccard(x, y) for x, y in zip(o, t)])) for o, t in zip(ours, theirs)]
        summary[f"kept_jaccard_per_recompression_vs_{other}"] = jac
        a_nll, b_nll = np.asarray(out["kvjax"]["nll"]), np.asarray(out[other]["nll"])
        summary[f"nll_max_abs_diff_before_first_cut_vs_{other}"] = float(np.max(np.abs(a_nll - b_nll)[: a.every]))
    if "full" in out and "torch_full" in out:
        summary["full_nll_max_abs_diff"] = float(
            np.max(np.abs(np.asarray(out["full"]["nll"]) - out["torch_full"]["nll"]))
        )
    print(json.dumps({k: v for k, v in summary.items()}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
