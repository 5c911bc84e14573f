"""Roofline of the decode step where the KV cache dominates: step time against bytes read, every method vs full.

    python benchmarks/roofline.py --quick                       # a few minutes: 16k, batch 1, float32
    python benchmarks/roofline.py --lengths 32k --methods full,snapkv,pqcache --budgets 0.2 --token-budgets 2048
    python benchmarks/roofline.py                               # the whole grid (below): many hours on 2 CPU cores
    python benchmarks/roofline.py --report benchmarks/results/roofline_cpu.json   # redraw table, plot, projection
    python benchmarks/roofline.py --report a.json,b.json --out merged.json        # runs made in pieces, as one
    python benchmarks/roofline.py --shape gemma3 --layers 6 --first-layer 0 --lengths 32k   # Gemma-3-shaped, hybrid
    python benchmarks/roofline.py --shape gemma3-global --layers 6 --first-layer 0 --lengths 32k  # every layer global

**Setting: attention + cache only.** Llama-3.1-8B's attention shapes (32 query / 8 KV heads x 128), no weights,
no MLP, no projections. Each of ``--layers`` layers (numbered from ``--first-layer``, default 2: past ClusterKV's
and Quest's full layers, in a 32-layer model, so PyramidKV's and ChunkKV's per-layer rules see a real depth) gets a
random prompt ``q [B, 32, n, 128]``, ``k, v [B, 8, n, 128]`` that goes through the method's own ``prefill``; then
every decode step calls each layer's ``method.decode`` (the public interface, nothing method-specific here) with
fixed random ``q, k, v`` in one compiled, state-donating step. With no weights a step reads only what the method
reads, so the ratios are the methods' own, not diluted by an 8B model's 16 GB of weights (the projection adds
those back).

The grid (defaults): prompts 8k, 16k, 32k, 64k, 128k tokens x batch 1, 4 x float32, bfloat16; ``full`` and every
registered method at budgets 0.1 and 0.2, and the recall methods (``Method.recalls``: pqcache, clusterkv, quest)
also at 1024 and 2048 tokens: 27 variants per (context, batch, dtype). ``--quick`` is 16k, batch 1, float32,
budget 0.2 and 2048 tokens, 3 rounds of 4 steps (14 variants). ``--tiny`` swaps in a 4-head, 32-dim config (the
smoke test's).

How long (measured on this 2-core CPU, batch 1, float32, 1 layer): ``--quick`` 130 s; 32k with 14 variants
(budget 0.2 + 2048 tokens, 5 rounds of 8 steps) 342 s, of which 224 s are the three quadratic prefills (the causal
attention 76 s, h2o's 76 s, LESS's 72 s) and ~8 s per variant the rest (compiles, linear prefills, timed rounds).
The quadratic parts grow 4x per doubling of the context and with the batch, the rest ~2x; the default grid's 27
variants run h2o and LESS twice each. Estimated from those: float32, batch 1 ~1 h (8k 2 min, 16k 4 min, 32k 10
min, 64k 30 min, 128k 12 min with the quadratic prefills skipped), batch 4 ~1.2 h (64k without the quadratic
prefills, 128k skipped: it does not fit); bfloat16 (XLA:CPU upcasts its dots) is slower: see the 8k run. Run it in
pieces (``--lengths 8k,16k``, ...) and merge them with ``--report a.json,b.json``.

Timing: the states of a group of variants are built first; then ``--rounds`` rounds each run ``--steps`` steps of
every variant in a rotated order (compile and the first round excluded) and the step time is the median over rounds,
so a change in machine load hits every variant alike. By default (``--timing loop``) a variant's ``--steps`` steps
are one compiled program (a ``fori_loop``, as the engine's decode loop runs them), so the fixed cost of a call
(dispatch and argument handling: a large share of a compressed step on a GPU) is paid once per round; ``--timing
calls`` calls the step once per step, as runs before 2026-11-26 did (on this CPU at 16k the loop is 0.3 ms a step
faster for every variant alike: full 10.6 vs 11.7 ms, quest@0.2 4.0 vs 4.4 ms). ``full`` runs in every group, so
every ratio compares rows of the same run (one group unless memory forces more, see below). Per row (JSON keys in
brackets):

- step time [``step_s``], and the method's own bytes read per step [``bytes_read``]: the sum over layers of
  ``method.bytes_read_per_step`` (the K/V blocks, codes, centroids, scores... each method counts);
- with ``--timing calls``, XLA's ``cost_analysis()["bytes accessed"]`` of the compiled step [``xla_bytes``] beside
  it (XLA:CPU counts a dynamic-update-slice's whole operand, so it over-counts in-place writes; with ``--timing
  loop`` it is null: the cost analysis counts a loop's body once);
- achieved GB/s [``gbs``] = bytes / step time; the header has the machine's measured read bandwidth (a sum over
  512 MiB) and copy bandwidth (an in-place ``x + 1``: read + write) [``read_gbs``, ``copy_gbs``];
- **efficiency** [``efficiency``] = (step time / full's step time) / (bytes read / full's bytes read)
  [``time_ratio`` / ``bytes_ratio``]: 1.0 means the step costs exactly what it reads, 2.0 twice that; speed-up
  [``speedup``] = full's time / the method's; ``full_row`` is the index of the full row it is compared with;
- prefill, **attention-only**: [``attention_s``] the causal prefill attention (``kvjax.model.causal_attention``, the
  engine's, on the same prompt) summed over the layers, measured once per (context, batch, dtype);
  [``prefill_s``] the method's own ``prefill`` (its compression: scoring, clustering, quantising, and writing its
  cache; for ``full`` only the cache write) summed over the layers; time to first token [``ttft_s``] =
  ``attention_s + prefill_s`` (a method that declares ``attends_prompt``, H2O and LESS: its ``prefill_attend``
  computes the attention with its scores, as in the engine, so ``ttft_s = prefill_s``); [``ttft_ratio``] = TTFT /
  full's TTFT; compression's share [``compress_share``] = (TTFT - full's TTFT) / TTFT. Each is one run, compile
  excluded (ahead-of-time compiled). A real model's TTFT adds
  the projections and MLPs, which every method pays alike, so these ratios are upper bounds of the model's;
- with ``--model-ttft``, the model's: [``dense_s``] one layer's position-wise prefill work at the same prompt (the
  engine's ``layer_qkv_blocks`` and ``layer_finish_blocks``: norms, q/k/v/o projections, RoPE and the MLP in
  512-token blocks, on random weights of the 8B layer's shapes; the attention left out), measured once per
  (context, batch, dtype), and [``model_ttft_ratio``] = ``(layers x dense_s + TTFT) / (layers x dense_s + full's
  TTFT)``: the TTFT ratio of a model whose every layer is the benchmarked one (embedding and LM head left out).

**Hybrid models** (``--shape gemma3``): Gemma-3-12B's attention shapes (16 query / 8 KV heads x 256, 48 layers) with
its layer pattern, five local layers of a 1024-token window to one global; with ``--layers 6 --first-layer 0`` the
benchmarked layers are one period of it. Every variant runs as ``kvjax.methods.hybrid.for_model`` plans it on that
model (a ring buffer of the window on each local layer, the method on the global one; ``full`` keeps everything on
the global layer only), so bytes read and step time count both kinds of layer, and the causal prefill attention of a
local layer is windowed; each row's ``layer_plan`` says what its layers held. ``--shape gemma3-global`` is the same
model with every layer global (what a cache without the hybrid plan holds), the comparison.

Limits (nothing is dropped silently: a skipped row has ``status: "skipped"`` and the reason in ``skipped``):

- **memory**: before anything is allocated, each variant's states (``jax.eval_shape`` of its ``init``, per layer)
  and its compiled prefill's temporaries (``memory_analysis``) are added to the prompt's q, k, v and to full's
  states; variants are packed into groups (each with its own ``full``) that fit ``--memory-gb`` (default 60% of the
  host's RAM on CPU, the host being shared; 90% of an accelerator's ``bytes_limit``), and a variant that does not
  fit even alone with full is skipped. float32 at 128k tokens, batch 4 (prompt 12 GiB, full's cache 4 GiB per layer)
  does not fit a 24 GB host.
- **prefill time**: the prefill of h2o and LESS (accumulated attention scores over every query) and the causal
  attention are quadratic in the prompt (~80 s per layer at 32k on this CPU, x4 per doubling). Before a prefill
  runs, its seconds are estimated from the largest one of the same method and dtype measured so far in this
  process, scaled as ``(n / n_ref)^2 * (batch / batch_ref) * layers`` (quadratic: an upper bound for the linear
  ones); a method with none measured yet is first timed once at ``--calibration-len`` (4096) tokens, batch 1. A
  variant whose estimate exceeds ``--max-prefill-s`` (default 600 s) is skipped; for the causal attention only the
  TTFT columns are (``ttft_skipped``), the decode step is still measured. At the defaults h2o and LESS stop after
  64k at batch 1 and after 32k at batch 4. ``--max-prefill-s inf`` sets no cap and skips the calibrations (each
  compiles a prefill: on a GPU, most of a short run).
- **failures**: a variant that raises while compiling, prefilling or decoding (a kernel this backend cannot lower,
  say) gets a ``status: "failed"`` row with its ``error``, and the others go on; if ``full`` fails, its
  configuration's variants are recorded failed with it (they have no reference).
- **resuming** (``--resume``): a run cut short (a device lease's limit) is run again with the same command; rows of
  ``--out`` made at the same commit with the same settings are kept and their variants not measured again (``full``
  is timed again beside each new group, so every ratio is of one group). Another commit: everything again.

Output: the JSON (``--out``; jax version, device, commit, command, load average, written after every
group of variants), a printed table, and beside the JSON a ``.txt`` of it, a ``.png`` plot (speed-up vs context per
variant, solid, with its bytes-ratio ideal ``full's bytes / its bytes`` dashed in the same colour; one panel per
batch and dtype) and the projection: an 8B model's TPOT on an H100 and a TPU v5e as (weights + bytes read) /
bandwidth, with this run's efficiency applied to each method's KV bytes (:func:`projection` states what it assumes),
beside the papers' figures (``e2e.PAPERS``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import TINY  # noqa: E402
from e2e import LLAMA31_8B, PAPERS, context_label, parse_contexts, variants  # noqa: E402
from kvjax.methods.hybrid import describe as describe_plan, for_model  # noqa: E402
from scan_layers import commit  # noqa: E402

from kvjax import methods  # noqa: E402
from kvjax import model as M  # noqa: E402
from kvjax.methods.base import Capacity, tree_bytes  # noqa: E402

#: The projection's model: Llama-3.1-8B, bfloat16 weights (embedding + 32 layers + head), 32 layers.
WEIGHTS_8B_BF16 = 16.06e9
MODEL_LAYERS = 32
#: Published memory bandwidth, bytes/s.
PROJECTION_DEVICES = {"H100": 3.35e12, "TPU v5e": 819e9}
#: ``--tiny``: a 4-layer model with 4 query / 2 KV heads x 32 (so ``--first-layer 2`` exists).
TINY_ATTENTION = dataclasses.replace(TINY, num_layers=4, sliding_windows=())
#: ``--quick``: the settings it overrides.
QUICK = {
    "lengths": "16k",
    "batch": "1",
    "dtypes": "float32",
    "budgets": "0.2",
    "token_budgets": "2048",
    "steps": 4,
    "rounds": 3,
}


#: ``--shape gemma3``: Gemma-3-12B's attention shapes and layer pattern (five local layers of a 1024-token window to
#: one global); ``gemma3-global``: the same with every layer global.
GEMMA3_12B_GLOBAL = dataclasses.replace(
    LLAMA31_8B,
    model_type="gemma3_text",
    num_heads=16,
    num_kv_heads=8,
    head_dim=256,
    num_layers=48,
    hidden_size=3840,
    intermediate_size=15360,
    vocab_size=262208,
    sliding_windows=(None,) * 48,
)
GEMMA3_12B = dataclasses.replace(
    GEMMA3_12B_GLOBAL, sliding_windows=tuple(1024 if (i + 1) % 6 else None for i in range(48))
)
SHAPES = {"llama-3.1-8b": LLAMA31_8B, "gemma3": GEMMA3_12B, "gemma3-global": GEMMA3_12B_GLOBAL}


def attention_config(tiny: bool = False, shape: str = "llama-3.1-8b"):
    """The model config the methods see: the 8B's (or ``shape``'s) heads, head dim, depth, context and layer windows
    (nothing else is used)."""
    return TINY_ATTENTION if tiny else SHAPES[shape]


@dataclasses.dataclass
class Variant:
    """One method at one budget, and what is known about it before it runs."""

    label: str
    method: object
    budget: object
    state_bytes: int = 0
    prefill_temp: int = 0
    prefills: dict = dataclasses.field(default_factory=dict)  # layer -> compiled prefill
    skipped: str | None = None
    failed: str | None = None  # the error that stopped it (compile, prefill or decode): recorded, the run goes on


@dataclasses.dataclass
class Run:
    """One variant's states over the benchmarked layers and its compiled decode step."""

    label: str
    method: object
    budget: object
    states: list
    step: object = None
    prefill_s: float = 0.0
    xla_bytes: float | None = None
    steps: int = 1  # decode steps per call of ``step``


