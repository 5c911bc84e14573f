"""End-to-end benchmark in the papers' setting: TTFT, TPOT, decode throughput, memory and compile time.

The papers' setting (Llama-3.1-8B shapes, random bf16 weights, random token ids, 256 new tokens), on one GPU or TPU::

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python benchmarks/e2e.py --model llama-3.1-8b \\
        --contexts 8k,16k,32k,64k,128k --batch 1,8 --new-tokens 256 --budgets 0.1,0.2 --token-budgets 1024,2048 \\
        --out benchmarks/results/e2e_h100.json

(on a GPU, JAX preallocates 75% of the memory by default and ``bytes_limit``, the skip rule's limit, follows it;
the fraction above gives it the whole device). That is 5 contexts x 2 batches x 29 method@budget rows, each
compiled (scanned layers: seconds) and run twice (warm-up + timed): hours on one H100. A subset first::

    python benchmarks/e2e.py --contexts 16k,32k,64k --batch 1 --methods full,chelsea,clusterkv,chunkkv,pqcache \\
        --budgets 0.2 --token-budgets 1024 --out benchmarks/results/e2e_h100_b1.json

``--scan-layers`` is on by default for the 8B model (the decode loop compiles one layer body instead of 32), but
a scanned decode step also copies each layer's cache slice once (README, "Deep models"), which costs the full cache
most and so flatters the compressed methods' TPOT speedups; for the numbers to set beside the papers', run the same
command again with ``--scan-layers off`` (the JSON records ``scan_layers``).

(all registered methods by default, ``full`` first; ``--methods full,chelsea,clusterkv`` for fewer). Only the
compile times, with abstract inputs (the 8B weights are never allocated; runs on any host, CPU included)::

    python benchmarks/e2e.py --compile-only --contexts 32k --batch 1 --layouts scan,unrolled \\
        --out benchmarks/results/e2e_compile_8b_cpu.json

What it does, per (context, batch, method@budget): builds the states (``engine.init_states``), lowers and compiles
the prefill (``engine.prefill``) and the whole decode loop (``engine.run_loop``, ``scan`` driver, ``--new-tokens``
tokens) from abstract shapes, then runs prefill + loop once to warm up and ``--repeats`` times timed
(``block_until_ready`` around each phase; compile excluded). ``full`` runs first at every (context, batch), so every
ratio compares rows of the same run. ``chunkkv`` runs with ``reuse=1`` (no index reuse, label ``chunkkv``) and
``reuse=2`` (the paper's ChunkKV_reuse, label ``chunkkv_reuse``); the recall methods (``recalls``: pqcache,
clusterkv, quest) also run at the token budgets. A configuration whose estimated memory (weights + cache +
prefill activations) or whose compiled executables' memory (``memory_analysis``) exceeds the device's memory is
skipped with the reason in the JSON; nothing is dropped silently. Prompts of ``Nk`` are ``N * 1024`` tokens,
shortened to ``max_position_embeddings - new_tokens`` where they would not fit (128k with Llama-3.1's 131072).

The torch side: ``transformers`` and ``kvpress`` in ``--methods`` (both in the default, right after ``full``; see
:data:`PRIORITY`) add transformers' ``LlamaForCausalLM`` with the same shapes and its own random weights (full cache)
and kvpress's ``SnapKVPress`` on it at each fractional budget, run by ``benchmarks/e2e_torch.py`` in its own process
(``--torch-python``, kept for the run); skipped or failed with the reason where torch, transformers or kvpress cannot
run them. Resume: rows of ``--out`` measured (``ok``) at the same commit and settings (:func:`row_key`) are not
measured again, a JSON of another commit is moved aside. The ``.md`` beside the JSON is :func:`markdown`'s table:
ratios to kvjax's and transformers' full, the bytes-allowed ceiling (:func:`ceiling`) and the papers' figures. The
8B run on a GPU, one device call: ``scripts/gpu_e2e.sh`` (docs/performance.md, "End to end on one GPU").

Columns (JSON keys in brackets):

- TTFT [``ttft_s``]: prefill (full causal attention + the method's compression at every layer) + the first
  token's argmax, seconds.
- TPOT [``tpot_s``]: decode-loop seconds / decode steps (``new_tokens - 1``; the first token comes from prefill).
- tok/s [``throughput_tok_s``]: ``batch * steps / decode seconds``.
- speedup [``tpot_speedup_vs_full``]: TPOT(full) / TPOT(method); TTFT+ [``ttft_overhead_vs_full``]:
  TTFT(method) / TTFT(full) - 1; thr× [``throughput_ratio_vs_full``]; e2e× [``e2e_speedup_vs_full``]: (TTFT +
  decode) of full over the method's.
- comp% [``compress_share_of_prefill``]: (TTFT(method) - TTFT(full)) / TTFT(method), the share of the method's
  prefill spent compressing (clustering, quantising, scoring). kvjax methods compress inside ``method.prefill``,
  layer by layer, so this difference is the measurement (no method exposes a separate compress call).
- memory: ``peak_bytes_in_use`` / ``bytes_in_use_after_prefill`` / ``bytes_in_use_after_decode`` from
  ``device.memory_stats()`` where the backend has it (GPU, TPU; the peak is monotone over the process, so it is
  only a per-row peak while rows grow), and always ``memory_analysis`` of the compiled prefill and loop
  (arguments + outputs - aliased + temporaries: the executable's own peak, CPU included); ``cache_bytes`` is
  what the method's states hold (``engine.memory_bytes``). The table's ``exec GiB`` is the larger
  ``memory_analysis`` peak of the two executables (weights and states included).
- compile [``prefill_compile_s``, ``decode_compile_s``, and ``*_lower_s``]: XLA compile (and trace + lower)
  seconds; ``--scan-layers`` (default on for the 8B model) compiles one loop body per run of agreeing layers.

It prints the table per context and batch, then the papers' figures (:data:`PAPERS`, each with its table or
figure) beside ours at the matching setting, writes the JSON after every row (jax/jaxlib version, device,
backend, commit, command line) and a plot of TPOT speedup vs context (``.png`` beside the JSON, when matplotlib
is importable).

CPU results (``benchmarks/results/e2e_cpu.*``, ``e2e_compile_8b_cpu.json``) are **not** the papers' setting: a
CPU has no HBM bandwidth to save, and a 135M-parameter model at 1k-4k contexts is dominated by its weights and by
dispatch, on a host shared with other work (``load_average_1min`` in every row), so their ratios say only that the
script runs end to end and which way things go. ``e2e_compile_8b_cpu.json`` is the CPU proxy for the "decode loop
of the 8B model compiles in <= 60 s" goal: XLA:CPU compile seconds at 32k, batch 1, not the GPU/TPU compiler's.
Its ``memory_analysis`` temporaries (~31 GiB) are XLA:CPU's float32 copies of the bf16 weights (the CPU upcasts
bf16 dots), not what a GPU or TPU needs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import types
from collections import deque
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import command_line, commit, device_fields, git_dirty, load_average, write_json  # noqa: E402
from bench_common import context_label, fmt, parse_budgets, parse_contexts, parse_ints  # noqa: E402
from decode import SMOLLM2_135M, TINY, cannot_run  # noqa: E402  (shared with benchmarks/decode.py)
from e2e_torch import DONE, ROW  # noqa: E402  (the torch side's protocol; it imports no torch itself)

from kvjax import engine, methods, model as M  # noqa: E402
from kvjax.config import ModelConfig, RopeConfig  # noqa: E402
from kvjax.methods.base import Capacity, tree_bytes  # noqa: E402
from kvjax.engine.sampling import Greedy  # noqa: E402

#: Llama-3.1-8B(-Instruct)'s shapes (its config.json): GQA 32/8 heads, llama3 rope scaling, 128k context.
LLAMA31_8B = ModelConfig(
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope=RopeConfig(
        theta=500000.0,
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    max_position_embeddings=131072,
    tie_word_embeddings=False,
)
MODELS = {"llama-3.1-8b": LLAMA31_8B, "smollm2": SMOLLM2_135M, "tiny": TINY}

#: The papers' end-to-end speed figures, each with its source. Keys of ``*_by_context`` are prompt tokens.
PAPERS = {
    "chelsea": {
        "source": "Chelsea, Table 3: Llama-3.1-8B-Instruct, 20% budget, batch 1, HF Transformers",
        "method": "chelsea",
        "budget": 0.2,
        "batch": 1,
        "tpot_speedup_by_context": {16384: 1.23, 32768: 1.97, 65536: 3.19},
        "ttft_overhead_by_context": {16384: 0.017, 32768: 0.022, 65536: 0.007},
        "note": "TTFT overhead = TTFT(Chelsea)/TTFT(Full) - 1 from Table 3's seconds; <= 8.4% over Tables 3 and 9",
    },
    "clusterkv": {
        "source": "ClusterKV, Fig. 12 (numbers in the text): Llama-3.1-8B, prompt 32k, 1024 decode tokens, B = 1024",
        "method": "clusterkv",
        "budget": 1024,
        "batch": 1,
        "context": 32768,
        "e2e_speedup": 2.0,
        "throughput_ratio_max": 2.5,
        "compress_share_of_prefill": (0.06, 0.08),
        "note": "the paper offloads to CPU on a 48 GB GPU; its decode length is 1024 (ours: --new-tokens)",
    },
    "chunkkv": {
        "source": "ChunkKV, Table 8: A40, LLaMA3-8B-Instruct, batch 1, FlashAttention-2, 8192 in / 1024 out",
        "method": "chunkkv",
        "batch": 1,
        "context": 8192,
        "throughput_gain_reuse_vs_full": 0.265,
        "throughput_gain_noreuse_vs_full": 0.244,
        "throughput_gain_reuse_vs_noreuse": 232.99 / 228.96 - 1,
        "note": "the +26.5% is ChunkKV_reuse (reuse 2) over FullKV; reuse over plain ChunkKV is +1.8%; budget not "
        "stated in the paper",
    },
    "pqcache": {
        "source": "PQCache, Fig. 10b (qualitative: no numbers in the text): TPOT at 1/5 tokens below human reading "
        "speed (~333 tokens/min, i.e. < 0.18 s/token); TT2T the lowest of its baselines",
        "method": "pqcache",
        "budget": 0.2,
        "tpot_below_s": 0.18,
    },
    "quest": {
        "source": "Quest: 1.74x at 32k as the benchmark's brief quotes it (its table, budget and batch not checked "
        "here: Quest's paper is not among papers/)",
        "method": "quest",
        "context": 32768,
        "speedup": 1.74,
    },
}


#: The run's order within a context: kvjax's full, transformers' full and kvpress's SnapKV on it (TORCH),
#: the five papers' methods, then the baselines: Quest first (a paper figure to set beside it), PyramidKV last (its
#: per-layer budgets compile the most: 93 s of XLA:CPU at 8B, 32k), then any other registered method.
TORCH = ("transformers", "kvpress")
PRIORITY = ("full", *TORCH, "chelsea", "clusterkv", "pqcache", "chunkkv", "less")
PRIORITY += ("quest", "snapkv", "h2o", "streaming_llm", "pyramidkv")


def default_methods() -> str:
    return ",".join(PRIORITY + tuple(n for n in methods.names() if n not in PRIORITY))


def variants(names, budgets, token_budgets, reuses) -> list[tuple[str, object, object]]:
    """``(label, method, budget)``, ``full`` first; recall methods also at the token budgets; chunkkv per reuse.
    ``transformers`` and ``kvpress`` (kvpress's SnapKV, at each fractional budget) are rows of the torch side
    (:mod:`e2e_torch`), with ``method`` None."""
    out = [("full", methods.get("full"), None)]
    for name in names:
        if name == "full":
            continue
        if name in TORCH:
            out += [("transformers", None, None)] if name == "transformers" else []
            out += [(f"kvpress_snapkv@{b}", None, b) for b in budgets if name == "kvpress" and isinstance(b, float)]
            continue
        cls = methods.REGISTRY[name] if name in methods.REGISTRY else methods.get(name)  # get raises the ValueError
        for b in list(budgets) + (list(token_budgets) if cls.recalls else []):
            if name == "chunkkv":
                for r in reuses:
                    out.append(
                        (
                            f"chunkkv{'_reuse' if r > 1 else ''}{r if r > 2 else ''}@{b}",
                            methods.get("chunkkv", budget=b, reuse=r),
                            b,
                        )
                    )
            else:
                out.append((f"{name}@{b}", methods.get(name, budget=b), b))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Parameters: abstract shapes, and random values made on the device.


def _random_params(cfg: ModelConfig, dtype, scan: bool, key):
    """``kvjax.model.random_params`` (norms 1, biases 0, the rest normal), stacked when ``scan``."""
    params = M.random_params(cfg, key, dtype)
    return M.stack_layers(params) if scan else params


def abstract_params(cfg: ModelConfig, dtype, scan: bool):
    """The parameter pytree as ``ShapeDtypeStruct`` (nothing allocated), stacked when ``scan``."""
    return jax.eval_shape(functools.partial(_random_params, cfg, dtype, scan), jax.random.PRNGKey(0))


def device_params(cfg: ModelConfig, dtype, scan: bool, seed: int = 0):
    """Random parameters made by one jitted function on the default device (the host never holds them)."""
    return jax.jit(functools.partial(_random_params, cfg, dtype, scan))(jax.random.PRNGKey(seed))


# ---------------------------------------------------------------------------------------------------------------
# Memory: what the device has, what a configuration needs.


def device_memory_bytes(device, override_gb: float | None) -> tuple[int | None, str]:
    """``(bytes, where from)``: ``--memory-gb``, else ``memory_stats()['bytes_limit']``, else the host's RAM."""
    if override_gb:
        return int(override_gb * 2**30), "--memory-gb"
    stats = memory_stats(device)
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), "memory_stats bytes_limit"
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host RAM (sysconf)"
    except (ValueError, OSError, AttributeError):
        return None, "unknown"


