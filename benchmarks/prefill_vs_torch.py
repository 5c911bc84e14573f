"""Prefill side by side with PyTorch: kvjax against Hugging Face transformers on the same float32 weights.

    python benchmarks/prefill_vs_torch.py --lengths 2k,4k,6k,7680 --threads 1,2 --out /tmp/p.json
    python benchmarks/prefill_vs_torch.py --random --lengths 16k,32k --threads 1 --out /tmp/p_random.json

**Weights.** The embedded SmolLM2-135M-Instruct GGUF, dequantised to float32 by ``kvjax.load_model``, is written
once as a Hugging Face folder (``config.json`` built from kvjax's ``ModelConfig``, ``model.safetensors`` with the
arrays copied: kvjax's ``[in, out]`` matrices transposed back to PyTorch's ``[out, in]``), cached under
``--cache-dir``. transformers loads it as ``LlamaForCausalLM`` in float32 (no download); kvjax loads the same
folder with ``kvjax.load_model`` (``--kvjax-source gguf``: from the GGUF itself, as ``load_model("smollm2-135m-
instruct")`` does; the arrays are identical). ``--random``: the same architecture with random weights (normal,
std 0.02, seed 0) and a context long enough for the longest length, for 16k and 32k (SmolLM2's context is 8k);
``--layers`` keeps SmolLM2's layer shapes but fewer layers, so a 32k comparison takes minutes, not an hour.

**Prompt.** ``n`` token ids drawn uniformly from the vocabulary (seed 0) after BOS: the same ids on both sides.

**Prefill.** One forward over the prompt that returns the last position's logits and the cache:
transformers ``model(ids, use_cache=True, logits_to_keep=1)`` (its default attention, SDPA), under
``torch.inference_mode()``; kvjax ``engine.init_states`` + ``engine.prefill`` with the ``full`` method exactly as
``kvjax.generate`` runs it (bucket, cache capacity for ``--max-new`` decode tokens), until the logits are ready.
The timed region includes creating the cache on both sides. kvjax is timed compile-excluded (its first call
compiles and runs once; that time is reported as ``first_call_s``); transformers runs once at 128 tokens first
(operator set-up). Times are medians over ``--reps`` runs.

**Threads.** ``--threads 1``: torch ``set_num_threads(1)``, and both processes pinned to one core with
``sched_setaffinity`` (XLA:CPU sizes its thread pool from the affinity mask). ``--threads 2``: torch
``set_num_threads(2)``, both processes on two cores.

**Memory.** Every side and length runs in its own subprocess. Reported per process: ``rss_loaded`` (VmRSS after
loading the weights and the warm-up), ``prefill_peak`` (the peak resident set during the timed prefills: VmHWM,
reset by writing 5 to ``/proc/self/clear_refs`` after the warm-up; the outputs of one run are freed before the
next), ``setup_peak`` (VmHWM before that reset: loading, kvjax's compile, the warm-up) and ``process_peak`` (the
larger of the two: the whole process). MiB.

**Agreement.** The last-position logits of both sides are compared (max abs difference, same argmax).

**Work.** ``prefill_flops``: the prefill's useful floating-point operations, counted from the Hugging Face
``config.json`` (2 per multiply-add): the projections and the MLP at every prompt position, the causal attention
(``QK^T`` and ``PV`` over the ``n (n + 1) / 2`` visible pairs of each query head) and the LM head at the last
position. Each worker also times its own library's float32 matrix product at the same thread count
(``matmul_peak``: a 2048 x 2048 x 2048 product, best of 5; ``jnp.dot`` under ``jit`` on the kvjax side,
``torch.mm`` on the other): the rate the core reaches on the work a prefill is made of. ``gflops`` is
``prefill_flops / median_s`` and ``of_peak`` its share of that rate: a prefill at 90% of its core's matrix rate
cannot get much faster without doing less work.

Output: a table and a JSON with the jax / torch / transformers versions, the device, the commit and the command.
It is a benchmark, not a test: at one thread the full 2k-7.68k sweep takes about 5 minutes per thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

from bench_common import ROOT, git, parse_contexts, write_json  # noqa: E402  (the standard library only)

MIB = 2**20


# ------------------------------------------------------------------------------------------------------ helpers


def parse_lengths(text: str) -> list[int]:
    """``"2k,7680"`` -> ``[2048, 7680]``."""
    return parse_contexts(text, "--lengths", "2k,7680")


def _status(key: str) -> int:
    """``/proc/self/status`` field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return -1


