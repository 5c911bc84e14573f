"""One process of a multi-process run on localhost (``tests/sharding/test_multiprocess.py`` starts N of them).

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu PYTHONPATH=. \\
        python3 tests/sharding/multiprocess_worker.py --coordinator 127.0.0.1:PORT --num-processes 2 \\
        --process-id I --model TINY_HF_FOLDER --out OUT_DIR          # once per I in 0..N-1, all at once

Every process runs the same program over one ``data x model`` mesh spanning all processes' devices (gloo CPU
collectives), each step a collective program every process must reach:

1. ``scripts/multihost.py`` (unchanged: it calls ``jax.distributed.initialize``) with snapkv; its stdout kept;
2. ``kvjax.generate`` greedy with the other :data:`METHODS` (a recall method and Chelsea);
3. one ``kvjax-eval needle`` cell, each process given its own ``--out`` (only process 0 may write there);
4. LESS training (:data:`LESS_CFG`, :data:`LESS_TC`: two data-parallel steps, one epoch) into the shared
   ``OUT_DIR/less`` (one orbax checkpoint, ``kernels.npz`` written by process 0).

Writes ``OUT_DIR/result-pI.json`` (tokens, eval rows, losses, seconds per phase); the test compares them with one
process.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from kvjax import methods  # noqa: E402

#: ``kvjax.methods.get`` arguments of the methods ``generate`` runs: one that recalls and one that re-compresses
#: its cache (``methods.cover``; snapkv runs through scripts/multihost.py).
METHODS = {name: {"budget": 0.5} for name in methods.cover("recalls", "recompresses", any_true=True)}
MAX_NEW = 6
#: The LESS training of step 4: a tiny random model; 20 sequences, 4 for validation, batch 8 -> 2 steps.
LESS_MODEL = dict(
    model_type="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)
LESS_TRAIN = dict(budget=6, rank=4, hidden=16, epochs=1, batch=8, seq_len=32, num_seqs=20, val_frac=0.2, lr=1e-2)


def prompts(vocab: int) -> list[list[int]]:
    """The token-id prompts of step 2 (two sequences, one per 'data' row; different lengths)."""
    return [[1 + (7 * i + 3) % (vocab - 1) for i in range(40)], [1 + (5 * i + 11) % (vocab - 1) for i in range(29)]]


def less_setup():
    """``(cfg, params, tokens, TrainConfig)`` of the LESS training (the same in every process and the test)."""
    import jax
    import numpy as np

    import kvjax
    from train_less.trainer import TrainConfig

    cfg = kvjax.ModelConfig(**LESS_MODEL)
    params = kvjax.model.random_params(cfg, jax.random.PRNGKey(0), scale=0.3)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (LESS_TRAIN["num_seqs"], LESS_TRAIN["seq_len"]))
    return cfg, params, tokens, TrainConfig(**LESS_TRAIN)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mesh", default="data=2,model=-1")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    out = Path(args.out)
    times = {}

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py, where the reference runs

    sys.path.append(str(ROOT / "tests"))  # tests/repo_scripts.py
    from repo_scripts import load_script

    script = load_script("scripts/multihost.py", "multihost")
    t = time.perf_counter()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = script.main(
            [
                "--coordinator",
                args.coordinator,
                "--num-processes",
                str(args.num_processes),
                "--process-id",
                str(args.process_id),
                "--mesh",
                args.mesh,
                "--model",
                args.model,
                "--method",
                "snapkv",
                "--budget",
                "0.5",
                "--max-new-tokens",
                str(MAX_NEW),
            ]
        )
    times["multihost_script"] = time.perf_counter() - t
    assert jax.process_count() == args.num_processes and jax.process_index() == args.process_id

    import kvjax
    from eval import cli as eval_cli
    from train_less.trainer import train

    t = time.perf_counter()
    model = kvjax.load_model(args.model, mesh=args.mesh)
    tokens = {}
    for name, kw in METHODS.items():
        res = kvjax.generate(
            model, prompts(model.config.vocab_size), kvjax.methods.get(name, **kw), MAX_NEW, stop_at_eos=False
        )
        tokens[name] = res.tokens
    times["generate"] = time.perf_counter() - t

    t = time.perf_counter()
    eval_out = out / f"eval-p{args.process_id}"
    with contextlib.redirect_stdout(io.StringIO()):
        eval_code = eval_cli.main(eval_argv(args.model, eval_out) + ["--mesh", args.mesh])
    times["eval"] = time.perf_counter() - t

    t = time.perf_counter()
    cfg, params, seqs, tc = less_setup()
    ndev = jax.device_count()
    meta = train(cfg, params, seqs, tc, out / "less", "tiny", progress=False, mesh=f"data={ndev}")
    times["train"] = time.perf_counter() - t

    result = {
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "devices": ndev,
        "local_devices": jax.local_device_count(),
        "script_code": code,
        "script_stdout": printed.getvalue(),
        "tokens": tokens,
        "eval_code": eval_code,
        "eval_wrote": sorted(p.name for p in eval_out.glob("*")),
        "less_history": meta.get("history"),
        "seconds": times,
    }
    (out / f"result-p{args.process_id}.json").write_text(json.dumps(result, indent=1))
    return 0


def eval_argv(model: str, out) -> list[str]:
    """The ``kvjax-eval`` cell: one needle batch of two prompts, snapkv at half the prompt."""
    return [
        "needle",
        "--model",
        str(model),
        "--methods",
        "snapkv",
        "--budgets",
        "0.5",
        "--lengths",
        "160",
        "--depths",
        "0,1",
        "--batch",
        "2",
        "--max-new-tokens",
        "4",
        "--no-progress",
        "--out",
        str(out),
    ]


if __name__ == "__main__":
    sys.exit(main())