def memory_stats(device) -> dict:
    try:
        return device.memory_stats() or {}
    except Exception:  # noqa: BLE001  (backends without memory stats raise various errors)
        return {}


def estimate_bytes(cfg: ModelConfig, weights: int, states, batch: int, bucket: int, dtype) -> dict:
    """Weights + the method's states + prefill activations (one layer's q/k/v and attention output, the residual
    stream, the MLP's two hidden activations and the chunked attention's fp32 score blocks), in bytes; an
    estimate, not a bound (the compiled executables' ``memory_analysis`` is checked after it)."""
    it = jnp.dtype(dtype).itemsize
    d, f = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    c = min(bucket, M.ATTENTION_CHUNK)
    act = batch * bucket * (3 * d + 2 * f + 2 * qkv) * it + 2 * batch * cfg.num_heads * c * c * 4
    cache = tree_bytes(states)
    return {"weights": weights, "states": cache, "activations": int(act), "total": int(weights + cache + act)}


def memory_analysis(compiled) -> dict | None:
    """The compiled executable's sizes in bytes, and ``peak`` = arguments + outputs - aliased + temporaries."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001  (not every backend implements it)
        return None
    if m is None:
        return None
    keys = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "temp_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    out = {k: int(getattr(m, k, 0) or 0) for k in keys}
    out["peak"] = (
        out["argument_size_in_bytes"]
        + out["output_size_in_bytes"]
        - out["alias_size_in_bytes"]
        + out["temp_size_in_bytes"]
    )
    return out


# ---------------------------------------------------------------------------------------------------------------
# Compile and run one configuration.


def abstract_states(cfg, method, batch, cap, dtype, scan):
    return jax.eval_shape(lambda: engine.init_states(cfg, method, batch, cap, dtype, scan_layers=scan))


def compile_pair(cfg, method, params, states, batch, bucket, new_tokens) -> dict:
    """Lower and compile the prefill and the decode loop from abstract inputs (``params`` and ``states`` may be
    ``ShapeDtypeStruct`` trees). Returns the compiled executables, their seconds and memory analyses."""
    i32 = jnp.int32
    tokens = jax.ShapeDtypeStruct((batch, bucket), i32)
    lengths = jax.ShapeDtypeStruct((batch,), i32)
    first = jax.ShapeDtypeStruct((batch,), i32)
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    loop = engine.DecodeLoop(cfg, method, Greedy(), new_tokens, ())
    t0 = time.perf_counter()
    lowered = engine.prefill.lower(cfg, method, params, tokens, lengths, states)
    t1 = time.perf_counter()
    prefill = lowered.compile()
    t2 = time.perf_counter()
    lowered = engine.run_loop.lower(loop, "scan", params, states, first, lengths, key)
    t3 = time.perf_counter()
    decode = lowered.compile()
    t4 = time.perf_counter()
    return {
        "prefill": prefill,
        "decode": decode,
        "prefill_lower_s": t1 - t0,
        "prefill_compile_s": t2 - t1,
        "decode_lower_s": t3 - t2,
        "decode_compile_s": t4 - t3,
        "memory_analysis": {"prefill": memory_analysis(prefill), "decode": memory_analysis(decode)},
    }


@functools.lru_cache(maxsize=None)
def _init_fn(cfg, method, batch, cap, dtype, scan):
    """The jitted, argument-free state constructor (states are made on the device, in one program)."""
    return jax.jit(lambda: engine.init_states(cfg, method, batch, cap, dtype, scan_layers=scan))


_argmax = jax.jit(lambda logits: jnp.argmax(logits, -1).astype(jnp.int32))


def time_run(cfg, method, params, comp, tokens, lengths, batch, cap, dtype, scan, repeats) -> dict:
    """Warm-up run, then ``repeats`` timed runs of prefill (+ first token) and of the decode loop; medians."""
    init = _init_fn(cfg, method, batch, cap, dtype, scan)
    dev = jax.devices()[0]
    ttft, dec, after_prefill, after_decode, out, states = [], [], None, None, None, None
    for i in range(repeats + 1):
        states = out = None  # free the previous run's buffers first
        states = init()
        jax.block_until_ready(states)
        t0 = time.perf_counter()
        states, logits = comp["prefill"](params, tokens, lengths, states)
        first = _argmax(logits)
        first.block_until_ready()
        t1 = time.perf_counter()
        after_prefill = memory_stats(dev).get("bytes_in_use")
        out, steps, states = comp["decode"](params, states, first, lengths, jax.random.PRNGKey(0))
        out.block_until_ready()
        t2 = time.perf_counter()
        after_decode = memory_stats(dev).get("bytes_in_use")
        if i:  # the first run warms up
            ttft.append(t1 - t0)
            dec.append(t2 - t1)
    steps = int(steps) - 1  # decode steps the loop ran (the first token came from prefill)
    decode_s = statistics.median(dec)
    stats = memory_stats(dev)
    return {
        "ttft_s": statistics.median(ttft),
        "decode_s": decode_s,
        "decode_steps": steps,
        "tpot_s": decode_s / steps,
        "throughput_tok_s": batch * steps / decode_s,
        "e2e_s": statistics.median(ttft) + decode_s,
        "ttft_runs_s": ttft,
        "decode_runs_s": dec,
        "bytes_in_use_after_prefill": after_prefill,
        "bytes_in_use_after_decode": after_decode,
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "cache_bytes": engine.memory_bytes(method, states),
        "kv_bytes_read_per_step": engine.bytes_read_per_step(method, states, cfg.num_heads),  # after the last step
        "tokens_held_per_seq": float(np.mean(engine.tokens_held(method, states))),
    }


def add_ratios(r: dict, full: dict | None) -> None:
    """Ratios of ``r`` to the ``full`` row of the same run (same context and batch); None when full did not run."""
    keys = (
        "tpot_speedup_vs_full",
        "ttft_overhead_vs_full",
        "throughput_ratio_vs_full",
        "e2e_speedup_vs_full",
        "compress_share_of_prefill",
        "cache_ratio_vs_full",
    )
    if full is None or full.get("status") != "ok":
        r.update(dict.fromkeys(keys), full_row=None)
        return
    r["full_row"] = full["row_id"]
    r["tpot_speedup_vs_full"] = full["tpot_s"] / r["tpot_s"]
    r["ttft_overhead_vs_full"] = r["ttft_s"] / full["ttft_s"] - 1
    r["throughput_ratio_vs_full"] = r["throughput_tok_s"] / full["throughput_tok_s"]
    r["e2e_speedup_vs_full"] = full["e2e_s"] / r["e2e_s"]
    r["compress_share_of_prefill"] = (r["ttft_s"] - full["ttft_s"]) / r["ttft_s"]
    r["cache_ratio_vs_full"] = r["cache_bytes"] / full["cache_bytes"]


def weights_read_bytes(cfg: ModelConfig, weights: int, dtype) -> int:
    """Bytes of weights one decode step reads: all of them but the embedding table, of which it gathers one row per
    sequence (an untied LM head is read whole; a tied one is the table, read whole)."""
    return (
        weights if cfg.tie_word_embeddings else weights - cfg.vocab_size * cfg.hidden_size * jnp.dtype(dtype).itemsize
    )


# ---------------------------------------------------------------------------------------------------------------
# The torch side (transformers, kvpress), in its own process.


class TorchSide:
    """``benchmarks/e2e_torch.py`` in its own process (``python``), started on the first request and kept for the
    run (its model is built once per config). :meth:`rows` yields its answers, or a failed row per label where the
    process dies or runs past ``timeout`` seconds (then the next request starts a new one)."""

    def __init__(self, python: str, dtype: str, timeout: float):
        self.python, self.dtype, self.timeout, self.proc = python, dtype, timeout, None

    def rows(self, req: dict):
        if self.proc is None:
            cmd = [self.python, str(Path(__file__).resolve().parent / "e2e_torch.py"), self.dtype]
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
            )
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except OSError:  # it has ended: its output says why (read below)
            pass
        timer, tail, got = threading.Timer(self.timeout, self.proc.kill), deque(maxlen=12), set()
        timer.start()
        try:
            for line in self.proc.stdout:
                if line.startswith(ROW):
                    got.add((r := json.loads(line[len(ROW) :]))["label"])
                    yield r
                elif line.strip() == DONE:
                    return
                else:
                    tail.append(line.rstrip())
                    print(f"  [torch] {line.rstrip()}", flush=True)
        finally:
            timer.cancel()
        rc = self.proc.wait()
        self.proc = None
        why = f"the torch process ended (rc {rc}, limit {self.timeout:.0f} s): " + " | ".join(tail)[-600:]
        yield from ({"label": lb, "status": "failed", "skipped": why} for lb in req["labels"] if lb not in got)

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            self.proc.wait(timeout=60)
            self.proc = None


# ---------------------------------------------------------------------------------------------------------------
# Resume: rows measured at this commit are kept, not measured again.


def row_key(row: dict, head: dict) -> str:
    """What makes two rows the same measurement: model, context, batch, new tokens, dtype, layout, repeats, label,
    and ``XLA_FLAGS`` where set."""
    keys = (row["model"], row["context"], row["batch"], row["new_tokens"], head["dtype"], head["scan_layers"])
    flags = (head["xla_flags"],) if head.get("xla_flags") else ()
    return "|".join(map(str, keys + (head["repeats"], row["label"]) + flags))


def resume(path: Path, head: dict) -> list[dict]:
    """The measured (``ok``) rows of an earlier run's JSON at ``path`` made at this commit, renumbered (``row_id``,
    ``full_row``); the others are measured again. A JSON of another commit is moved aside to
    ``<stem>.<its commit>.json``, not overwritten. ``head["commands"]`` gets the earlier invocations' commands."""
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    if old.get("commit") != head["commit"] or old.get("compile_only"):
        aside = path.with_name(f"{path.stem}.{str(old.get('commit'))[:10]}{path.suffix}")
        path.rename(aside)
        print(f"{path} was written at commit {old.get('commit')}; moved to {aside}", flush=True)
        return []
    rows = [r for r in old["rows"] if r.get("status") == "ok" and r.get("key")]
    ids = {r["row_id"]: i for i, r in enumerate(rows)}
    for i, r in enumerate(rows):
        r["row_id"], r["full_row"] = i, ids.get(r.get("full_row"))
    head["commands"] = old.get("commands", [old.get("command")]) + head["commands"]
    print(f"resuming {path}: {len(rows)} rows measured at this commit are kept", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Output: JSON, table, papers, plot.


def header(args, cfg, dtype, limit, limit_from) -> dict:
    return {
        "benchmark": "e2e",
        **device_fields(jaxlib=True),
        "device_count": jax.device_count(),
        "commit": commit(),
        "commit_dirty": git_dirty("kvjax", "benchmarks/e2e.py"),  # uncommitted changes
        "command": command_line(),
        "commands": [command_line()],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "model": args.model,
        "model_config": dataclasses.asdict(cfg),
        "dtype": str(jnp.dtype(dtype)),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "memory_limit_bytes": limit,
        "memory_limit_from": limit_from,
        "compile_only": args.compile_only,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),  # compiler options change what a row measures
        "papers": PAPERS,
        "note": (
            "CPU run: not the papers' setting (no HBM bandwidth to save; small model and contexts)"
            if jax.default_backend() == "cpu"
            else ""
        ),
    }