def _cpu_s() -> float:
    """CPU seconds this process has used (user + system, all threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _pin(threads: int) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < threads:
        raise ValueError(f"--threads {threads}: this process may use only {len(cpus)} CPU(s)")
    os.sched_setaffinity(0, cpus[:threads])


def commit(root: Path = ROOT) -> str | None:
    """``root``'s commit, ``+dirty`` where its kvjax/ differs from it (``--base-root``: another checkout)."""
    head, dirty = git("rev-parse", "HEAD", root=root), git("status", "--porcelain", "--", "kvjax", root=root)
    return None if head is None or dirty is None else head + ("+dirty" if dirty else "")


def prompt_ids(n: int, vocab: int, bos: int | None) -> list[int]:
    import numpy as np

    ids = np.random.RandomState(0).randint(0, vocab, size=n).tolist()
    if bos is not None:
        ids[0] = bos
    return ids


# ------------------------------------------------------------------------------------------------ weight export


def hf_config_dict(cfg) -> dict:
    """A transformers ``LlamaConfig`` (as a dict) for a kvjax ``ModelConfig`` of a plain Llama model."""
    if cfg.model_type != "llama" or cfg.rope.rope_type != "default" or any(cfg.sliding_windows):
        raise ValueError(
            f"the comparison builds a plain LlamaForCausalLM; {cfg.model_type} with rope "
            f"{cfg.rope.rope_type} is not covered"
        )
    return dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope.theta,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=cfg.attention_bias,
        mlp_bias=cfg.mlp_bias,
        hidden_act="silu",
        bos_token_id=cfg.bos_token_id,
        eos_token_id=list(cfg.eos_token_ids)[:1] or None,
        torch_dtype="float32",
    )


def hf_state_dict(cfg, params) -> dict:
    """kvjax params -> transformers Llama tensor names, PyTorch ``[out, in]`` layout, float32 numpy."""
    import numpy as np

    f = lambda a: np.ascontiguousarray(np.asarray(a, np.float32))  # noqa: E731
    out = {"model.embed_tokens.weight": f(params["embed"]), "model.norm.weight": f(params["final_norm"])}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = f(np.asarray(params["lm_head"]).T)
    names = {
        "wq": "self_attn.q_proj",
        "wk": "self_attn.k_proj",
        "wv": "self_attn.v_proj",
        "wo": "self_attn.o_proj",
        "w_gate": "mlp.gate_proj",
        "w_up": "mlp.up_proj",
        "w_down": "mlp.down_proj",
    }
    for i, lp in enumerate(params["layers"]):
        pre = f"model.layers.{i}."
        out[pre + "input_layernorm.weight"] = f(lp["attn_norm"])
        out[pre + "post_attention_layernorm.weight"] = f(lp["mlp_norm"])
        for ours, theirs in names.items():
            out[pre + theirs + ".weight"] = f(np.asarray(lp[ours]).T)
    return out


def export(folder: Path, random_context: int | None, layers: int | None = None) -> None:
    """Write the HF folder: the GGUF's float32 weights, or random ones with ``random_context`` positions (and
    ``layers`` layers, default SmolLM2's 30)."""
    import dataclasses

    import jax.numpy as jnp
    import numpy as np
    from safetensors.numpy import save_file

    import kvjax
    from kvjax.model import random_params

    model = kvjax.load_model("smollm2-135m-instruct", dtype=jnp.float32, tokenizer=False)
    cfg, params = model.config, model.params
    if random_context:
        import jax

        n = layers or cfg.num_layers
        cfg = dataclasses.replace(
            cfg,
            max_position_embeddings=max(cfg.max_position_embeddings, random_context),
            num_layers=n,
            sliding_windows=(None,) * n,
        )
        params = random_params(cfg, jax.random.PRNGKey(0), jnp.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(hf_state_dict(cfg, params), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf_config_dict(cfg), indent=1))
    np.save(folder / "ok.npy", np.zeros(1))


# ------------------------------------------------------------------------------------------------------ workers


def prefill_flops(hf: dict, n: int) -> float:
    """Floating-point operations of an ``n``-token prefill of a Llama-style model (``hf``: its config.json), 2 per
    multiply-add: projections and MLP at every position, causal attention over the visible pairs, LM head at the
    last position (module docstring, "Work")."""
    h, layers, hq = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]
    hkv, d = hf.get("num_key_value_heads") or hq, hf.get("head_dim") or h // hq
    per_token = layers * (h * hq * d * 2 + 2 * h * hkv * d + 3 * h * hf["intermediate_size"])  # q, o; k, v; MLP
    attention = layers * hq * d * 2 * n * (n + 1) / 2  # QK^T and PV, one multiply-add per pair and dimension each
    return 2.0 * (per_token * n + attention + h * hf["vocab_size"])


