"""Several processes on one machine through ``jax.distributed`` against one process, the independent reference.

N processes (``tests/sharding/multiprocess_worker.py``, 2 CPU devices each, coordinator on 127.0.0.1, gloo CPU
collectives) share one mesh: ``data=2 x model=N`` for generation and eval (2 processes: 'data' crosses the
processes; 4: 'model' does too), ``data=2N`` for LESS training. Compared with this process (no mesh):
``scripts/multihost.py`` (unchanged) and ``generate`` greedy tokens for snapkv, pqcache (recall) and chelsea; a
``kvjax-eval needle`` cell (rows equal; only process 0 wrote its folder); two data-parallel LESS steps (losses equal;
one orbax checkpoint, written once, restored here by a single process and equal to this process's).

One launch per process count holds every check (a process costs seconds of jax import and compilation). Both
counts take minutes on 2 shared cores (measured: 217 s for 2 processes, 289 s for 4, 124 s for the reference, 638 s
the file; mostly compilation), so both are ``slow``; ``.ci/run`` runs this file with ``--runslow``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import kvjax

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("multiprocess_worker.py")
sys.path.insert(0, str(WORKER.parent))
import multiprocess_worker as W  # noqa: E402
from tiny_models import save_tiny_llama

DEVICES_PER_PROCESS = 2


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    """A tiny random Llama with the embedded SmolLM2 tokenizer (the needle task reads text)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-multiprocess"))


@pytest.fixture(scope="module")
def reference(tiny_path, tmp_path_factory):
    """Everything the workers compute, in this one process without a mesh."""
    from eval import cli as eval_cli
    from train_less.trainer import train

    model = kvjax.load_model(tiny_path)
    script_prompts = [model.tokenizer.encode(f"Count from {i} to {i + 5}:", add_special_tokens=True) for i in range(2)]
    snapkv = kvjax.generate(
        model, script_prompts, kvjax.methods.get("snapkv", budget=0.5), W.MAX_NEW, stop_at_eos=False
    ).tokens
    tokens = {
        name: kvjax.generate(
            model, W.prompts(model.config.vocab_size), kvjax.methods.get(name, **kw), W.MAX_NEW, stop_at_eos=False
        ).tokens
        for name, kw in W.METHODS.items()
    }
    out = tmp_path_factory.mktemp("one-process")
    assert eval_cli.main(W.eval_argv(tiny_path, out / "eval")) == 0
    cfg, params, seqs, tc = W.less_setup()
    less = train(cfg, params, seqs, tc, out / "less", "tiny", progress=False)
    return {
        "snapkv": snapkv,
        "tokens": tokens,
        "eval": json.loads((out / "eval" / "results.json").read_text()),
        "less": less,
        "less_dir": out / "less",
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(n: int, model_path, out: Path, timeout: float = 900) -> list[dict]:
    """Start ``n`` workers on localhost, wait for all; their result JSONs (a failure shows every log's tail)."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}",
    }
    coordinator = f"127.0.0.1:{_free_port()}"
    out.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    for i in range(n):
        logs.append(open(out / f"log-p{i}.txt", "w"))
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(WORKER),
                    "--coordinator",
                    coordinator,
                    "--num-processes",
                    str(n),
                    "--process-id",
                    str(i),
                    "--model",
                    str(model_path),
                    "--out",
                    str(out),
                ],
                env=env,
                stdout=logs[-1],
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        )
    deadline = time.monotonic() + timeout
    try:
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in logs:
            f.close()
    if any(codes):
        tails = "\n".join(
            f"--- process {i} (exit {c}):\n" + (out / f"log-p{i}.txt").read_text()[-3000:] for i, c in enumerate(codes)
        )
        pytest.fail(f"a worker failed:\n{tails}")
    return [json.loads((out / f"result-p{i}.json").read_text()) for i in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_processes_equal_one_process(tiny_path, reference, tmp_path, n):
    t0 = time.perf_counter()
    results = launch(n, tiny_path, tmp_path)
    wall = time.perf_counter() - t0
    print(
        f"\n{n} processes: {wall:.0f}s wall; process 0 phases (s): "
        + ", ".join(f"{k} {v:.0f}" for k, v in results[0]["seconds"].items())
    )
    for i, r in enumerate(results):
        assert (r["process"], r["processes"], r["local_devices"]) == (i, n, DEVICES_PER_PROCESS)
        assert r["devices"] == n * DEVICES_PER_PROCESS and r["script_code"] == 0 and r["eval_code"] == 0
        assert r["tokens"] == reference["tokens"], f"process {i}"
    # scripts/multihost.py: process 0 prints the mesh and the tokens, the others print nothing
    lines = results[0]["script_stdout"].splitlines()
    assert (
        lines[0] == f"process 0 of {n}: mesh data=2 x model={n}: {8 // n} query heads and {4 // n} KV heads "
        "per device, batch / 2"
    )
    assert [eval(line) for line in lines[1:]] == reference["snapkv"]
    assert all(r["script_stdout"] == "" for r in results[1:])
    # kvjax-eval: only process 0 wrote; its rows are the single process's
    assert results[0]["eval_wrote"] == ["needle.png", "results.json", "results.md", "scores.png"]
    assert all(not (tmp_path / f"eval-p{i}").exists() for i in range(1, n))
    rows = json.loads((tmp_path / "eval-p0" / "results.json").read_text())["rows"]
    one = reference["eval"]["rows"]
    assert len(rows) == len(one) == 2
    for a, b in zip(one, rows):
        for key in ("task", "method", "budget", "answer", "score", "tokens_held", "cache_bytes"):
            assert a[key] == b[key], key
    # LESS: the same losses in every process and as one process; one checkpoint, restorable here
    ref = reference["less"]["history"]
    for r in results:
        for key in ("train_loss", "val_loss", "val_loss_sparse", "val_loss_baseline_plus"):
            np.testing.assert_allclose([h[key] for h in r["less_history"]], [h[key] for h in ref], rtol=1e-4)
    less = tmp_path / "less"
    assert sorted(p.name for p in less.iterdir()) == ["checkpoints", "kernels.npz", "less_config.json"]
    assert [p.name for p in (less / "checkpoints").iterdir()] == ["2"]  # steps_per_epoch = 2
    mine = _restore(reference["less_dir"] / "checkpoints")
    theirs = _restore(less / "checkpoints", like=mine)
    assert jax.tree.structure(mine) == jax.tree.structure(theirs) and jax.tree.leaves(mine)
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs)):
        assert b.sharding.is_fully_addressable  # a single process holds it
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)
    with np.load(reference["less_dir"] / "kernels.npz") as a, np.load(less / "kernels.npz") as b:
        for name in a.files:
            np.testing.assert_allclose(b[name], a[name], rtol=1e-4, atol=1e-6, err_msg=name)


def _restore(ckpt_dir: Path, like=None):
    """The newest checkpoint's ``state``, restored by this process onto its first device (shaped as ``like``;
    without it, as saved: a single-process checkpoint)."""
    import orbax.checkpoint as ocp

    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = (
        None if like is None else jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), like)
    )
    with ocp.CheckpointManager(ckpt_dir) as mngr:
        step = mngr.latest_step()
        return mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