def table(rows) -> str:
    lines = []
    ok = [r for r in rows if "ttft_s" in r or r.get("status") in ("skipped", "failed")]
    for n, b in dict.fromkeys((r["context"], r["batch"]) for r in ok):
        lines.append(
            f"\n== context {context_label(n)} ({next(r['prompt_len'] for r in ok if r['context'] == n)} "
            f"tokens), batch {b} =="
        )
        lines.append(
            f"{'method':24s} {'TTFT ms':>10s} {'TPOT ms':>9s} {'tok/s':>9s} {'speedup':>7s} {'TTFT+':>7s} "
            f"{'thr x':>6s} {'e2e x':>6s} {'comp%':>6s} {'cache MiB':>10s} {'exec GiB':>8s}"
        )
        for r in (r for r in ok if r["context"] == n and r["batch"] == b):
            if r.get("status") != "ok":
                lines.append(f"{r['label']:24s} {r['status']}: {r['skipped'][:100]}")
                continue
            peak = peak_bytes(r)
            lines.append(
                f"{r['label']:24s} {1e3 * r['ttft_s']:10.1f} {1e3 * r['tpot_s']:9.2f} {r['throughput_tok_s']:9.1f} "
                f"{fmt(r['tpot_speedup_vs_full'], '7.2f')} {fmt(r['ttft_overhead_vs_full'], '+7.1%')} "
                f"{fmt(r['throughput_ratio_vs_full'], '6.2f')} {fmt(r['e2e_speedup_vs_full'], '6.2f')} "
                f"{fmt(r['compress_share_of_prefill'], '6.1%')} {r['cache_bytes'] / 2**20:10.1f} {peak / 2**30:8.2f}"
            )
    return "\n".join(lines)