PEAK_N = 2048  # matmul_peak's square product


def matmul_peak(run, reps: int = 5) -> float:
    """GFLOP/s of the best of ``reps`` calls of ``run()`` (a ``PEAK_N``-cubed float32 matrix product that returns
    once the result is ready), after one untimed call."""
    run()
    best = min(_timed(run) for _ in range(reps))
    return 2.0 * PEAK_N**3 / best / 1e9


def _timed(run) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def worker_kvjax(args) -> dict:
    import gc

    import jax
    import jax.numpy as jnp
    import numpy as np

    import kvjax
    from kvjax import engine, methods
    from kvjax.methods.base import Capacity

    t0 = time.perf_counter()
    source = "smollm2-135m-instruct" if args.kvjax_source == "gguf" else args.weights
    model = kvjax.load_model(source, dtype=jnp.float32, tokenizer=False)
    load_s = time.perf_counter() - t0
    cfg, params = model.config, model.params
    method = methods.get("full")
    ids = prompt_ids(args.length, cfg.vocab_size, cfg.bos_token_id)
    bucket = engine.bucket_length(len(ids))
    tokens, lengths = engine.pad_prompts([ids], bucket)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    capacity = Capacity(bucket, args.max_new)

    def run():
        states = engine.init_states(cfg, method, 1, capacity, model.dtype)
        states, logits = engine.prefill(cfg, method, params, tokens, lengths, states)
        return states, jax.block_until_ready(logits)

    t0 = time.perf_counter()
    states, logits = run()
    first = time.perf_counter() - t0
    last = np.asarray(logits[0])
    del states, logits
    gc.collect()
    rss_loaded, setup_peak = _status("VmRSS"), _status("VmHWM")
    peaks, times, cpu = [], [], []
    for _ in range(args.reps):
        _reset_peak()
        t0, c0 = time.perf_counter(), _cpu_s()
        states, logits = run()
        times.append(time.perf_counter() - t0)
        cpu.append(_cpu_s() - c0)
        peaks.append(_status("VmHWM"))
        del states, logits
        gc.collect()
    np.save(args.logits, last)
    a = jax.random.normal(jax.random.PRNGKey(0), (PEAK_N, PEAK_N), jnp.float32)
    dot = jax.jit(jnp.dot)
    peak = matmul_peak(lambda: dot(a, a).block_until_ready())
    return dict(
        side="kvjax",
        matmul_peak_gflops=peak,
        bucket=bucket,
        load_s=load_s,
        first_call_s=first,
        times=times,
        cpu_times=cpu,
        rss_loaded=rss_loaded,
        setup_peak=setup_peak,
        prefill_peak=max(peaks),
        jax=jax.__version__,
        device=str(jax.devices()[0].device_kind),
        source=source,
    )