def _prompt(key, batch, n, cfg, dtype):
    kq, kk, kv = jax.random.split(key, 3)
    shape = lambda h: (batch, h, n, cfg.head_dim)  # noqa: E731
    return (
        jax.random.normal(kq, shape(cfg.num_heads), dtype),
        jax.random.normal(kk, shape(cfg.num_kv_heads), dtype),
        jax.random.normal(kv, shape(cfg.num_kv_heads), dtype),
    )


_prompt_jit = jax.jit(_prompt, static_argnums=(1, 2, 3, 4))


def prompt_bytes(cfg, batch, n, dtype) -> int:
    """Bytes of one layer's prompt ``q, k, v``."""
    return batch * n * cfg.head_dim * (cfg.num_heads + 2 * cfg.num_kv_heads) * jnp.dtype(dtype).itemsize


def _abstract(x):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)


def abstract_state(cfg, method, batch, cap, layer, dtype):
    """The state's shapes (``jax.eval_shape`` of ``init``; a concrete ``init`` where it is not abstractly
    evaluable). Raises the method's ValueError where it refuses the capacity. ``method``: the plan; the layer's own
    method (``method.at(layer)``) is built."""
    method = method.at(layer)
    try:
        return jax.eval_shape(lambda: method.init(cfg, batch, cap, layer, dtype))
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return _abstract(method.init(cfg, batch, cap, layer, dtype))


def compile_prefill(method, layer, state, q, k, v, lengths, previous):
    """The method's ``prefill`` for one layer, compiled ahead of time (``state`` donated). A method that
    ``attends_prompt`` runs ``prefill_attend`` as the engine does (the prompt's attention included: its
    ``prefill_s`` is then its whole TTFT) and the attention output is dropped after it is computed. ``method``: the
    plan; the layer's own method (``method.at(layer)``) runs."""
    method = method.at(layer)
    kw = {"previous": previous} if method.reuses_previous_layer else {}
    if getattr(method, "attends_prompt", False):  # getattr: also an older checkout

        def both(state, **a):
            out, st = method.prefill_attend(state, layer=layer, **a)
            return st, out[..., :1, :1]  # keep the attention live (a slice of it, not a copy of T x D)

        fn = jax.jit(both, donate_argnums=0)
        return _first(fn.lower(state, q=q, k=k, v=v, lengths=lengths, **kw).compile())
    fn = jax.jit(functools.partial(method.prefill, layer=layer), donate_argnums=0)
    return fn.lower(state, q=q, k=k, v=v, lengths=lengths, **kw).compile()