def peak_bytes(r: dict) -> int:
    """A row's peak device bytes: the torch side's ``max_memory_allocated``; for kvjax, the larger
    ``memory_analysis`` peak of its two executables (``peak_bytes_in_use`` is the process's, monotone over rows)."""
    if r.get("torch_version"):
        return r.get("peak_bytes_in_use") or 0
    ma = r.get("memory_analysis") or {}
    return (
        max((ma.get(k) or {}).get("peak", 0) for k in ("prefill", "decode")) or r.get("bytes_in_use_after_prefill") or 0
    )


def _find(rows, method_label, context=None, batch=1):
    for r in rows:
        if (
            r.get("status") == "ok"
            and r["label"] == method_label
            and r["batch"] == batch
            and (context is None or r["context"] == context)
        ):
            return r
    return None


def papers_block(rows) -> str:
    """The papers' figures beside ours at the matching setting (ours: '-' where that row was not run)."""
    p, lines = PAPERS, ["\n== papers vs this run (different hardware and stacks: compare directions, not digits) =="]
    c = p["chelsea"]
    lines.append(f"Chelsea ({c['source']}):")
    for n, s in c["tpot_speedup_by_context"].items():
        r = _find(rows, "chelsea@0.2", n)
        lines.append(
            f"  {context_label(n):>4s}: TPOT speedup paper {s:.2f}x, ours "
            f"{fmt(r and r['tpot_speedup_vs_full'], '.2f', 'x')}"
            f" | TTFT overhead paper {c['ttft_overhead_by_context'][n]:+.1%}, ours "
            f"{fmt(r and r['ttft_overhead_vs_full'], '+.1%')}"
        )
    c = p["clusterkv"]
    r = _find(rows, "clusterkv@1024", c["context"])
    lines.append(
        f"ClusterKV ({c['source']}):\n  32k B=1024: e2e latency speedup paper {c['e2e_speedup']:.1f}x, ours "
        f"{fmt(r and r['e2e_speedup_vs_full'], '.2f', 'x')} | decode throughput paper up to "
        f"{c['throughput_ratio_max']:.1f}x, ours {fmt(r and r['throughput_ratio_vs_full'], '.2f', 'x')} | "
        f"clustering share of prefill paper 6-8%, ours {fmt(r and r['compress_share_of_prefill'], '.1%')}"
    )
    c = p["chunkkv"]
    lines.append(f"ChunkKV ({c['source']}):")
    for bud in ("0.1", "0.2"):
        ru, rn = _find(rows, f"chunkkv_reuse@{bud}", c["context"]), _find(rows, f"chunkkv@{bud}", c["context"])
        gain = ru["throughput_tok_s"] / rn["throughput_tok_s"] - 1 if ru and rn else None
        ru_gain, rn_gain = (
            None if x is None or x.get("throughput_ratio_vs_full") is None else x["throughput_ratio_vs_full"] - 1
            for x in (ru, rn)
        )
        lines.append(
            f"  8k @{bud}: throughput reuse vs full paper {c['throughput_gain_reuse_vs_full']:+.1%}, ours "
            f"{fmt(ru_gain, '+.1%')} | no reuse vs full paper "
            f"{c['throughput_gain_noreuse_vs_full']:+.1%}, ours "
            f"{fmt(rn_gain, '+.1%')} | reuse vs no reuse paper "
            f"{c['throughput_gain_reuse_vs_noreuse']:+.1%}, ours {fmt(gain, '+.1%')}"
        )
    c = p["pqcache"]
    lines.append(f"PQCache ({c['source']}):")
    for r in (r for r in rows if r.get("status") == "ok" and r["label"] == "pqcache@0.2"):
        lines.append(
            f"  {context_label(r['context']):>4s} batch {r['batch']}: TPOT {1e3 * r['tpot_s']:.1f} ms "
            f"({'below' if r['tpot_s'] < c['tpot_below_s'] else 'ABOVE'} the paper's 0.18 s), TPOT speedup "
            f"{fmt(r['tpot_speedup_vs_full'], '.2f', 'x')}, TTFT overhead "
            f"{fmt(r['ttft_overhead_vs_full'], '+.1%')}"
        )
    return "\n".join(lines)