def worker_torch(args) -> dict:
    import gc

    import numpy as np
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = transformers.LlamaForCausalLM.from_pretrained(args.weights, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    cfg = model.config
    ids = torch.tensor([prompt_ids(args.length, cfg.vocab_size, cfg.bos_token_id)])

    def run(x):
        with torch.inference_mode():
            out = model(x, use_cache=True, logits_to_keep=1)
        return out.past_key_values, out.logits[0, -1]

    run(ids[:, :128])  # operator set-up
    gc.collect()
    rss_loaded, setup_peak = _status("VmRSS"), _status("VmHWM")
    peaks, times, cpu, last = [], [], [], None
    for _ in range(args.reps):
        _reset_peak()
        t0, c0 = time.perf_counter(), _cpu_s()
        cache, logits = run(ids)
        times.append(time.perf_counter() - t0)
        cpu.append(_cpu_s() - c0)
        peaks.append(_status("VmHWM"))
        last = logits.float().numpy().copy()
        del cache, logits
        gc.collect()
    np.save(args.logits, last)
    a = torch.randn(PEAK_N, PEAK_N, dtype=torch.float32)
    with torch.inference_mode():
        peak = matmul_peak(lambda: torch.mm(a, a))
    return dict(
        side="torch",
        matmul_peak_gflops=peak,
        load_s=load_s,
        times=times,
        cpu_times=cpu,
        rss_loaded=rss_loaded,
        setup_peak=setup_peak,
        prefill_peak=max(peaks),
        torch=torch.__version__,
        transformers=transformers.__version__,
        attn_implementation=getattr(cfg, "_attn_implementation", None),
        torch_threads=torch.get_num_threads(),
    )


def worker(args) -> None:
    _pin(args.threads)
    if args.worker == "export":
        export(Path(args.weights), args.random_context, args.layers)
        return
    res = worker_kvjax(args) if args.worker == "kvjax" else worker_torch(args)
    # clear_refs also resets ru_maxrss, so the process peak is the larger of the two phases' peaks
    res.update(
        length=args.length,
        threads=args.threads,
        reps=args.reps,
        cpus=sorted(os.sched_getaffinity(0)),
        process_peak=max(
            res["setup_peak"], res["prefill_peak"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        ),
    )
    res["median_s"], res["median_cpu_s"] = _median(res["times"]), _median(res["cpu_times"])
    print("RESULT " + json.dumps(res), flush=True)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


# ------------------------------------------------------------------------------------------------------- driver


def _spawn(argv: list[str], timeout: float, root: Path = ROOT) -> dict | None:
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *argv], capture_output=True, text=True, env=env, timeout=timeout
    )
    if p.returncode:
        sys.stderr.write(p.stdout[-3000:] + p.stderr[-5000:])
        raise RuntimeError(f"worker {argv} failed with exit code {p.returncode}")
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return None


def ensure_weights(cache: Path, random_context: int | None, layers: int | None = None) -> Path:
    name = (
        f"random-{random_context}" + (f"-{layers}layers" if layers else "")
        if random_context
        else "smollm2-135m-instruct-f32"
    )
    folder = cache / name
    if not (folder / "ok.npy").is_file():
        print(f"exporting weights to {folder} ...", flush=True)
        argv = ["--worker", "export", "--weights", str(folder), "--threads", "1"]
        if random_context:
            argv += ["--random-context", str(random_context)] + (["--layers", str(layers)] if layers else [])
        _spawn(argv, 1800)
    return folder


