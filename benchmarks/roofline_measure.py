"""The roofline's measurement (``benchmarks/roofline.py``; its docstring says what is measured and why): the attention
shapes benchmarked, each variant's planning from shapes alone (state bytes, ahead-of-time compiled prefills and their
temporaries, groups that fit the memory), its build (the method's own prefill of a random prompt per layer), the
compiled decode step and its timed rounds, the causal prefill attention and the dense layer (``--model-ttft``) timed
beside it, the prefill-time calibration, and the machine's bandwidth. Nothing here writes, projects or plots."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import TINY  # noqa: E402
from e2e import LLAMA31_8B  # noqa: E402

from kvjax import model as M  # noqa: E402
from kvjax.methods.base import Capacity, tree_bytes  # noqa: E402
from kvjax.methods.plans.layers import method_of  # noqa: E402

#: ``--tiny``: a 4-layer model with 4 query / 2 KV heads x 32 (so ``--first-layer 2`` exists).
TINY_ATTENTION = dataclasses.replace(TINY, num_layers=4, sliding_windows=())

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

    @property
    def name(self) -> str:
        """The method's name (a per-layer plan's: its inner method's)."""
        return method_of(self.method).name


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

    @property
    def name(self) -> str:
        """The method's name (a per-layer plan's: its inner method's)."""
        return method_of(self.method).name


def _prompt(key, batch, n, cfg, dtype):
    kq, kk, kv = jax.random.split(key, 3)
    shape = lambda h: (batch, h, n, cfg.head_dim)  # noqa: E731
    return (
        jax.random.normal(kq, shape(cfg.num_heads), dtype),
        jax.random.normal(kk, shape(cfg.num_kv_heads), dtype),
        jax.random.normal(kv, shape(cfg.num_kv_heads), dtype),
    )


random_prompt = jax.jit(_prompt, static_argnums=(1, 2, 3, 4))


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
            var.failed = f"prefill compile: {error_text(e)}"
            return
        var.prefill_temp = max(var.prefill_temp, temp_bytes(var.prefills[layer]))
        prev = st


def build(cfg, var: Variant, layers, batch, n, cap, dtype, seed=0) -> Run:
    """Prefill every layer with its random prompt (per-layer seeds, the same for every variant); ``prefill_s`` is
    the sum of the compiled prefills' seconds (one run each, compile excluded)."""
    lengths = jnp.full((batch,), n, jnp.int32)
    run, prev = Run(var.label, var.method, var.budget, []), None
    for layer in layers:
        q, k, v = random_prompt(jax.random.PRNGKey(seed * 1000 + layer), batch, n, cfg, dtype)
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
        q, k, v = jax.block_until_ready(random_prompt(jax.random.PRNGKey(seed * 1000 + layer), batch, n, cfg, dtype))
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
    q, k, v = random_prompt(jax.random.PRNGKey(99), 1, n_cal, cfg, dtype)
    lengths = jnp.full((1,), n_cal, jnp.int32)
    kw = {"previous": None} if var.method.at(layer).reuses_previous_layer else {}
    try:
        st = var.method.at(layer).init(cfg, 1, cap, layer, dtype)
    except ValueError:
        return  # refuses the calibration's capacity: no reference, the run's own measurements will be
    fn = compile_prefill(var.method, layer, _abstract(st), q, k, v, lengths, None)
    jax.block_until_ready((q, k, v, st))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(st, q=q, k=k, v=v, lengths=lengths, **kw))
    clock.record(var.name, dt, n_cal, 1, time.perf_counter() - t0)


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


def error_text(e: BaseException) -> str:
    """``Type: message`` of an exception, its first 400 characters (a Pallas lowering error runs to pages)."""
    return f"{type(e).__name__}: {e}"[:400]