#: A row short of its bytes-allowed ceiling by more than this is flagged for a profile.
SHORT_OF_CEILING = 0.15


def ceiling(r: dict, full: dict) -> dict:
    """The bytes-allowed ceiling of row ``r`` at kvjax ``full``'s measured bandwidth (same context and batch):
    ``bw = (weights + full's KV bytes a step reads) / TPOT(full)`` [bytes/s], ``tpot = (weights + r's KV bytes) /
    bw`` [s]; ``speedup`` = TPOT(full) / that tpot; ``short`` = TPOT(r) / that tpot - 1 (> 0: slower than its
    bytes allow)."""
    bw = (full["weights_bytes_read_per_step"] + full["kv_bytes_read_per_step"]) / full["tpot_s"]
    tpot = (r["weights_bytes_read_per_step"] + r["kv_bytes_read_per_step"]) / bw
    return {"bandwidth_bytes_s": bw, "tpot_s": tpot, "speedup": full["tpot_s"] / tpot, "short": r["tpot_s"] / tpot - 1}


def paper_figure(label: str, context: int, batch: int) -> str:
    """The papers' figure (:data:`PAPERS`) for this row's setting, or ''."""
    p = PAPERS
    if batch != 1:
        return ""
    if label == "chelsea@0.2" and context in p["chelsea"]["tpot_speedup_by_context"]:
        c = p["chelsea"]
        return (
            f"Chelsea T3: TPOT {c['tpot_speedup_by_context'][context]:.2f}x, "
            f"TTFT {c['ttft_overhead_by_context'][context]:+.1%}"
        )
    if label == "clusterkv@1024" and context == p["clusterkv"]["context"]:
        return f"ClusterKV: e2e {p['clusterkv']['e2e_speedup']:.1f}x (B=1024)"
    if label.startswith("quest@") and context == p["quest"]["context"]:
        return f"Quest: {p['quest']['speedup']:.2f}x (quoted, unchecked)"
    if label == "pqcache@0.2":
        return f"PQCache: TPOT < {p['pqcache']['tpot_below_s']:.2f} s"
    if label.startswith("chunkkv") and context == p["chunkkv"]["context"]:
        return f"ChunkKV T8: thr {p['chunkkv']['throughput_gain_reuse_vs_full']:+.1%} (reuse)"
    return ""


