"""What the scripts in ``benchmarks/`` share: the run's metadata in their JSON (jax version and device, the commit
and whether the tree differs from it, the command line, the load average), the comma-separated option values
(contexts as ``8k,16k``, integers, budgets), a table's ``-`` for a missing value, writing a result, and timing the
engine's decode loop.

Imported by name (each script puts ``benchmarks/`` on ``sys.path``, as running it does). Only the standard library
at import time: the torch-side workers (``prefill_vs_torch.py``, ``kvpress_decoding.py``) import it in a Python
without jax or kvjax."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

#: The repository root (the git commands run there; paths given to them are relative to it).
ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ the run's metadata


def git(*args: str, root: Path = ROOT) -> str | None:
    """``git <args>`` run in ``root``: its output, stripped; None where git is missing or fails."""
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=root, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def commit() -> str | None:
    """The checkout's commit: ``$KVJAX_COMMIT`` if set (a copied tree whose .git is not this one's, e.g. on
    a GPU machine), else ``git rev-parse HEAD``; None without git."""
    return os.environ.get("KVJAX_COMMIT") or git("rev-parse", "HEAD")


def git_dirty(*paths: str) -> bool | None:
    """Whether ``paths`` (relative to the repository root) differ from the commit (uncommitted changes, untracked
    files); None without git."""
    out = git("status", "--porcelain", "--", *paths)
    return None if out is None else bool(out)


def device_fields(jaxlib: bool = False) -> dict:
    """The JSON fields of the device a run used: ``jax_version`` (with ``jaxlib``: and ``jaxlib_version``, None where
    jaxlib does not say), ``device``, ``device_kind`` (the first device's) and ``backend``."""
    import jax

    dev = jax.devices()[0]
    out = {"jax_version": jax.__version__}
    if jaxlib:
        try:
            import jaxlib as _jaxlib

            out["jaxlib_version"] = _jaxlib.__version__
        except (ImportError, AttributeError):
            out["jaxlib_version"] = None
    return {**out, "device": str(dev), "device_kind": dev.device_kind, "backend": jax.default_backend()}


def command_line() -> str:
    """The command that ran, quoted so that it can be pasted: the Python, the script and its options."""
    return shlex.join([sys.executable] + sys.argv)


def load_average() -> float | None:
    """The host's 1-minute load average (other work on it skews CPU timings); None where the OS has none."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def write_json(path, data, indent: int = 1, default=None) -> None:
    """``data`` as JSON at ``path``, its folder made first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, default=default))


def write_measured(path, data: dict, markdown, t0: float) -> None:
    """An analysis script's result: ``data`` with the commit, command line, device and the seconds since ``t0``
    (``time.perf_counter()``) as JSON at ``path``, and ``markdown(that dict)`` beside it (``.md``) and printed."""
    data = {**data, "commit": commit(), "command": command_line(), **device_fields()}
    data["seconds"] = round(time.perf_counter() - t0, 1)
    write_json(path, data)
    text = markdown(data)
    Path(path).with_suffix(".md").write_text(text)
    print(text)


def add_window_args(p, sequences: int, continuation: int | None = 64) -> None:
    """The options of an analysis script over the perplexity task's text windows (``eval.perplexity.build``):
    ``--model``, ``--sequences``, ``--prefix``, ``--continuation`` (left out when None), ``--book`` and ``--out``."""
    p.add_argument("--model", default="gemma3-270m", help="an embedded model, HF folder or hub id")
    p.add_argument("--sequences", type=int, default=sequences, help="windows of the text")
    p.add_argument("--prefix", type=int, default=4096, help="prefilled (compressed) tokens per window")
    if continuation is not None:
        p.add_argument("--continuation", type=int, default=continuation, help="teacher-forced tokens after the prefix")
    p.add_argument("--book", default="essays", help="King James book or 'essays' (eval.perplexity.build)")
    p.add_argument("--out", required=True, help="JSON to write (and .md beside it)")


def window_fields(args) -> dict:
    """The window settings of ``args`` (:func:`add_window_args`) for a result's JSON."""
    return {k: getattr(args, k) for k in ("model", "book", "sequences", "prefix", "continuation") if hasattr(args, k)}


def mean_stats(stats: list[dict], digits: int = 3) -> dict:
    """The mean of each statistic over a list of per-(head, window) dicts with the same keys, rounded."""
    return {key: round(sum(float(s[key]) for s in stats) / len(stats), digits) for key in stats[0]}


def softmax(x):
    """Softmax over the last axis of a numpy array, max-subtracted (the analysis scripts' exact attention)."""
    import numpy as np

    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


CHELSEA_DEFAULTS = "the defaults (chunk 256, schedule llama3, 16 sinks, 64 recent, no outlier heads)"


# ------------------------------------------------------------------------------------------ option values, tables


def parse_contexts(text: str, option: str = "--contexts", example: str = "8k,16k or 8192") -> list[int]:
    """``"8k,16k,1000"`` -> ``[8192, 16384, 1000]``; an argparse error naming ``option`` for anything else."""
    out = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        try:
            out.append(int(part[:-1]) * 1024 if part.endswith("k") else int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{option} {part!r} is not a token count; use e.g. {example}")
    return out


def context_label(n: int) -> str:
    """``8192`` -> ``"8k"``; a count that is not a whole number of k as it is."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def parse_ints(text: str) -> list[int]:
    """``"1,4"`` -> ``[1, 4]``."""
    return [int(x) for x in text.split(",") if x.strip()]


def parse_budget(text: str):
    """One budget (``kvjax.budget.parse_budget``: a fraction or a token count), an argparse error if it is not."""
    from kvjax.budget import parse_budget as parse

    try:
        return parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_budgets(text: str) -> list:
    """``"0.1,2048"`` -> ``[0.1, 2048]`` (``''``: none)."""
    return [parse_budget(x) for x in text.split(",") if x.strip()]


def fmt(x, spec: str, suffix: str = "") -> str:
    """``x`` formatted by ``spec`` (and ``suffix``), or ``-`` for None: a table cell."""
    return "-" if x is None else format(x, spec) + suffix


# ------------------------------------------------------------------------------------------ timing


def time_decode_loop(model, method, tokens, lengths, cap, steps: int):
    """Seconds per step of ``steps`` greedy decode steps of ``method`` after the prompts ``tokens`` (``[batch,
    bucket]``, ``lengths``): the engine's prefill, then its ``scan`` decode loop, run twice (the first compiles) and
    the second timed. Returns ``(seconds per step, the states after the timed run)``."""
    import jax
    import jax.numpy as jnp

    from kvjax import engine
    from kvjax.engine.sampling import Greedy

    cfg = model.config
    loop = engine.DecodeLoop(cfg, method, Greedy(), steps + 1, ())
    times = []
    for _ in range(2):  # the first run compiles
        states = engine.init_states(cfg, method, tokens.shape[0], cap, model.dtype)
        states, logits = engine.prefill(cfg, method, model.params, tokens, lengths, states)
        first = jnp.argmax(logits, -1).astype(jnp.int32)
        jax.block_until_ready(states)
        t0 = time.perf_counter()
        out, _, states = engine.run_loop(loop, "scan", model.params, states, first, lengths, jax.random.PRNGKey(0))
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    return times[-1] / steps, states