def table(rows: list[dict], sides: list[str]) -> str:
    """One line per (threads, length): each side's median seconds, prefill peak MiB and GFLOP/s (with its share of
    the side's own matrix-product rate), and each kvjax side's ratios to torch (time, memory) and logit
    agreement."""
    ours = [s for s in sides if s != "torch"]
    head = f"{'threads':>7} {'tokens':>7} " + " ".join(
        f"{s + ' s':>9} {s + ' MiB':>10} {'GFLOP/s':>8} {'of peak':>7}" for s in sides
    )
    if "torch" in sides:
        head += " | " + " ".join(f"{s + '/torch t':>14} {'mem':>5} {'max|dlogit|':>11}" for s in ours)
    lines = [head, "-" * len(head)]
    for r in rows:
        line = f"{r['threads']:>7} {r['length']:>7} " + " ".join(
            f"{r[s]['median_s']:>9.2f} {r[s]['prefill_peak'] / MIB:>10.0f} {r[s]['gflops']:>8.1f} "
            f"{r[s]['of_peak']:>7.0%}"
            for s in sides
        )
        if "torch" in sides:
            t = r["torch"]
            line += " | " + " ".join(
                f"{r[s]['median_s'] / t['median_s']:>14.2f} {r[s]['prefill_peak'] / t['prefill_peak']:>5.2f} "
                f"{r[s]['max_abs_logit_diff']:>11.2e}"
                for s in ours
            )
        lines.append(line)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lengths", type=parse_lengths, default=parse_lengths("2k,4k,6k,7680"))
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts (1: both sides on one core)")
    ap.add_argument(
        "--sides",
        default="kvjax,torch",
        help="kvjax, torch, and base: kvjax imported from --base-root (before/after in one run)",
    )
    ap.add_argument("--base-root", type=Path, default=None, help="another checkout of kvjax for the 'base' side")
    ap.add_argument("--random", action="store_true", help="random weights, context raised to the longest length")
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="with --random: this many layers instead of SmolLM2's 30 (same per-layer shapes)",
    )
    ap.add_argument("--reps", type=int, default=2, help="timed prefills per side and length (median)")
    ap.add_argument("--max-new", type=int, default=32, help="decode slots in kvjax's cache (as generate)")
    ap.add_argument("--kvjax-source", choices=("folder", "gguf"), default="folder")
    ap.add_argument("--cache-dir", type=Path, default=Path("/tmp/kvjax-prefill-vs-torch"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per worker process")
    # worker mode (internal)
    ap.add_argument("--worker", choices=("export", "kvjax", "torch"), help=argparse.SUPPRESS)
    ap.add_argument("--weights", help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--logits", help=argparse.SUPPRESS)
    ap.add_argument("--random-context", type=int, help=argparse.SUPPRESS)
    return ap


def _row(args, sides, folder, meta, th: int, n: int) -> dict:
    """One (threads, length) row: each side's prefill in its own worker process, and the logits of every side
    against torch's."""
    import numpy as np

    row = dict(threads=th, length=n)
    for side in sides:
        logits = args.cache_dir / f"logits-{side}-{n}-{th}.npy"
        argv = [
            "--worker",
            side,
            "--weights",
            str(folder),
            "--length",
            str(n),
            "--threads",
            str(th),
            "--reps",
            str(args.reps),
            "--max-new",
            str(args.max_new),
            "--logits",
            str(logits),
            "--kvjax-source",
            args.kvjax_source if not args.random else "folder",
        ]
        if side == "base":
            if args.base_root is None:
                raise ValueError("--sides base needs --base-root (a checkout of kvjax to compare against)")
            argv[1] = "kvjax"
        row[side] = _spawn(argv, args.timeout, args.base_root if side == "base" else ROOT)
        base = side == "base"
        row[side]["commit"] = (commit(args.base_root) or str(args.base_root)) if base else meta["commit"]
        print(
            f"  {side:5s} threads={th} n={n}: {row[side]['median_s']:.2f} s ({row[side]['median_cpu_s']:.2f} "
            f"CPU s), prefill peak "
            f"{row[side]['prefill_peak'] / MIB:.0f} MiB, process peak {row[side]['process_peak'] / MIB:.0f}"
            " MiB",
            flush=True,
        )
    flops = prefill_flops(json.loads((Path(folder) / "config.json").read_text()), n)
    for side in sides:
        gflops = flops / row[side]["median_s"] / 1e9
        row[side].update(prefill_gflop=flops / 1e9, gflops=gflops, of_peak=gflops / row[side]["matmul_peak_gflops"])
    if "torch" in sides:
        b = np.load(args.cache_dir / f"logits-torch-{n}-{th}.npy")
        for side in sides:
            if side == "torch":
                continue
            a = np.load(args.cache_dir / f"logits-{side}-{n}-{th}.npy")
            row[side].update(
                max_abs_logit_diff=float(np.max(np.abs(a - b))),
                same_argmax=bool(a.argmax() == b.argmax()),
                time_ratio=row[side]["median_s"] / row["torch"]["median_s"],
                memory_ratio=row[side]["prefill_peak"] / row["torch"]["prefill_peak"],
            )
    return row


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.worker:
        args.threads = int(args.threads)
        return worker(args)

    threads = [int(t) for t in args.threads.split(",")]
    sides = [s for s in args.sides.split(",") if s]
    random_context = max(args.lengths) + args.max_new if args.random else None
    folder = ensure_weights(args.cache_dir, random_context, args.layers if args.random else None)
    rows, started = [], time.perf_counter()
    meta = dict(
        command=" ".join(shlex.quote(a) for a in sys.argv),
        commit=commit(),
        machine=platform.machine(),
        cpu=_cpu_name(),
        cpus=len(os.sched_getaffinity(0)),
        python=platform.python_version(),
        weights=str(folder),
        random=args.random,
        layers=args.layers if args.random else None,
        reps=args.reps,
        max_new=args.max_new,
        kvjax_source=args.kvjax_source,
        base_root=str(args.base_root) if args.base_root else None,
    )
    for th in threads:
        for n in args.lengths:
            rows.append(_row(args, sides, folder, meta, th, n))
            if args.out:
                _write(args.out, meta, rows, started)
    print(table(rows, sides))
    if args.out:
        _write(args.out, meta, rows, started)
        print(f"wrote {args.out}")


def _versions(rows) -> dict:
    out = {}
    for r in rows:
        for side in ("kvjax", "torch"):
            for key in ("jax", "device", "torch", "transformers", "attn_implementation"):
                if key in r.get(side, {}):
                    out[key] = r[side][key]
    return out


def _write(path: Path, meta: dict, rows: list[dict], started: float) -> None:
    write_json(path, dict(meta, **_versions(rows), seconds=time.perf_counter() - started, rows=rows))


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