class _first:
    """A compiled function returning ``(state, x)`` called as one returning the state (after ``x`` is ready)."""

    def __init__(self, compiled):
        self.compiled = compiled

    def __call__(self, *a, **kw):
        st, x = self.compiled(*a, **kw)
        jax.block_until_ready(x)
        return st

    def memory_analysis(self):
        return self.compiled.memory_analysis()


def temp_bytes(compiled) -> int:
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001  (a backend without memory analysis)
        return 0


def plan_variant(cfg, var: Variant, layers, batch, n, cap, dtype) -> None:
    """Fill ``var``'s state bytes, compiled prefills and their temporaries from shapes (nothing allocated), or its
    skip reason where ``init`` refuses the capacity."""
    q, k, v = jax.eval_shape(functools.partial(_prompt, jax.random.PRNGKey(0), batch, n, cfg, dtype))
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    prev = None
    for layer in layers:
        try:
            st = abstract_state(cfg, var.method, batch, cap, layer, dtype)
        except ValueError as e:
            var.skipped = f"init refuses the capacity: {e}"
            return
        var.state_bytes += tree_bytes(st)
        try:
            var.prefills[layer] = compile_prefill(var.method, layer, st, q, k, v, lengths, prev)
        except Exception as e:  # noqa: BLE001  (a kernel that fails to lower or compile on this backend)
            var.failed = f"prefill compile: {_error(e)}"
            return
        var.prefill_temp = max(var.prefill_temp, temp_bytes(var.prefills[layer]))
        prev = st


def build(cfg, var: Variant, layers, batch, n, cap, dtype, seed=0) -> Run:
    """Prefill every layer with its random prompt (per-layer seeds, the same for every variant); ``prefill_s`` is
    the sum of the compiled prefills' seconds (one run each, compile excluded)."""
    lengths = jnp.full((batch,), n, jnp.int32)
    run, prev = Run(var.label, var.method, var.budget, []), None
    for layer in layers:
        q, k, v = _prompt_jit(jax.random.PRNGKey(seed * 1000 + layer), batch, n, cfg, dtype)
        m = var.method.at(layer)
        st = jax.block_until_ready(m.init(cfg, batch, cap, layer, dtype))
        kw = {"previous": prev} if m.reuses_previous_layer else {}
        jax.block_until_ready((q, k, v))
        t0 = time.perf_counter()
        st = jax.block_until_ready(var.prefills[layer](st, q=q, k=k, v=v, lengths=lengths, **kw))
        run.prefill_s += time.perf_counter() - t0
        run.states.append(st)
        prev = st
        del q, k, v
    return run


def time_attention(cfg, layers, batch, n, dtype, seed=0) -> float:
    """Seconds of the causal prefill attention over every layer's prompt (compiled ahead of time, one run each; a
    local layer's windowed)."""
    lengths = jnp.full((batch,), n, jnp.int32)
    total, fns = 0.0, {}
    for layer in layers:
        q, k, v = jax.block_until_ready(_prompt_jit(jax.random.PRNGKey(seed * 1000 + layer), batch, n, cfg, dtype))
        w = cfg.sliding_windows[layer]
        if w not in fns:
            fns[w] = jax.jit(functools.partial(M.causal_attention, sliding_window=w)).lower(q, k, v, lengths).compile()
        fn = fns[w]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(q, k, v, lengths))
        total += time.perf_counter() - t0
        del q, k, v
    return total


def time_dense(cfg, batch, n, dtype, seed=0) -> float:
    """Seconds of one layer's position-wise prefill work over an ``n``-token prompt (``--model-ttft``): the engine's
    ``layer_qkv_blocks`` then ``layer_finish_blocks`` on random weights of ``cfg``'s layer shapes (hidden size,
    heads, intermediate size), with q standing in for the attention output between them (compiled ahead of time,
    one run)."""
    print("  timing one layer's projections and MLP", flush=True)
    one = dataclasses.replace(cfg, num_layers=1, vocab_size=256, sliding_windows=cfg.sliding_windows[:1])
    lp = M.layer_params(M.random_params(one, jax.random.PRNGKey(seed), dtype), 0)
    x = jax.random.normal(jax.random.PRNGKey(seed + 1), (batch, n, cfg.hidden_size), dtype)
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (batch, n))
    block = M.TOKEN_BLOCK if n % M.TOKEN_BLOCK == 0 else n

    def dense(lp, x, positions):
        q, _, _ = M.layer_qkv_blocks(cfg, lp, x, positions, n, block)
        return M.layer_finish_blocks(cfg, lp, x, q, n, block)

    fn = jax.jit(dense).lower(lp, x, positions).compile()
    t0 = time.perf_counter()
    jax.block_until_ready(fn(lp, x, positions))
    return time.perf_counter() - t0


class PrefillClock:
    """The prefill-time cap: the largest measured prefill per (name, dtype), and a quadratic estimate from it."""

    def __init__(self):
        self.refs: dict = {}
        self.dense: dict = {}  # (context, batch, dtype) -> time_dense seconds (--model-ttft)

    def record(self, name, dtype, n, batch, seconds_per_layer) -> None:
        ref = self.refs.get((name, dtype))
        if ref is None or n * n * batch >= ref[0] * ref[0] * ref[1]:
            self.refs[(name, dtype)] = (n, batch, seconds_per_layer)

    def estimate(self, name, dtype, n, batch, layers) -> float | None:
        """``t_ref * (n / n_ref)^2 * (batch / batch_ref) * layers`` seconds, None without a reference."""
        ref = self.refs.get((name, dtype))
        return None if ref is None else ref[2] * (n / ref[0]) ** 2 * (batch / ref[1]) * layers


def calibrate(cfg, clock: PrefillClock, var: Variant, layer, dtype, n_cal) -> None:
    """Time ``var``'s prefill once at ``n_cal`` tokens, batch 1 (compile excluded) as the clock's reference."""
    dt = jnp.dtype(dtype).name
    cap = Capacity(n_cal, 2)
    q, k, v = _prompt_jit(jax.random.PRNGKey(99), 1, n_cal, cfg, dtype)
    lengths = jnp.full((1,), n_cal, jnp.int32)
    kw = {"previous": None} if var.method.reuses_previous_layer else {}
    try:
        st = var.method.at(layer).init(cfg, 1, cap, layer, dtype)
    except ValueError:
        return  # refuses the calibration's capacity: no reference, the run's own measurements will be
    fn = compile_prefill(var.method, layer, _abstract(st), q, k, v, lengths, None)
    jax.block_until_ready((q, k, v, st))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(st, q=q, k=k, v=v, lengths=lengths, **kw))
    clock.record(var.method.name, dt, n_cal, 1, time.perf_counter() - t0)


def calibrate_attention(cfg, clock: PrefillClock, layer, dtype, n_cal) -> None:
    clock.record("attention", jnp.dtype(dtype).name, n_cal, 1, time_attention(cfg, [layer], 1, n_cal, dtype, 99))