def summary(rows) -> list[dict]:
    """One dict per row (every status), with the ratios the markdown table shows: vs kvjax ``full`` and vs
    transformers' full (``transformers``) of the same context and batch, the bytes-allowed ceiling
    (:func:`ceiling`) and the papers' figure. Ratios are None where their reference row did not run."""
    out = []
    for r in rows:
        s = {k: r.get(k) for k in ("context", "batch", "label", "status", "skipped", "ttft_s", "tpot_s")}
        s.update(paper=paper_figure(r["label"], r["context"], r["batch"]), ceiling=None, short=None)
        s["torch"] = bool(r.get("torch_version") or r["label"] in TORCH or r["label"].startswith("kvpress"))
        full, hf = (_find(rows, lb, r["context"], r["batch"]) for lb in ("full", "transformers"))
        if r.get("status") == "ok":
            s["throughput_tok_s"] = r["throughput_tok_s"]
            s["vs_full"] = full and full["tpot_s"] / r["tpot_s"]
            s["ttft_vs_full"] = full and r["ttft_s"] / full["ttft_s"] - 1
            s["vs_transformers"] = hf and hf["tpot_s"] / r["tpot_s"]
            if full and "kv_bytes_read_per_step" in full and "kv_bytes_read_per_step" in r:
                c = ceiling(r, full)
                s["ceiling"], s["short"] = c["speedup"], c["short"]
            s["peak_gib"] = peak_bytes(r) / 2**30
            s["compile_s"] = r.get("prefill_compile_s") and r["prefill_compile_s"] + r["decode_compile_s"]
        out.append(s)
    return out


