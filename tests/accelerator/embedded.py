"""Every registered method on the embedded SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to float32): the greedy
tokens and top logits of a CPU run, kept in ``smollm2_cpu.json`` beside this file, that the device run of the same
method must reproduce (``test_embedded.py``).

    python3 tests/accelerator/embedded.py --write   # regenerate smollm2_cpu.json on CPU (about 2 min on 2 cores)

The run: two sequences cut from the shipped Paul Graham essays (:func:`prompts`: 401 and 287 tokens, one bucket
of 512), float32 weights and activations, every method at budget 0.3 with its default options (each one holds
under half the prompt or reads less per decode step than ``full``: checked), stacked layers (``scan_layers=True``;
PyramidKV's layers differ in shape, so each is a scan of its own: 2.5e-5 from the unrolled run the file was written
with), prefill and ``STEPS`` greedy decode steps with the given tokens fed (teacher forcing: a device run is fed the
CPU tokens, so a near-tie at one step cannot change every later step). Per step and sequence the file holds the
greedy token, the top-``TOP`` token ids and logits, and the margin between the first and second logits.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvjax.loading import assets  # noqa: E402
from kvjax.engine import core
from kvjax import engine, methods
from kvjax.loading import load_model  # noqa: E402
from kvjax.methods.base import Capacity  # noqa: E402

GOLDEN = Path(__file__).with_name("smollm2_cpu.json")
LENGTHS, BUCKET, STEPS, TOP, BUDGET = (401, 287), 512, 12, 5, 0.3
# The rounding spread (:func:`spread`): weights scaled by 1 + u * PERTURB, u uniform in [-1, 1], in DRAWS runs.
# 2^-20 is 8 float32 ulps relative: the size of the difference summation order makes in a float32 dot product of
# the model's widths (576-1536 terms), which is how a device's arithmetic differs from the CPU's.
PERTURB, DRAWS = 2.0**-20, 3


@functools.lru_cache(maxsize=1)
def model():
    """The embedded model, float32, stacked layers, with its tokenizer."""
    return load_model(assets.SMOLLM2_NAME, dtype=jnp.float32, scan_layers=True)


def prompts(tokenizer) -> list[list[int]]:
    """Two prompts of ``LENGTHS`` tokens from the essays (the second starts 2000 characters in)."""
    text = assets.essays_text()
    out = []
    for n, start in zip(LENGTHS, (0, 2000)):
        ids = tokenizer.encode(text[start : start + 8 * n])
        if len(ids) < n:
            raise RuntimeError(f"the essays gave {len(ids)} tokens, fewer than {n}")
        out.append(list(ids[:n]))
    return out


def perturbed(params, eps: float, seed: int):
    """``params`` with every floating leaf scaled by ``1 + eps * u``, ``u`` uniform in [-1, 1] (one draw per seed)."""
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    out = [
        x * (1 + eps * jax.random.uniform(k, x.shape, x.dtype, -1, 1)) if jnp.issubdtype(x.dtype, jnp.floating) else x
        for x, k in zip(leaves, keys)
    ]
    return jax.tree_util.tree_unflatten(tree, out)


def deviation(got: dict, want: dict) -> float:
    """The largest absolute difference between ``got``'s logits at ``want``'s top-``TOP`` ids and ``want``'s."""
    at = np.take_along_axis(got["logits"], np.asarray(want["top_ids"]), -1)
    return float(np.abs(at - np.asarray(want["top_logits"])).max())


def spread(name: str, want: dict) -> float:
    """How far float rounding alone moves method ``name``'s run: the largest :func:`deviation` from ``want`` (this
    CPU run) over ``DRAWS`` runs with the weights perturbed by ``PERTURB`` (relative), fed ``want``'s tokens.

    A method whose selection has near-ties (Chelsea's merge edges, a top-k cut) can change what it keeps under such
    a perturbation, and its logits then move by more than the arithmetic's own error: Chelsea's by 0.04-0.07 for
    perturbations of 1e-7-1e-6 of the keys it compares. A device cannot be held closer to the CPU than this."""
    return max(
        deviation(run(name, feed=want["tokens"][:STEPS], perturb=(PERTURB, seed)), want) for seed in range(DRAWS)
    )