def plan_groups(full: Variant, others: list[Variant], base: int, limit: int | None):
    """Pack ``others`` into groups that fit ``limit`` bytes with ``base`` (the prompt) and ``full``'s states.
    Returns ``(groups, too_big)``: lists of variants (without full) and ``(variant, reason)`` pairs."""
    groups, cur, too_big = [], [], []
    fixed = base + full.state_bytes

    def need(vs):
        return fixed + sum(v.state_bytes for v in vs) + max([full.prefill_temp] + [v.prefill_temp for v in vs])

    for v in others:
        if limit and need([v]) > limit:
            too_big.append(
                (
                    v,
                    f"estimated memory {need([v]) / 2**30:.1f} GiB (prompt {base / 2**30:.1f} + full's "
                    f"states {full.state_bytes / 2**30:.1f} + its states {v.state_bytes / 2**30:.1f} + "
                    f"prefill temporaries {v.prefill_temp / 2**30:.1f}) > --memory-gb "
                    f"{limit / 2**30:.1f} GiB",
                )
            )
            continue
        if cur and limit and need(cur + [v]) > limit:
            groups.append(cur)
            cur = []
        cur.append(v)
    if cur or not groups:
        groups.append(cur)
    return groups, too_big


def decode_inputs(cfg, batch, dtype, seed=7):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (
        jax.random.normal(kq, (batch, cfg.num_heads, cfg.head_dim), dtype),
        jax.random.normal(kk, (batch, cfg.num_kv_heads, cfg.head_dim), dtype),
        jax.random.normal(kv, (batch, cfg.num_kv_heads, cfg.head_dim), dtype),
    )


def compile_step(run: Run, layers, args, pos, steps: int = 1) -> None:
    """Compile the donated decode step over every layer ahead of time. ``steps == 1`` (``--timing calls``): one step
    per call, and XLA's bytes accessed recorded; ``steps > 1`` (``--timing loop``): ``steps`` steps in one program
    (a ``fori_loop``, positions advancing), as the engine's decode loop runs them, so a call's fixed cost (dispatch,
    argument handling: tens of microseconds, a large share of a compressed step on a GPU) is paid once per
    ``steps``; XLA's cost analysis counts a loop body once, so ``xla_bytes`` is not recorded."""
    method = run.method

    def step(states, q, k, v, pos):
        outs, new = [], []
        for layer, st in zip(layers, states):
            o, st = method.at(layer).decode(st, layer, q, k, v, pos)
            outs.append(o)
            new.append(st)
        return sum(o.astype(jnp.float32).sum() for o in outs), new

    def loop(states, q, k, v, pos):
        def body(i, carry):
            total, st = carry
            out, st = step(st, q, k, v, pos + i)
            return total + out, st

        return jax.lax.fori_loop(0, steps, body, (jnp.zeros((), jnp.float32), states))

    run.steps = steps
    run.step = jax.jit(step if steps == 1 else loop, donate_argnums=0).lower(run.states, *args, pos).compile()
    run.xla_bytes = xla_bytes(run.step) if steps == 1 else None


def xla_bytes(compiled) -> float | None:
    """``cost_analysis()["bytes accessed"]`` of a compiled step (None where the backend gives none)."""
    try:
        ca = compiled.cost_analysis()
    except Exception:  # noqa: BLE001  (a backend without cost analysis)
        return None
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return float(ca.get("bytes accessed", 0.0)) if ca else None


