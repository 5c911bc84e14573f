"""Measure the LESS activation capture's host memory and disk use on a model (default: the embedded SmolLM2-135M),
and project it with the formula to other sizes.

    python -m train_less.measure_capture --num-seqs 4 --seq-len 1024 --shard-mb 64 --json out.json

Run it in a fresh process per setting: peak RSS (``VmHWM``) is the process's high-water mark. Bytes per
captured sequence = ``L · S · (H · itemsize(store dtype) + 2 · Hkv · 4)`` (residuals + two policies' eviction
times, :func:`train_less.capture.seq_bytes`). Host memory: the model, plus at most one shard buffer
(``--shard-mb``, at least one sequence) plus one capture batch, whatever the number of sequences.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def project(num_layers, hidden, kv_heads, seq_len, n, itemsize, shard_mb, batch):
    per_seq = num_layers * seq_len * (hidden * itemsize + 2 * kv_heads * 4)
    return {
        "bytes_per_seq": per_seq,
        "disk_bytes": per_seq * n,
        "host_bound_bytes": max(shard_mb * 2**20, per_seq) + batch * per_seq,
        "old_in_ram_bytes": n * num_layers * seq_len * (hidden * 4 + 2 * kv_heads * (seq_len // 8)),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-seqs", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--shard-mb", type=float, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--store-dtype", default="float32")
    p.add_argument("--layers", default=None)
    p.add_argument("--dir", default=None, help="capture folder (default: a temporary one, removed)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import kvjax
    from kvjax.methods import less as L
    from train_less import capture as C
    from train_less import data
    from train_less.trainer import TrainConfig

    model = kvjax.load_model(a.model)
    cfg = model.config
    tokens = data.sequences(model.tokenizer, data.default_sources(), a.seq_len, a.num_seqs)
    tc = TrainConfig(seq_len=a.seq_len, num_seqs=a.num_seqs, store_dtype=a.store_dtype)
    layers = L.parse_layers(a.layers, cfg.num_layers)
    rss_model = _status("VmRSS")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(a.dir or tmp) / "capture"
        t0 = time.perf_counter()
        store = C.capture(
            cfg,
            model.params,
            tokens,
            (tc.less, tc.baseline_plus),
            folder,
            layers=layers,
            batch=a.batch,
            store_dtype=a.store_dtype,
            shard_mb=a.shard_mb,
            model_name=model.name,
        )
        wall = time.perf_counter() - t0
        disk = sum(f.stat().st_size for f in folder.glob("*.npy"))
        x, _ = store.read(range(min(2, tokens.shape[0])))  # a training batch read back
    itemsize = np.dtype(a.store_dtype).itemsize
    res = {
        "model": model.name,
        "num_layers": len(layers),
        "hidden": cfg.hidden_size,
        "kv_heads": cfg.num_kv_heads,
        "num_seqs": int(tokens.shape[0]),
        "seq_len": a.seq_len,
        "store_dtype": a.store_dtype,
        "shard_mb": a.shard_mb,
        "capture_batch": a.batch,
        "shards": store.manifest["shards"],
        "seqs_per_shard": store.per_shard,
        "bytes_per_seq_measured": disk / tokens.shape[0],
        "bytes_per_seq_formula": C.seq_bytes(cfg, len(layers), a.seq_len, a.store_dtype),
        "rss_after_model_load": rss_model,
        "peak_rss": _status("VmHWM"),
        "capture_seconds": wall,
        "projections": {
            "smollm2_512x4096": project(
                cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, 4096, 512, itemsize, a.shard_mb, a.batch
            ),
            "llama2_7b_512x4096_bf16_all_layers": project(32, 4096, 32, 4096, 512, 2, a.shard_mb, 4),
            "llama2_7b_512x4096_bf16_8_layers": project(8, 4096, 32, 4096, 512, 2, a.shard_mb, 4),
        },
    }
    print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