def run(name: str, feed=None, perturb=None) -> dict:
    """Prefill and ``STEPS`` decode steps of method ``name`` on the embedded model (module docstring).

    feed: ``[STEPS, B]`` tokens to decode (default: this run's greedy tokens). Returns a dict of lists:
    ``tokens [STEPS+1, B]``, ``top_ids``/``top_logits [STEPS+1, B, TOP]``, ``margin [STEPS+1, B]``, and
    ``held [B]`` (tokens held per sequence after prefill, mean over layers: :func:`engine.tokens_held`) and
    ``bytes_read`` (what the first decode step reads by the method's plan: :func:`engine.bytes_read_per_step`);
    also ``logits [STEPS+1, B, V]`` float64 (not written to the file). perturb: ``(eps, seed)`` runs with
    :func:`perturbed` weights."""
    m_ = model()
    cfg, params = m_.config, m_.params
    if perturb is not None:
        params = perturbed(params, *perturb)
    meth = methods.at_budget(name, BUDGET)
    tokens, lengths = engine.pad_prompts(prompts(m_.tokenizer), BUCKET)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    states = engine.init_states(
        cfg,
        meth,
        len(LENGTHS),
        Capacity(BUCKET, STEPS + 1),
        jnp.float32,
        scan_layers=meth.traced_layer,
    )
    prefill = jax.jit(functools.partial(core.prefill, cfg, meth))
    step = jax.jit(functools.partial(core.decode_step, cfg, meth))
    states, logits = prefill(params, tokens, lengths, states)
    held = np.asarray(engine.tokens_held(meth, states))
    read = engine.bytes_read_per_step(meth, states, cfg.num_heads)
    outs, pos = [logits], lengths
    for i in range(STEPS):
        tok = jnp.argmax(logits, -1).astype(jnp.int32) if feed is None else jnp.asarray(feed[i], jnp.int32)
        logits, states = step(params, states, tok, pos)
        outs.append(logits)
        pos = pos + 1
    x = np.stack([np.asarray(o, np.float64) for o in outs])  # [STEPS+1, B, V]
    order = np.argsort(-x, axis=-1)[..., :TOP]
    top = np.take_along_axis(x, order, -1)
    return {
        "tokens": order[..., 0].tolist(),
        "top_ids": order.tolist(),
        "top_logits": top.round(5).tolist(),
        "margin": (top[..., 0] - top[..., 1]).round(5).tolist(),
        "held": np.round(held.astype(np.float64), 3).tolist(),
        "bytes_read": read,
        "logits": x,
    }


def write(path: Path = GOLDEN, names=None, spread_only: bool = False) -> dict:
    """Run ``names`` (default: every method) on CPU and write their entries, each with its :func:`spread`, to
    ``path``; ``spread_only``: keep the written runs and recompute only their spreads."""
    kept = {}
    if (names or spread_only) and path.exists():  # a subset: the other methods' entries stay as they are
        kept = json.loads(path.read_text())["methods"]
    names = names or methods.names()
    out = {
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "lengths": LENGTHS,
        "bucket": BUCKET,
        "steps": STEPS,
        "budget": BUDGET,
        "methods": kept,
    }
    for name in names:
        if spread_only:
            r = out["methods"][name] = kept[name]
        else:
            r = out["methods"][name] = {k: v for k, v in run(name).items() if k != "logits"}
        r["rounding_spread"] = round(spread(name, r), 5)
        print(
            f"{name:14s} held {r['held']}  read {r['bytes_read'] / 2**20:.1f} MiB  tokens {r['tokens'][:4]}...  "
            f"rounding spread {r['rounding_spread']:.4f}",
            flush=True,
        )
    path.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help=f"regenerate {GOLDEN.name} (run on CPU)")
    p.add_argument("--methods", default=None, help="comma-separated subset")
    p.add_argument("--spread-only", action="store_true", help="with --write: keep the runs, recompute the spreads")
    a = p.parse_args()
    jax.config.update("jax_default_matmul_precision", "highest")
    if jax.default_backend() != "cpu" and a.write:
        sys.exit("write the golden file on CPU: JAX_PLATFORMS=cpu python3 tests/accelerator/embedded.py --write")
    names = a.methods.split(",") if a.methods else None
    if a.write:
        write(names=names, spread_only=a.spread_only)
    else:
        for n in names or methods.names():
            print(n, run(n)["tokens"])