def time_runs(runs: list[Run], args, n, steps: int, rounds: int, progress=print) -> dict[str, float]:
    """Median step seconds per run label: ``rounds`` rounds (after one warm-up round) of ``steps`` steps of every
    run, the order rotated each round. Positions advance from ``n`` (the method's next token). A run compiled
    with ``steps`` steps in one program (``compile_step``) is called once per round."""
    times = {r.label: [] for r in runs}
    pos0 = jnp.full((args[0].shape[0],), n, jnp.int32)
    used = {r.label: 0 for r in runs}
    for rnd in range(rounds + 1):
        order = runs[rnd % len(runs) :] + runs[: rnd % len(runs)]
        for r in order:
            t0 = time.perf_counter()
            for _ in range(steps // r.steps):
                out, r.states = r.step(r.states, *args, pos0 + used[r.label])
                used[r.label] += r.steps
            jax.block_until_ready(out)
            if rnd:
                times[r.label].append((time.perf_counter() - t0) / steps)
        progress(f"  round {rnd}/{rounds}")
    return {k: float(np.median(v)) for k, v in times.items()}


def bandwidth_gbs(nbytes: int = 512 << 20, repeats: int = 10) -> dict:
    """The machine's measured read bandwidth (sum of a ``nbytes`` float32 array) and copy bandwidth (read + write
    of ``x + 1``, in place), GB/s, medians."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    read = jax.jit(jnp.sum)
    copy = jax.jit(lambda a: a + 1.0, donate_argnums=0)  # in place: no fresh pages to fault in
    out = {"bandwidth_bytes": nbytes}
    for name, fn, moved in (("read_gbs", read, nbytes), ("copy_gbs", copy, 2 * nbytes)):
        ts = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            y = jax.block_until_ready(fn(x))
            if i:
                ts.append(time.perf_counter() - t0)
            if name == "copy_gbs":
                x = y  # the input was donated
        out[name] = moved / float(np.median(ts)) / 1e9
    return out


# ---------------------------------------------------------------------------------------------------------------
# Ratios, table, projection, plot.


def add_ratios(rows: list[dict], full_index: int) -> None:
    """Ratios of ``rows`` (one group of one configuration, full first) to the full row at ``full_index`` of the
    run's row list (``rows[0]``)."""
    full = rows[0]
    for r in rows:
        r["full_row"] = full_index
        r["speedup"] = full["step_s"] / r["step_s"]
        r["time_ratio"] = r["step_s"] / full["step_s"]
        r["bytes_ratio"] = r["bytes_read"] / full["bytes_read"]
        r["efficiency"] = r["time_ratio"] / r["bytes_ratio"]
        if r.get("ttft_s") is not None and full.get("ttft_s") is not None:
            r["ttft_ratio"] = r["ttft_s"] / full["ttft_s"]
            r["compress_share"] = (r["ttft_s"] - full["ttft_s"]) / r["ttft_s"]
        else:
            r["ttft_ratio"] = r["compress_share"] = None
        dense = r["layers"] * r["dense_s"] if r.get("dense_s") is not None else None
        r["model_ttft_ratio"] = (
            (dense + r["ttft_s"]) / (dense + full["ttft_s"]) if dense is not None and r["ttft_ratio"] else None
        )


def _f(x, fmt, suffix=""):
    return "-" if x is None else format(x, fmt) + suffix


def table(rows: list[dict]) -> str:
    """One block per (context, batch, dtype): every row of it (skipped rows with their reason)."""
    head = (
        f"{'method':22s} {'step ms':>8s} {'MiB/step':>9s} {'XLA MiB':>8s} {'GB/s':>6s} {'time/full':>9s} "
        f"{'bytes/full':>10s} {'eff':>5s} {'speedup':>7s} {'TTFT s':>8s} {'TTFT x':>6s} {'comp%':>6s}"
    )
    model = any(r.get("model_ttft_ratio") is not None for r in rows)
    head += f" {'model TTFT x':>12s}" if model else ""
    lines = []
    for key in dict.fromkeys((r["context"], r["batch"], r["dtype"]) for r in rows):
        block = [r for r in rows if (r["context"], r["batch"], r["dtype"]) == key]
        lines += [f"\n== {context_label(key[0])} tokens, batch {key[1]}, {key[2]} ==", head]
        for r in block:
            label = r["label"] + (f" (g{r['group']})" if r.get("group") else "")
            if r.get("status") != "ok":
                lines.append(f"{label:22s} {r['status']}: {r.get('skipped') or r.get('error', '')}")
                continue
            lines.append(
                f"{label:22s} {r['step_s'] * 1e3:8.2f} {r['bytes_read'] / 2**20:9.1f} "
                f"{_f(r.get('xla_bytes') and r['xla_bytes'] / 2**20, '8.1f'):>8s} {r['gbs']:6.1f} "
                f"{r['time_ratio']:9.3f} {r['bytes_ratio']:10.3f} {r['efficiency']:5.2f} {r['speedup']:7.2f} "
                f"{_f(r.get('ttft_s'), '8.2f'):>8s} {_f(r.get('ttft_ratio'), '6.2f'):>6s} "
                f"{_f(r.get('compress_share'), '6.1%'):>6s}"
                + (f" {_f(r.get('model_ttft_ratio'), '12.3f'):>12s}" if model else "")
            )
        skipped_ttft = next((r.get("ttft_skipped") for r in block if r.get("ttft_skipped")), None)
        if skipped_ttft:
            lines.append(f"(TTFT not measured: {skipped_ttft})")
        dense = next((r["dense_s"] for r in block if r.get("dense_s") is not None), None)
        if dense is not None:
            lines.append(
                f"(model TTFT x: each layer adds {dense:.2f} s of projections and MLP, measured, to every method's "
                "attention-only TTFT)"
            )
    return "\n".join(lines)


def projection(
    rows: list[dict], weights: float = WEIGHTS_8B_BF16, layers: int = MODEL_LAYERS, devices: dict | None = None
) -> list[dict]:
    """Projected TPOT of an 8B model per method and context (batch 1), from this run's ratios.

    Assumes a decode step reads the weights once and each layer's KV bytes once, at the device's published
    bandwidth, with nothing else (no compute, launch or host overhead): full's TPOT = ``(W + KV_full) / BW`` with
    ``KV_full`` = full's measured bytes read per step, per layer, x ``layers``, at bfloat16 (from the bfloat16 row
    if the run has one, else the float32 row / 2: full reads only K/V); a method's TPOT = ``(W + KV_m * eff) / BW``
    with ``KV_m = bytes_ratio * KV_full`` and ``eff`` its measured efficiency (the row's dtype: bfloat16 where run,
    else float32; ``measured_dtype``), i.e. its KV part costs what its measured time ratio says. The bandwidth
    cancels in the speed-up, which is therefore the same on every device under this model; the TPOTs differ.
    ``ideal_speedup`` takes ``eff = 1``."""
    devices = PROJECTION_DEVICES if devices is None else devices
    ok = [r for r in rows if r.get("status") == "ok" and r["batch"] == 1]
    out = []
    for n in sorted({r["context"] for r in ok}):
        at_n = [r for r in ok if r["context"] == n]
        dt = "bfloat16" if any(r["dtype"] == "bfloat16" for r in at_n) else at_n[0]["dtype"]
        sel = [r for r in at_n if r["dtype"] == dt]
        full = next((r for r in sel if r["label"] == "full"), None)
        if full is None:
            continue
        kv_full = full["bytes_read"] / full["layers"] * layers * 2 / jnp.dtype(dt).itemsize
        for r in sel:
            if r["label"] == "full":
                continue
            kv_m = r["bytes_ratio"] * kv_full
            p = {
                "context": n,
                "label": r["label"],
                "method": r["method"],
                "budget": r["budget"],
                "measured_dtype": dt,
                "efficiency": r["efficiency"],
                "bytes_ratio": r["bytes_ratio"],
                "weights_bytes": weights,
                "kv_full_bytes": kv_full,
                "kv_bytes": kv_m,
                "speedup": (weights + kv_full) / (weights + kv_m * r["efficiency"]),
                "ideal_speedup": (weights + kv_full) / (weights + kv_m),
            }
            for dev, bw in devices.items():
                p[f"tpot_full_s[{dev}]"] = (weights + kv_full) / bw
                p[f"tpot_s[{dev}]"] = (weights + kv_m * r["efficiency"]) / bw
            out.append(p)
    return out


def _paper_figure(p: dict) -> str:
    """The papers' figure at this projection's (method, budget, context), from ``e2e.PAPERS``, else ''."""
    ch, ck, cu = PAPERS["chelsea"], PAPERS["clusterkv"], PAPERS["chunkkv"]
    if p["label"] == f"chelsea@{ch['budget']}" and p["context"] in ch["tpot_speedup_by_context"]:
        return f"Chelsea Table 3: TPOT {ch['tpot_speedup_by_context'][p['context']]:.2f}x"
    if p["label"] == f"clusterkv@{ck['budget']}" and p["context"] == ck["context"]:
        return f"ClusterKV Fig. 12: e2e latency {ck['e2e_speedup']:.1f}x (decode + prefill)"
    if p["method"] == "chunkkv" and p["context"] == cu["context"]:
        return (
            f"ChunkKV Table 8: throughput +{cu['throughput_gain_reuse_vs_full']:.1%} (reuse; budget not "
            f"stated), i.e. {1 + cu['throughput_gain_reuse_vs_full']:.3f}x"
        )
    return ""


def projection_text(proj: list[dict], weights: float = WEIGHTS_8B_BF16, layers: int = MODEL_LAYERS) -> str:
    devs = sorted(
        {k[k.index("[") + 1 : -1] for p in proj for k in p if k.startswith("tpot_s[")},
        key=lambda d: list(PROJECTION_DEVICES).index(d) if d in PROJECTION_DEVICES else 99,
    )
    lines = [
        "\n== PROJECTION (not a measurement): Llama-3.1-8B TPOT, batch 1, bfloat16 ==",
        f"TPOT = (weights {weights / 1e9:.2f} GB + KV bytes read per step over {layers} layers) / bandwidth "
        f"({', '.join(f'{d} {PROJECTION_DEVICES.get(d, 0) / 1e9:.0f} GB/s' for d in devs)}); a method's KV "
        "part x its efficiency measured above (its time ratio on this CPU, attention + cache only). Assumes "
        "the step is bandwidth-bound with no compute, launch or host overhead; the speed-up is then the same "
        "on every device (the bandwidth cancels). 'ideal' takes efficiency 1. The papers' figures are "
        "end-to-end on their own stacks.",
    ]
    if not proj:
        return "\n".join(lines + ["(no batch-1 rows with a full row: nothing to project)"])
    head = f"{'context':>7s} {'method':20s} {'eff':>5s} {'KV GB':>6s}"
    for d in devs:
        head += f" {d + ' full ms':>14s} {d + ' ms':>10s}"
    lines.append(head + f" {'speedup':>7s} {'ideal':>6s}  paper")
    for p in proj:
        line = f"{context_label(p['context']):>7s} {p['label']:20s} {p['efficiency']:5.2f} {p['kv_bytes'] / 1e9:6.2f}"
        for d in devs:
            line += f" {p[f'tpot_full_s[{d}]'] * 1e3:14.2f} {p[f'tpot_s[{d}]'] * 1e3:10.2f}"
        lines.append(line + f" {p['speedup']:6.2f}x {p['ideal_speedup']:5.2f}x  {_paper_figure(p)}")
    return "\n".join(lines)


#: The plot's markers (with 28 colours: every variant of the default grid gets its own colour).
MARKERS = "os^vDP*Xh<>"


def plot(rows: list[dict], path: Path, title: str = "") -> str:
    """Speed-up vs context per variant (solid), its bytes-ratio ideal (dashed, same colour and hollow marker); one
    panel per (batch, dtype); the legend outside the panels. Returns what was done."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.ticker import FuncFormatter, NullLocator
    except ImportError:
        return "plot skipped: matplotlib is not importable"
    ok = [r for r in rows if r.get("status") == "ok" and r["label"] != "full"]
    panels = list(dict.fromkeys((r["batch"], r["dtype"]) for r in ok))
    if not panels:
        return "plot skipped: no rows besides full"
    labels = list(dict.fromkeys(r["label"] for r in ok))
    t20 = list(plt.cm.tab20.colors)
    colours = t20[0::2] + t20[1::2] + list(plt.cm.tab20b.colors[0::4]) + list(plt.cm.tab20b.colors[2::4])  # dark first
    style = {lab: (colours[i % len(colours)], MARKERS[i % len(MARKERS)]) for i, lab in enumerate(labels)}
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5), squeeze=False)
    for ax, (b, dt) in zip(axes[0], panels):
        for lab in labels:
            pts = sorted(
                (r["context"], r["speedup"], 1 / r["bytes_ratio"])
                for r in ok
                if (r["batch"], r["dtype"], r["label"]) == (b, dt, lab)
            )
            if not pts:
                continue
            c, m = style[lab]
            xs = [p[0] for p in pts]
            ax.plot(xs, [p[1] for p in pts], color=c, marker=m, lw=1.5)
            ax.plot(xs, [p[2] for p in pts], color=c, marker=m, mfc="none", ls="--", lw=1, alpha=0.7)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ctx = sorted({r["context"] for r in ok if (r["batch"], r["dtype"]) == (b, dt)})
        ax.set_xticks(ctx, [context_label(c) for c in ctx])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
        ax.axhline(1.0, color="grey", lw=0.7)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("decode-step speed-up vs full")
        ax.set_title(f"batch {b}, {dt}")
    handles = [Line2D([], [], color=style[lab][0], marker=style[lab][1], label=lab) for lab in labels]
    handles += [
        Line2D([], [], color="k", label="solid: measured"),
        Line2D([], [], color="k", ls="--", marker="o", mfc="none", label="dashed: bytes-ratio ideal"),
    ]
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.suptitle(title or "attention + cache only, Llama-3.1-8B attention shapes", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return f"wrote {path}"


def report(data: dict, out_path: Path) -> str:
    """Print the table and the projection of a run's JSON; write them as ``.txt`` and the plot as ``.png`` beside
    it. Returns the text."""
    rows = data["rows"]
    title = (
        f"roofline: {data['setting']}; {data.get('device_kind')} ({data.get('backend')}), jax "
        f"{data.get('jax_version')}, commit {(data.get('commit') or '?')[:10]}"
        f"{' (dirty)' if data.get('commit_dirty') else ''}; {data.get('layers')} layer(s) from "
        f"{data.get('first_layer')}; read {_f(data.get('read_gbs'), '.1f')} GB/s, copy "
        f"{_f(data.get('copy_gbs'), '.1f')} GB/s; load average {_f(data.get('load_average_1min'), '.2f')}"
    )
    text = title + "\n" + table(rows) + "\n" + projection_text(projection(rows))
    print(text, flush=True)
    out_path.with_suffix(".txt").write_text(text + "\n")
    print(plot(rows, out_path.with_suffix(".png"), title=f"{data.get('device_kind')}: {data['setting']}"), flush=True)
    return text


def merge_runs(datas: list[dict], paths: list[str]) -> dict:
    """Several runs' JSONs as one (``--report a.json,b.json``): the first's header, every row (``full_row``
    re-indexed, ``source`` naming its file; each row's ratios stay those to its own run's full) and ``sources``
    (each run's file, commit, command, bandwidth and load average)."""
    keep = (
        "commit",
        "commit_dirty",
        "command",
        "jax_version",
        "device_kind",
        "read_gbs",
        "copy_gbs",
        "load_average_1min",
    )
    out = {
        **datas[0],
        "rows": [],
        "sources": [{"file": p, **{k: d.get(k) for k in keep}} for d, p in zip(datas, paths)],
    }
    for d, p in zip(datas, paths):
        off = len(out["rows"])
        for r in d["rows"]:
            out["rows"].append({**r, "source": p, **({"full_row": r["full_row"] + off} if "full_row" in r else {})})
    if len({d.get("commit") for d in datas}) > 1:
        out["commit"] = ",".join(dict.fromkeys(str(d.get("commit")) for d in datas))
    return out


# ---------------------------------------------------------------------------------------------------------------


def _dirty() -> bool | None:
    """Whether kvjax/, kernels_pallas/ or benchmarks/ differ from the commit; None without git."""
    try:
        return bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--", "kvjax", "kernels_pallas", "benchmarks"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).resolve().parents[1],
                check=True,
            ).stdout.strip()
        )
    except (OSError, subprocess.CalledProcessError):
        return None