def markdown(data: dict) -> str:
    """The table for docs/performance.md from a run's JSON: per context and batch, a row per method@budget."""
    rows, torch_row = data["rows"], next((r for r in data["rows"] if r.get("torch_version")), {})
    lines = [
        f"{data['model']} ({data['dtype']}), {data['device_kind']} ({data['backend']}), jax {data['jax_version']}, "
        f"torch {torch_row.get('torch_version', '-')}, transformers {torch_row.get('transformers_version', '-')} "
        f"({torch_row.get('attn_implementation', '-')}), kvpress {torch_row.get('kvpress_version', '-')}, commit "
        f"`{(data.get('commit') or '?')[:10]}`, {data['new_tokens']} new tokens, scan_layers {data.get('scan_layers')}"
        + (f", XLA_FLAGS `{data['xla_flags']}`" if data.get("xla_flags") else "")
    ]
    head = (
        "| method | TTFT s | TTFT vs full | TPOT ms | tok/s | × full | × transformers | ceiling × | short of ceiling "
        "| papers | peak GiB | compile s |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    summ = summary(rows)
    for n, b in dict.fromkeys((s["context"], s["batch"]) for s in summ):
        lines += ["", f"**{context_label(n)} tokens, batch {b}**", "", head]
        for s in (s for s in summ if (s["context"], s["batch"]) == (n, b)):
            if s["status"] != "ok":
                lines.append(f"| `{s['label']}` | {s['status']}: {s['skipped'][:120]} |" + " |" * 10)
                continue
            short = fmt(s["short"], "+.0%") + (
                " **profile**" if (s["short"] or 0) > SHORT_OF_CEILING and not s["torch"] else ""
            )
            lines.append(
                f"| `{s['label']}` | {s['ttft_s']:.3f} | {fmt(s['ttft_vs_full'], '+.1%')} | {1e3 * s['tpot_s']:.2f} | "
                f"{s['throughput_tok_s']:.1f} | {fmt(s['vs_full'], '.2f')} | {fmt(s['vs_transformers'], '.2f')} | "
                f"{fmt(s['ceiling'], '.2f')} | {short} | {s['paper']} | {s['peak_gib']:.1f} | "
                f"{fmt(s['compile_s'], '.1f')} |"
            )
    return "\n".join(lines)


def plot(rows, path: Path) -> str:
    """TPOT speedup vs context, one line per method@budget, one panel per batch; returns what was done."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not importable"
    ok = [r for r in rows if r.get("status") == "ok" and r.get("tpot_speedup_vs_full") is not None]
    batches = sorted({r["batch"] for r in ok})
    if not batches:
        return "plot skipped: no rows with a speedup"
    fig, axes = plt.subplots(1, len(batches), figsize=(7 * len(batches), 5), squeeze=False)
    for ax, b in zip(axes[0], batches):
        ax.set_prop_cycle(color=plt.cm.tab20.colors)  # 29 method@budget lines: 20 colours, then markers differ
        for label in dict.fromkeys(r["label"] for r in ok if r["batch"] == b):
            pts = sorted(
                (r["context"], r["tpot_speedup_vs_full"]) for r in ok if r["batch"] == b and r["label"] == label
            )
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="os^v"[len(ax.lines) // 20 % 4], label=label)
        ch = PAPERS["chelsea"]["tpot_speedup_by_context"]
        if b == 1 and max(r["context"] for r in ok) >= min(ch):  # only on the papers' context range
            ax.plot(list(ch), list(ch.values()), "k--", marker="x", label="Chelsea paper (Table 3)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("TPOT speedup vs full")
        ax.set_title(f"{ok[0]['model']}, batch {b} ({jax.devices()[0].device_kind})")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"wrote {path}"


# ---------------------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS))
    ap.add_argument(
        "--contexts",
        type=parse_contexts,
        default=parse_contexts("8k,16k,32k,64k,128k"),
        help="prompt lengths, comma-separated (Nk = N * 1024 tokens)",
    )
    ap.add_argument("--batch", type=parse_ints, default=[1, 8], help="batch sizes, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=256, help="tokens generated (1 from prefill + the loop's)")
    ap.add_argument(
        "--methods",
        default=default_methods(),
        help="registered methods and 'transformers', 'kvpress' (the torch side), comma-separated, in the order they "
        "run at each context (default: PRIORITY, then the other registered methods; full always runs first)",
    )
    ap.add_argument("--budgets", type=parse_budgets, default=[0.1, 0.2], help="budgets of every method")
    ap.add_argument(
        "--token-budgets",
        type=parse_budgets,
        default=[1024, 2048],
        help="extra token budgets of the recall methods (pqcache, clusterkv, quest); '' for none",
    )
    ap.add_argument(
        "--chunkkv-reuse",
        type=parse_ints,
        default=[1, 2],
        help="ChunkKV reuse values (1: no index reuse, 2: the paper's ChunkKV_reuse)",
    )
    ap.add_argument(
        "--scan-layers",
        choices=("auto", "on", "off"),
        default="auto",
        help="stacked layers, one compiled loop body (auto: on for llama-3.1-8b)",
    )
    ap.add_argument(
        "--layouts",
        default=None,
        help="--compile-only: layouts to compile, 'scan', 'unrolled' or 'scan,unrolled' "
        "(default: the --scan-layers one)",
    )
    ap.add_argument(
        "--unrolled-methods",
        default=None,
        help="--compile-only: compile the unrolled layout only for these labels (e.g. full,snapkv@0.2)",
    )
    ap.add_argument("--dtype", default="bfloat16", help="weights and cache dtype (the papers': bfloat16)")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs after the warm-up (median)")
    ap.add_argument(
        "--memory-gb",
        type=float,
        default=None,
        help="device memory for the skip rule (default: memory_stats bytes_limit, else host RAM)",
    )
    ap.add_argument(
        "--compile-only",
        action="store_true",
        help="lower + compile prefill and decode loop from abstract inputs; nothing allocated or run",
    )
    ap.add_argument(
        "--torch-python",
        default=sys.executable,
        help="the Python of the torch side (transformers, kvpress rows): torch and transformers importable there",
    )
    ap.add_argument("--torch-timeout", type=float, default=900.0, help="seconds one torch row may take")
    ap.add_argument(
        "--out",
        default="benchmarks/results/e2e.json",
        help="the JSON, rewritten after every row; rows already in it at this commit are not measured again",
    )
    ap.add_argument(
        "--report",
        default=None,
        metavar="JSON",
        help="only redraw the table (.txt) and plot (.png) of an earlier run's JSON, beside it",
    )
    return ap


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.report:
        report(json.loads(Path(args.report).read_text()), Path(args.report))
        return 0
    if args.new_tokens < 2:
        ap.error("--new-tokens must be >= 2 (one from prefill, at least one decode step)")
    run = _Run(args)
    for i_ctx, n_req in enumerate(args.contexts):
        n = min(n_req, run.cfg.max_position_embeddings - args.new_tokens)
        bucket = run.bucket_of(n_req)
        later_buckets = {run.bucket_of(c) for c in args.contexts[i_ctx + 1 :]}
        _init_fn.cache_clear()  # executables are not kept longer than needed: XLA:CPU maps each one's code into
        jax.clear_caches()  # memory, and a few dozen 30-layer programs exhaust the process's memory maps
        for b in args.batch:
            base = {
                "model": args.model,
                "context": n_req,
                "prompt_len": n,
                "bucket": bucket,
                "batch": b,
                "new_tokens": args.new_tokens,
            }
            run.full_row = run.tokens = None
            for label, method, budget in run.todo:
                row = {
                    **base,
                    "label": label,
                    "method": methods.method_of(method).name if method else label.split("@")[0],
                    "budget": budget,
                    "reuse": getattr(method, "reuse", None) if method and method.name == "chunkkv" else None,
                }
                row["key"] = row_key(row, run.head)
                if row["key"] in run.done:  # measured at this commit by an earlier invocation: not again
                    run.full_row = run.done[row["key"]] if label == "full" else run.full_row
                    print(f"{context_label(n_req):>5s} b={b} {label:22s} done (row {run.done[row['key']]['row_id']})")
                    continue
                if method is None:
                    run.torch_row(row)
                    continue
                reason = cannot_run(
                    types.SimpleNamespace(config=run.cfg, dtype=run.dtype), method, n, args.new_tokens - 1
                )
                if args.compile_only:
                    run.compile_only(row, label, method, reason)
                else:
                    run.timed(row, label, method, reason, bucket in later_buckets)
    run.torch.close()
    if not args.compile_only:
        report({**run.head, "rows": run.rows}, run.out_path)
    print(f"wrote {run.out_path}", flush=True)
    return 0


class _Run:
    """One invocation of :func:`main`: the model's shapes (and weights, unless ``--compile-only``), the rows so
    far (the JSON is rewritten after every row, so a crash keeps what was measured) and the executables kept for
    a later context in the same bucket."""

    def __init__(self, args):
        self.args = args
        self.cfg, self.dtype = MODELS[args.model], jnp.dtype(args.dtype)
        self.scan = args.scan_layers == "on" or (args.scan_layers == "auto" and args.model == "llama-3.1-8b")
        self.layouts = (args.layouts or ("scan" if self.scan else "unrolled")).split(",")
        self.limit, self.limit_from = device_memory_bytes(jax.devices()[0], args.memory_gb)
        names = [m.strip() for m in args.methods.split(",") if m.strip()]
        self.todo = variants(names, args.budgets, args.token_budgets, args.chunkkv_reuse)
        self.out_path = Path(args.out)
        self.out_path.parent.mkdir(parents=True, exist_ok=True)
        self.head = {**header(args, self.cfg, self.dtype, self.limit, self.limit_from), "scan_layers": self.scan}
        self.rows = [] if args.compile_only else resume(self.out_path, self.head)
        self.done = {r["key"]: r for r in self.rows}
        self.torch = TorchSide(args.torch_python, self.dtype.name, args.torch_timeout)
        print(
            f"e2e: {args.model} {self.dtype.name} on {jax.devices()[0].device_kind} ({jax.default_backend()}), "
            f"memory limit {fmt(self.limit and self.limit / 2**30, '.1f')} GiB ({self.limit_from}), "
            f"scan_layers={self.scan}",
            flush=True,
        )
        self.shapes = {
            lay: abstract_params(self.cfg, self.dtype, lay == "scan")
            for lay in set(self.layouts) | {"scan" if self.scan else "unrolled"}
        }
        self.weights = tree_bytes(next(iter(self.shapes.values())))
        self.weights_read = weights_read_bytes(self.cfg, self.weights, self.dtype)
        self.params = None if args.compile_only else device_params(self.cfg, self.dtype, self.scan)
        self.rng = np.random.default_rng(0)
        self.compiled: dict = {}
        self.full_row = self.tokens = self.lengths = None

    def bucket_of(self, n_req: int) -> int:
        return engine.bucket_length(min(n_req, self.cfg.max_position_embeddings - self.args.new_tokens))

    def add(self, row: dict) -> None:
        row["row_id"] = len(self.rows)
        row["commit"], row["measured_at"] = self.head["commit"], time.strftime("%Y-%m-%dT%H:%M:%S%z")
        row["load_average_1min"] = load_average()  # other work on the host skews timings (CPU runs)
        self.rows.append(row)
        write_json(self.out_path, {**self.head, "rows": self.rows}, default=str)

    def compile_only(self, row: dict, label: str, method, reason) -> None:
        """``--compile-only``: lower and compile the prefill and the decode loop per layout, from abstract shapes."""
        args, b, where = self.args, row["batch"], f"{context_label(row['context']):>5s} b={row['batch']} {label:22s}"
        for lay in self.layouts:
            if lay == "unrolled" and args.unrolled_methods and label not in args.unrolled_methods.split(","):
                continue
            r = {**row, "layout": lay, "scan_layers": lay == "scan"}
            if reason:
                self.add({**r, "status": "skipped", "skipped": reason})
                print(f"{where} {lay:8s} skipped: {reason}", flush=True)
                continue
            st = abstract_states(
                self.cfg, method, b, Capacity(row["bucket"], args.new_tokens), self.dtype, lay == "scan"
            )
            comp = compile_pair(self.cfg, method, self.shapes[lay], st, b, row["bucket"], args.new_tokens)
            r.update(
                {k: v for k, v in comp.items() if k not in ("prefill", "decode")},
                status="ok",
                estimate_bytes=estimate_bytes(self.cfg, self.weights, st, b, row["bucket"], self.dtype),
            )
            self.add(r)
            print(
                f"{where} {lay:8s} prefill: lower {r['prefill_lower_s']:6.1f}s compile "
                f"{r['prefill_compile_s']:6.1f}s | decode loop: lower {r['decode_lower_s']:6.1f}s compile "
                f"{r['decode_compile_s']:6.1f}s",
                flush=True,
            )

    def timed(self, row: dict, label: str, method, reason, keep: bool) -> None:
        """Compile (or reuse; ``keep``: keep for a later context of the same bucket) and time one configuration;
        skipped, with the reason, where it cannot run or does not fit."""
        args, b, bucket = self.args, row["batch"], row["bucket"]
        cap, where = Capacity(bucket, args.new_tokens), f"{context_label(row['context']):>5s} b={b} {label:22s}"
        row["scan_layers"] = self.scan
        if reason is None:
            st = abstract_states(self.cfg, method, b, cap, self.dtype, self.scan)
            est = row["estimate_bytes"] = estimate_bytes(self.cfg, self.weights, st, b, bucket, self.dtype)
            reason = self._too_big(est)
        if reason is None:
            key = (label, b)  # later contexts in the same bucket reuse the executables
            row["compile_reused"] = key in self.compiled
            comp = self.compiled.pop(key, None) or compile_pair(
                self.cfg, method, self.params, st, b, bucket, args.new_tokens
            )
            if keep:
                self.compiled[key] = comp
            row.update({k: v for k, v in comp.items() if k not in ("prefill", "decode")})
            peak = max((m or {}).get("peak", 0) for m in comp["memory_analysis"].values())
            if self.limit and peak > self.limit:
                reason = (
                    f"compiled executables need {peak / 2**30:.1f} GiB (memory_analysis) > the "
                    f"device's {self.limit / 2**30:.1f} GiB ({self.limit_from})"
                )
        if reason:
            row.update(status="skipped", skipped=reason)
            self.add(row)
            self.full_row = row if label == "full" else self.full_row
            print(f"{where} skipped: {reason}", flush=True)
            return
        if self.tokens is None:
            tokens, lengths = engine.pad_prompts(
                self.rng.integers(1, self.cfg.vocab_size, (b, row["prompt_len"])).tolist(), bucket
            )
            self.tokens, self.lengths = jnp.asarray(tokens), jnp.asarray(lengths)
        row.update(
            time_run(
                self.cfg,
                method,
                self.params,
                comp,
                self.tokens,
                self.lengths,
                b,
                cap,
                self.dtype,
                self.scan,
                args.repeats,
            ),
            status="ok",
        )
        if label == "full":
            self.full_row = row
            row["row_id"] = len(self.rows)
        self._record_ok(
            row,
            where,
            lambda r: (
                f"TTFT {fmt(r['ttft_overhead_vs_full'], '+.1%')}  compile prefill {r['prefill_compile_s']:.1f}s "
                f"loop {r['decode_compile_s']:.1f}s"
            ),
        )

    def torch_row(self, row: dict) -> None:
        """One row of the torch side (transformers' full cache, kvpress's SnapKV), in its process; skipped or failed
        with the reason where torch, transformers or kvpress cannot run it."""
        req = {
            "config": dataclasses.asdict(self.cfg),
            "prompt_len": row["prompt_len"],
            "batch": row["batch"],
            "new_tokens": self.args.new_tokens,
            "labels": [row["label"]],
            "seed": 0,
        }
        for r in self.torch.rows(req):
            row.update(r)
        where = f"{context_label(row['context']):>5s} b={row['batch']} {row['label']:22s}"
        if row["status"] != "ok":
            self.add(row)
            print(f"{where} {row['status']}: {row['skipped']}", flush=True)
            return
        self._record_ok(
            row,
            where,
            lambda r: (
                f"({r['attn_implementation']}, torch {r['torch_version']}, transformers {r['transformers_version']})"
            ),
        )

    def _record_ok(self, row: dict, where: str, detail) -> None:
        """A measured row (kvjax's or the torch side's): the weights it reads, its ratios to this context's full
        row, written, and printed with ``detail(row)`` (after the ratios)."""
        row["weights_bytes_read_per_step"] = self.weights_read
        add_ratios(row, self.full_row)
        self.add(row)
        print(
            f"{where} TTFT {1e3 * row['ttft_s']:9.1f} ms  TPOT {1e3 * row['tpot_s']:8.2f} ms  "
            f"{row['throughput_tok_s']:8.1f} tok/s  x{fmt(row['tpot_speedup_vs_full'], '.2f')} TPOT  {detail(row)}",
            flush=True,
        )

    def _too_big(self, est: dict):
        if self.limit and est["total"] > self.limit:
            return (
                f"estimated memory {est['total'] / 2**30:.1f} GiB (weights {self.weights / 2**30:.1f} + "
                f"states {est['states'] / 2**30:.1f} + activations {est['activations'] / 2**30:.1f}) "
                f"exceeds the device's {self.limit / 2**30:.1f} GiB ({self.limit_from})"
            )
        return None


def report(data: dict, out_path: Path) -> None:
    """Print the table and the papers' block of a run's JSON, write them as ``.txt`` and the plot as ``.png``."""
    rows = data["rows"]
    title = (
        f"e2e: {data['model']} ({data['dtype']}) on {data['device_kind']} ({data['backend']}), jax "
        f"{data['jax_version']}, commit {(data.get('commit') or '?')[:10]}, {data['new_tokens']} new tokens"
        + (f". {data['note']}" if data.get("note") else "")
    )
    text = title + "\n" + table(rows) + "\n" + papers_block(rows)
    print(text, flush=True)
    out_path.with_suffix(".txt").write_text(text + "\n")
    out_path.with_suffix(".md").write_text(markdown(data) + "\n")
    print(plot(rows, out_path.with_suffix(".png")), flush=True)


if __name__ == "__main__":
    sys.exit(main())