def header(args, cfg, limit) -> dict:
    dev = jax.devices()[0]
    return {
        "benchmark": "roofline",
        "setting": f"attention + cache only (no weights), {'tiny' if args.tiny else args.shape} attention "
        f"shapes ({cfg.num_heads}/{cfg.num_kv_heads} heads x {cfg.head_dim})",
        "jax_version": jax.__version__,
        "device": str(dev),
        "device_kind": dev.device_kind,
        "backend": jax.default_backend(),
        "commit": commit(),
        "commit_dirty": None if os.environ.get("KVJAX_COMMIT") else _dirty(),  # a copied tree: given, not checked
        "command": shlex.join([sys.executable] + sys.argv),
        "layers": args.layers,
        "first_layer": args.first_layer,
        "steps": args.steps,
        "rounds": args.rounds,
        "timing": args.timing,
        "memory_limit_bytes": limit,
        "max_prefill_s": args.max_prefill_s,
        "calibration_len": args.calibration_len,
        "projection_weights_bytes": WEIGHTS_8B_BF16,
        "projection_layers": MODEL_LAYERS,
        "projection_devices_bytes_per_s": PROJECTION_DEVICES,
        "papers": PAPERS,
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


#: what a run resumed with ``--resume`` must share with the earlier one (besides its commit)
RESUMED_SETTINGS = ("setting", "device_kind", "backend", "layers", "first_layer", "steps", "rounds", "timing")


def resumable_rows(old: dict, new: dict) -> list[dict]:
    """The earlier run's rows that ``--resume`` keeps: all of them when it ran at the same commit (known, the tree
    clean) with the same settings (:data:`RESUMED_SETTINGS`), else none (printing why: everything is measured
    again)."""
    why = None
    if not new.get("commit") or old.get("commit") != new["commit"]:
        why = f"it ran at commit {old.get('commit')}, this is {new.get('commit')}"
    elif old.get("commit_dirty") or new.get("commit_dirty"):
        why = "kvjax/, kernels_pallas/ or benchmarks/ differ from the commit"
    else:
        diff = [k for k in RESUMED_SETTINGS if old.get(k) != new.get(k)]
        why = f"other settings: {', '.join(f'{k} {old.get(k)!r} -> {new.get(k)!r}' for k in diff)}" if diff else None
    if why:
        print(f"--resume: measuring everything again ({why})", flush=True)
        return []
    print(f"--resume: keeping {len(old['rows'])} rows of the earlier run", flush=True)
    return old["rows"]


def _budgets(text):
    from e2e import _budgets as parse

    return parse(text)


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--lengths", default="8k,16k,32k,64k,128k", help="prompt lengths (8k = 8192 tokens)")
    p.add_argument("--batch", default="1,4", help="batch sizes, comma-separated")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    p.add_argument("--methods", default=",".join(methods.names()), help="registered methods (full always runs)")
    p.add_argument("--budgets", default="0.1,0.2", help="budgets of every method")
    p.add_argument("--token-budgets", default="1024,2048", help="also run the recall methods at these ('' none)")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--first-layer", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="decode steps per variant per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--timing",
        choices=("loop", "calls"),
        default="loop",
        help="loop: the --steps steps in one compiled program (as the engine's decode loop; a call's fixed cost "
        "paid once); calls: one call per step (records XLA's bytes accessed)",
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=0,
        help="plan, time and write at most this many variants (besides full) at a time, so a run cut short keeps "
        "what it timed (0: all at once)",
    )
    p.add_argument(
        "--memory-gb",
        type=float,
        default=None,
        help="memory for the skip/group rule (default: 90%% of an accelerator's, 60%% of the host's RAM)",
    )
    p.add_argument(
        "--max-prefill-s",
        type=float,
        default=600.0,
        help="skip a prefill whose estimated seconds (all layers) exceed this",
    )
    p.add_argument("--calibration-len", type=int, default=4096, help="prompt of the prefill-time calibration")
    p.add_argument(
        "--model-ttft",
        action="store_true",
        help="also time one layer's projections and MLP at each prompt and report the model-level TTFT ratio",
    )
    p.add_argument(
        "--quick", action="store_true", help="a few minutes: " + ", ".join(f"{k}={v}" for k, v in QUICK.items())
    )
    p.add_argument("--tiny", action="store_true", help="a 4-head, 32-dim config (smoke tests)")
    p.add_argument(
        "--shape",
        default="llama-3.1-8b",
        choices=sorted(SHAPES),
        help="attention shapes: Llama-3.1-8B's, or Gemma-3-12B's with its local/global layers (gemma3) or with "
        "every layer global (gemma3-global)",
    )
    p.add_argument("--bandwidth-mib", type=int, default=512, help="array size of the bandwidth measurement")
    p.add_argument("--out", default="benchmarks/results/roofline_cpu.json")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep --out's rows if it ran at this commit with these settings, and measure only the variants it lacks "
        "(full is timed again beside them); a short device lease rerun",
    )
    p.add_argument(
        "--report",
        default=None,
        metavar="JSON",
        help="only redraw the table, plot and projection of an earlier run's JSON, beside it; "
        "several (a.json,b.json): merged into --out and drawn beside it",
    )
    args = p.parse_args(argv)
    if args.quick:
        given = set(a.split("=")[0].lstrip("-").replace("-", "_") for a in (argv if argv is not None else sys.argv))
        for k, v in QUICK.items():
            if k not in given:
                setattr(args, k, v)
    try:
        args.lengths = parse_contexts(args.lengths)
        args.batch = [int(x) for x in str(args.batch).split(",") if x.strip()]
        args.budgets = _budgets(args.budgets)
        args.token_budgets = _budgets(args.token_budgets)
        args.dtypes = [jnp.dtype(d.strip()).name for d in args.dtypes.split(",") if d.strip()]
    except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
        p.error(str(e))
    if args.layers < 1 or args.steps < 1 or args.rounds < 1 or args.group_size < 0:
        p.error("--layers, --steps and --rounds must be >= 1, --group-size >= 0")
    return args


def memory_limit(gb: float | None) -> int | None:
    """Bytes for the memory rule: ``--memory-gb``, else 90% of the device's ``bytes_limit`` (GPU, TPU), else 60%
    of the host's RAM (CPU: the host is shared)."""
    if gb:
        return int(gb * 2**30)
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001  (backends without memory stats raise various errors)
        stats = {}
    if stats.get("bytes_limit"):
        return int(0.9 * stats["bytes_limit"])
    try:
        return int(0.6 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def cap_prefill(cfg, args, vars_, clock, n, batch, dtype, layers):
    """The prefill-time cap (module docstring, "prefill time"): marks the variants whose estimated prefill exceeds
    ``--max-prefill-s`` skipped, calibrating a method's clock first where it has none; returns the reason the
    causal-attention TTFT columns are skipped (None: they are measured)."""
    dt = jnp.dtype(dtype).name
    calibrated = set()
    capped = args.max_prefill_s != float("inf")  # inf: no cap, so no calibration (a short accelerator lease)
    for v in vars_:  # the prefill-time cap
        if v.skipped or not capped:
            continue
        est = clock.estimate(v.method.name, dt, n, batch, len(layers))
        if est is None and n > args.calibration_len and v.method.name not in calibrated:
            print(f"  calibrating {v.method.name}'s prefill at {args.calibration_len} tokens", flush=True)
            calibrate(cfg, clock, v, layers[0], dtype, args.calibration_len)
            calibrated.add(v.method.name)
            est = clock.estimate(v.method.name, dt, n, batch, len(layers))
        if est is not None and est > args.max_prefill_s:
            v.skipped = (
                f"prefill estimated at {est:.0f} s > --max-prefill-s {args.max_prefill_s:.0f} "
                f"(the largest measured, scaled as (n/n_ref)^2 x batch x layers)"
            )
    ttft_skip = None
    est = clock.estimate("attention", dt, n, batch, len(layers))
    if est is None and n > args.calibration_len and capped:
        calibrate_attention(cfg, clock, layers[0], dtype, args.calibration_len)
        est = clock.estimate("attention", dt, n, batch, len(layers))
    if est is not None and est > args.max_prefill_s:
        ttft_skip = (
            f"causal attention estimated at {est:.0f} s > --max-prefill-s {args.max_prefill_s:.0f} "
            f"(quadratic in the prompt)"
        )
    return ttft_skip


def run_config(cfg, args, n, batch, dt, names, layers, clock, limit, rows, write) -> None:
    """Every variant at one (context, batch, dtype), in pieces of ``--group-size`` variants (all at once by
    default): each piece planned, built, timed beside ``full`` and written before the next is compiled, so a run
    cut short (a device lease) keeps what it timed."""
    dtype = jnp.dtype(dt)
    cap = Capacity(n, args.steps * (args.rounds + 1) + 1)
    base = {"context": n, "batch": batch, "dtype": dt, "layers": len(layers)}
    vars_ = [
        Variant(label, for_model(cfg, m), b) for label, m, b in variants(names, args.budgets, args.token_budgets, (1,))
    ]
    done = {r["label"] for r in rows if r["status"] in ("ok", "failed") and all(r.get(k) == base[k] for k in base)}
    if done:  # --resume: measured (or failed) at this commit; full is timed again beside the rest
        vars_ = vars_[:1] + [v for v in vars_[1:] if v.label not in done]
        print(f"== {context_label(n)} B={batch} {dt}: {len(done)} variants measured at this commit", flush=True)
        if len(vars_) == 1:
            return
    print(f"== {context_label(n)} B={batch} {dt}: planning {len(vars_)} variants", flush=True)
    size = args.group_size or len(vars_)
    attention_s = None
    for i in range(0, max(len(vars_) - 1, 1), size):
        piece = [vars_[0]] + vars_[1 + i : 1 + i + size]
        attention_s = _run_piece(
            cfg, args, n, batch, dtype, piece, layers, clock, limit, rows, write, base, cap, attention_s
        )
        if attention_s is False:  # full cannot run: this piece's variants are recorded, and the rest
            rows.extend(_skipped_row(base, v, "full cannot run here (its row)") for v in vars_[1 + i + size :])
            break
    write()
    print(table([r for r in rows if (r["context"], r["batch"], r["dtype"]) == (n, batch, dt)]), flush=True)


def _error(e: BaseException) -> str:
    """``Type: message`` of an exception, its first 400 characters (a Pallas lowering error runs to pages)."""
    return f"{type(e).__name__}: {e}"[:400]


def _failed_row(base, v, error) -> dict:
    return {**base, "label": v.label, "method": v.method.name, "budget": v.budget, "status": "failed", "error": error}


def _full_failed(rows, base, vars_, write) -> bool:
    """Every variant of ``vars_`` recorded failed because ``full`` (``vars_[0]``), their reference, failed."""
    reason = f"full failed: {vars_[0].failed}"
    rows.append(_failed_row(base, vars_[0], vars_[0].failed))
    rows.extend(_failed_row(base, v, reason) for v in vars_[1:] if not v.failed and not v.skipped)
    print(f"  {reason}", flush=True)
    write()
    return False


def _time_each_on_failure(runs, ran, dargs, n, args, rows, base) -> dict[str, float]:
    """:func:`time_runs` of ``runs`` together; where that raises, each run timed alone and those that raise again
    recorded failed (their states, donated to the failing call, cannot run again)."""
    try:
        return time_runs(runs, dargs, n, args.steps, args.rounds)
    except Exception as e:  # noqa: BLE001
        print(f"  timing together failed ({_error(e)}); timing each alone", flush=True)
    times = {}
    for r, v in zip(runs, ran):
        try:
            times.update(time_runs([r], dargs, n, args.steps, args.rounds))
        except Exception as e:  # noqa: BLE001
            v.failed = f"decode: {_error(e)}"
            if v is not ran[0]:
                rows.append(_failed_row(base, v, v.failed))
            print(f"  {v.label} failed: {v.failed}", flush=True)
    return times


def _skipped_row(base, v, reason) -> dict:
    return {
        **base,
        "label": v.label,
        "method": v.method.name,
        "budget": v.budget,
        "status": "skipped",
        "skipped": reason,
    }


def _run_piece(cfg, args, n, batch, dtype, vars_, layers, clock, limit, rows, write, base, cap, attention_s):
    """``vars_`` (``full`` first): plan, skip with reasons, group by memory, build, time; rows appended and
    written. A variant that fails (compiling, prefilling or decoding: a kernel this backend cannot run) gets a
    ``status: "failed"`` row with its error and the others go on. Returns the causal attention's seconds (timed
    once, on the first piece), or False when ``full`` cannot run."""
    dt = dtype.name
    for v in vars_:
        if not v.prefills and not v.skipped and not v.failed:  # full is planned once, on the first piece
            plan_variant(cfg, v, layers, batch, n, cap, dtype)
            if v.failed and v is vars_[0]:
                return _full_failed(rows, base, vars_, write)
            if v.failed:
                rows.append(_failed_row(base, v, v.failed))
                print(f"  {v.label} failed: {v.failed}", flush=True)
    ttft_skip = cap_prefill(cfg, args, vars_, clock, n, batch, dtype, layers)
    full, others = vars_[0], [v for v in vars_[1:] if not v.skipped and not v.failed]
    pbytes = prompt_bytes(cfg, batch, n, dtype)
    groups, too_big = plan_groups(full, others, pbytes, limit)
    for v, reason in too_big:
        v.skipped = reason
    if full.skipped or (limit and pbytes + full.state_bytes + full.prefill_temp > limit):
        reason = full.skipped or (
            f"full alone needs {(pbytes + full.state_bytes) / 2**30:.1f} GiB (prompt + "
            f"states) > --memory-gb {limit / 2**30:.1f}"
        )
        rows.extend(_skipped_row(base, v, v.skipped or f"full cannot run: {reason}") for v in vars_)
        print(f"  skipped: {reason}", flush=True)
        return False
    done = sum(r["label"] == "full" and r["status"] == "ok" and all(r[k] == base[k] for k in base) for r in rows)
    for gi, group in enumerate(groups):  # groups earlier pieces timed come first
        if attention_s is None and ttft_skip is None:
            print("  timing the causal prefill attention", flush=True)
            attention_s = time_attention(cfg, layers, batch, n, dtype)
            clock.record("attention", dt, n, batch, attention_s / len(layers))
            if args.model_ttft:
                clock.dense[(n, batch, dt)] = time_dense(cfg, batch, n, dtype)
        dargs = decode_inputs(cfg, batch, dtype)
        pos = jnp.full((batch,), n, jnp.int32)
        runs, ran = [], []
        for v in [full] + group:
            print(f"  {v.label}: prefill", flush=True)
            try:
                run = build(cfg, v, layers, batch, n, cap, dtype)
                compile_step(run, layers, dargs, pos, args.steps if args.timing == "loop" else 1)
            except Exception as e:  # noqa: BLE001  (recorded; the other variants go on)
                v.failed = f"prefill or decode compile: {_error(e)}"
                if v is full:
                    return _full_failed(rows, base, [full] + group, write)
                rows.append(_failed_row(base, v, v.failed))
                print(f"  {v.label} failed: {v.failed}", flush=True)
                continue
            clock.record(v.method.name, dt, n, batch, run.prefill_s / len(layers))
            runs.append(run)
            ran.append(v)
        times = _time_each_on_failure(runs, ran, dargs, n, args, rows, base)
        if full.label not in times:
            return _full_failed(rows, base, [full] + [v for v in ran[1:] if not v.failed], write)
        block = []
        for r, v in ((r, v) for r, v in zip(runs, ran) if r.label in times):
            read = sum(r.method.at(l).bytes_read_per_step(st, cfg.num_heads) for l, st in zip(layers, r.states))
            ttft = (
                r.prefill_s
                if getattr(r.method, "attends_prompt", False)  # prefill_attend: attention included
                else None
                if attention_s is None
                else attention_s + r.prefill_s
            )
            block.append(
                {
                    **base,
                    "label": r.label,
                    "method": r.method.name,
                    "budget": r.budget,
                    "group": done + gi,
                    "status": "ok",
                    "layer_plan": describe_plan(
                        dataclasses.replace(
                            cfg, num_layers=len(layers), sliding_windows=tuple(cfg.sliding_windows[l] for l in layers)
                        ),
                        r.method.inner if hasattr(r.method, "windows") else r.method,
                    ),
                    "step_s": times[r.label],
                    "bytes_read": int(read),
                    "xla_bytes": r.xla_bytes,
                    "gbs": read / times[r.label] / 1e9,
                    "prefill_s": r.prefill_s,
                    "attention_s": attention_s,
                    "ttft_s": ttft,
                    "ttft_skipped": ttft_skip,
                    "dense_s": clock.dense.get((n, batch, dt)),
                    "state_bytes": int(sum(tree_bytes(st) for st in r.states)),
                    "estimated_state_bytes": v.state_bytes,
                    "prefill_temp_bytes": v.prefill_temp,
                    "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                }
            )
        add_ratios(block, len(rows))
        rows.extend(block)
        del runs
        write()
    rows.extend(_skipped_row(base, v, v.skipped) for v in vars_[1:] if v.skipped)
    return attention_s


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        paths = [x for x in args.report.split(",") if x]
        if len(paths) == 1:
            report(json.loads(Path(paths[0]).read_text()), Path(paths[0]))
        else:  # merged: written to --out
            data = merge_runs([json.loads(Path(x).read_text()) for x in paths], paths)
            Path(args.out).write_text(json.dumps(data, indent=1, default=str))
            report(data, Path(args.out))
        return 0
    cfg = attention_config(args.tiny, args.shape)
    if args.first_layer + args.layers > cfg.num_layers:
        raise ValueError(
            f"--first-layer {args.first_layer} + --layers {args.layers} exceeds the model's "
            f"{cfg.num_layers} layers; lower either"
        )
    layers = list(range(args.first_layer, args.first_layer + args.layers))
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    limit = memory_limit(args.memory_gb)
    data = {**header(args, cfg, limit), **bandwidth_gbs(args.bandwidth_mib << 20), "rows": []}
    print(
        f"read {data['read_gbs']:.1f} GB/s, copy {data['copy_gbs']:.1f} GB/s; memory limit "
        f"{_f(limit and limit / 2**30, '.1f')} GiB",
        flush=True,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.resume and out.exists():
        data["rows"] = resumable_rows(json.loads(out.read_text()), data)

    def write():
        out.write_text(json.dumps(data, indent=1, default=str))

    clock = PrefillClock()
    t0 = time.perf_counter()
    for n in args.lengths:
        for batch in args.batch:
            for dt in args.dtypes:
                run_config(cfg, args, n, batch, dt, names, layers, clock, limit, data["rows"], write)
                jax.clear_caches()  # XLA:CPU maps every executable's code; dozens of them exhaust the maps
    data["wall_s"] = time.perf_counter() - t0
    write()
    report(data, out)
    print(f"wrote {out} ({data['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
