"""A decode budget by composition (kvjax.methods.core.bounded): SnapKV, PyramidKV and ChunkKV holding at most
``D + every`` tokens per layer while decoding, re-compressed in the compiled loop.

- The kept positions after every step equal an independent NumPy reference (ref_bounded.py) for SnapKV (pooled,
  both pools) and ChunkKV, from random q/k, prompts whose kept part fits the budget and ones that do not.
- A decode budget at or above what a generation needs gives exactly the unbounded method's tokens.
- The held tokens follow ``held(n, s)`` at every step; the held bytes are flat over a generation well past the
  budget (read at every re-compression), while the unbounded cache grows.
- One compile for the loop (no retrace over prompts of one bucket), no copy of a K/V buffer in the compiled loop
  (unrolled and scanned layers) outside the re-compressing branch; the same prompt in two buckets gives the same.
- Bad compositions raise a ValueError naming the fix.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import engine, methods
from kvjax import model as M
from kvjax.config import ModelConfig
from kvjax.loading import Model
from extended import cases
from kvjax.methods.base import Capacity

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_bounded as refb  # noqa: E402


def prompts(lengths, seed=0):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(2, 60, size=n)) for n in lengths]


# ---- the re-compression against the NumPy reference --------------------------------------------------------------

CASES = [
    # kind, method options, reference options, decode budget, every, prompt lengths, bucket
    (
        "snapkv",
        dict(budget=12, window=4, kernel=3, pool="avg"),
        dict(P=12, window=4, kernel=3, pool="avg"),
        14,
        5,
        (30, 9),
        32,
    ),
    (
        "snapkv",
        dict(budget=20, window=3, kernel=5, pool="max"),
        dict(P=20, window=3, kernel=5, pool="max"),
        11,
        4,
        (29, 17),
        32,
    ),
    ("chunkkv", dict(budget=14, window=3, chunk_size=3), dict(P=14, window=3, chunk=3), 16, 6, (31, 12), 32),
    ("chunkkv", dict(budget=24, window=4, chunk_size=2), dict(P=24, window=4, chunk=2), 12, 5, (30, 26), 32),
    (
        "chunkkv",
        dict(budget=14, window=3, chunk_size=3, head_mode="shared"),
        dict(P=14, window=3, chunk=3, head_mode="shared"),
        16,
        6,
        (31, 12),
        32,
    ),
]


@pytest.mark.parametrize("kind,opts,ref_opts,target,every,lengths,bucket", CASES)
def test_recompression_matches_reference(tiny, kind, opts, ref_opts, target, every, lengths, bucket):
    """One layer's prefill and 23 decode steps from random q, k, v (GQA 2): the held positions of every sequence and
    KV head after each step are the reference's, in order. Cases 1 and 3 keep prompts that fit the budget (the first
    re-compression at a decode step); 2 and 4 re-compress the kept prompt at prefill."""
    run_against_reference(tiny, kind, opts, ref_opts, target, every, lengths, bucket)


THRESHOLD_CASES = [
    # case, threshold: the mean window vote a token needs, set where some re-compressions keep fewer than the target
    (CASES[0], 0.06),
    (CASES[1], 0.08),
    (CASES[2], 0.05),
    (CASES[3], 0.07),
]


@pytest.mark.parametrize("case,threshold", THRESHOLD_CASES)
def test_threshold_recompression_matches_reference(tiny, case, threshold):
    """``threshold=tau``: the held positions after prefill and every step are the reference's (each re-compression
    keeps the window plus the tokens whose mean window vote passes ``tau``, at most the target), and the threshold
    bites: some sequence holds fewer tokens than the same budget without it."""
    history = run_against_reference(tiny, *case, threshold=threshold)
    plain = run_against_reference(tiny, *case)
    counts = [(len(a), len(b)) for st, bs in zip(history, plain) for x, y in zip(st, bs) for a, b in zip(x, y)]
    assert any(a < b for a, b in counts) and all(a <= b for a, b in counts)


def run_against_reference(tiny, kind, opts, ref_opts, target, every, lengths, bucket, threshold=None):
    """Prefill and 23 steps of one layer under ``decode_budget=target`` against ``ref_bounded.simulate``; returns the
    held positions per step (``[step][b][h]``)."""
    cfg = tiny.config
    steps = 23
    m = methods.get(kind, decode_budget=target, every=every, threshold=threshold, **opts)
    b, hq, hkv, d = len(lengths), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rng = np.random.RandomState(7)
    q = rng.randn(b, hq, bucket, d).astype(np.float32)
    k = rng.randn(b, hkv, bucket, d).astype(np.float32)
    qs = rng.randn(steps, b, hq, d).astype(np.float32)
    ks = rng.randn(steps, b, hkv, d).astype(np.float32)
    lens = np.asarray(lengths, np.int32)
    want = refb.simulate(kind, ref_opts, q, k, lens, qs, ks, target, every, threshold=threshold)

    st = m.init(cfg, b, Capacity(bucket, steps), 0, jnp.float32)
    assert st.cache.k.shape[2] == target + every
    prefill = jax.jit(lambda st, q, k, lens: m.prefill(st, 0, q, k, k, lens))
    decode = jax.jit(lambda st, q, k, pos: m.decode(st, 0, q, k, k, pos))
    st = prefill(st, jnp.asarray(q), jnp.asarray(k), jnp.asarray(lens))

    def held(st):
        pos = np.asarray(st.cache.pos)
        return [[[int(p) for p in pos[i, h] if p >= 0] for h in range(hkv)] for i in range(b)]

    got = [held(st)]
    assert got[0] == want[0]
    for s in range(steps):
        _, st = decode(st, jnp.asarray(qs[s]), jnp.asarray(ks[s]), jnp.asarray(lens + s))
        got.append(held(st))
        assert got[-1] == want[s + 1], f"step {s + 1}"
        ring_pos, ring_q = np.asarray(st.q_pos), np.asarray(st.q_obs)
        for i, n in enumerate(lengths):  # the ring: exactly the last window queries, each at its position's slot
            last = range(n + s + 1 - ring_q.shape[2], n + s + 1)
            assert sorted(ring_pos[i]) == list(last), (s, i, ring_pos[i])
            for j, p in enumerate(ring_pos[i]):
                want_q = qs[p - n, i] if p >= n else q[i, :, p]
                np.testing.assert_array_equal(ring_q[i, :, j], want_q)
        for i, n in enumerate(lengths):
            counts = [len(x) for x in want[s + 1][i]]
            assert max(counts) <= m.held(n, s + 1) <= target + every
            if m.holds_exactly:
                assert counts == [m.held(n, s + 1)] * hkv
    return got


# ---- the engine: exactness, the contract, flat memory ------------------------------------------------------------


@pytest.mark.parametrize(
    "name,opts",
    [
        ("snapkv", dict(budget=0.5, window=4)),
        ("chunkkv", dict(budget=0.5, window=4, chunk_size=3)),
        # index reuse through the composed state, and PyramidKV: in CI's second line (tests/extended.py)
        pytest.param("chunkkv", dict(budget=0.5, window=4, chunk_size=3, reuse=2), marks=pytest.mark.extended),
        pytest.param("pyramidkv", dict(budget=0.5, window=4), marks=pytest.mark.extended),
    ],
)
def test_a_budget_the_generation_fits_gives_the_unbounded_tokens(tiny, name, opts):
    """A decode budget every layer's held tokens stay below never re-compresses: the tokens are the method's own."""
    ps = prompts([40, 23, 33])
    new = 30
    unbounded = engine.generate(
        tiny, ps, methods.get(name, **opts), max_new_tokens=new, driver="scan", stop_at_eos=False
    )
    bounded = methods.get(name, decode_budget=60 if name != "pyramidkv" else 1000, every=8, **opts)
    for layer in range(2):  # every layer's held tokens stay within its share of the budget
        ctx = kvjax.methods.LayerContext(layer, 2)
        assert bounded.target(layer, 2) >= max(methods.get(name, **opts).held(n, new, ctx) for n in (40, 23, 33))
    got = engine.generate(tiny, ps, bounded, max_new_tokens=new, driver="scan", stop_at_eos=False)
    assert got.tokens == unbounded.tokens
    assert [s["tokens_held"] for s in got.stats] == [s["tokens_held"] for s in unbounded.stats]


def test_threshold_zero_is_no_threshold_and_a_threshold_holds_less(tiny):
    """Through the engine, under a binding decode budget (16, every 8; prompts of 40, 23, 33 and 40 new tokens):
    ``threshold=0`` (every token passes) gives exactly the tokens and held counts of no threshold; ``threshold=0.05``
    holds at most as many tokens at every step, fewer at some."""
    ps, new = prompts([40, 23, 33]), 40
    opts = dict(budget=0.5, window=4, decode_budget=16, every=8)
    plain = engine.generate(tiny, ps, methods.get("snapkv", **opts), max_new_tokens=new, stop_at_eos=False)
    zero = engine.generate(
        tiny, ps, methods.get("snapkv", threshold=0.0, **opts), max_new_tokens=new, stop_at_eos=False
    )
    assert zero.tokens == plain.tokens
    assert [s["tokens_held"] for s in zero.stats] == [s["tokens_held"] for s in plain.stats]
    m = methods.get("snapkv", threshold=0.05, **opts)
    some = engine.generate(tiny, ps, m, max_new_tokens=new, stop_at_eos=False)
    held = [(a["tokens_held"], b["tokens_held"]) for a, b in zip(some.stats, plain.stats)]
    assert all(a <= b for a, b in held) and any(a < b for a, b in held), held


@pytest.mark.parametrize("name", cases(["snapkv", "chunkkv", "pyramidkv"], {"snapkv"}))
def test_held_bytes_are_flat_over_a_long_generation(tiny, name):
    """240 decode steps under a decode budget of 16 (every 8) on prompts of 40 and 23 tokens: after every step the
    tokens held are ``held(n, s)`` (at most, for ChunkKV) per layer, never above ``D_l + 8``; the held bytes read at
    each re-compression are one value (flat), while the unbounded method's grow by a slot per step; the allocated
    bytes do not depend on ``max_new_tokens``; one compiled step serves every step."""
    cfg = tiny.config
    opts = dict(budget=0.5, window=4, **({"chunk_size": 3} if name == "chunkkv" else {}))
    m = methods.get(name, decode_budget=16, every=8, **opts)
    lengths, steps = [40, 23], 240
    tokens, lens = engine.pad_prompts(prompts(lengths), 64)
    states = engine.init_states(cfg, m, 2, Capacity(64, steps + 1), jnp.float32)
    small = engine.init_states(cfg, m, 2, Capacity(64, 4), jnp.float32)
    assert engine.memory_bytes(m, states) == engine.memory_bytes(m, small)  # no slot per decode step
    states, logits = engine.prefill(cfg, m, tiny.params, jnp.asarray(tokens), jnp.asarray(lens), states)
    before = dict(engine.TRACE_COUNTS)
    at_rounds, pos, tok = [], jnp.asarray(lens), jnp.argmax(logits, -1)
    for s in range(1, steps + 1):
        logits, states = engine.decode_step(cfg, m, tiny.params, states, tok, pos)
        tok, pos = jnp.argmax(logits, -1), pos + 1
        per_layer = [np.asarray(mm.tokens_held(st)) for mm, st in engine.layer_methods(m, states)]
        for layer, held in enumerate(per_layer):
            for i, n in enumerate(lengths):
                bound = m.held(n, s, kvjax.methods.LayerContext(layer, cfg.num_layers))
                assert held[i] <= bound <= m.target(layer, cfg.num_layers) + 8
                if m.holds_exactly:
                    assert held[i] == bound
        if s % 8 == 0 and s >= 32:  # every re-compression once both sequences exceed the budget
            want = engine.expected_held_bytes(cfg, m, Capacity(64, steps + 1), jnp.float32, lengths, s, batch=2)
            at_rounds.append((engine.held_bytes(m, states).tolist(), want.tolist()))
    assert engine.TRACE_COUNTS["decode_step"] == before.get("decode_step", 0) + 1  # one trace for all 240 steps
    assert len({tuple(want) for _, want in at_rounds}) == 1  # the contract is flat
    for got, want in at_rounds:  # and so is what is held: the contract's bytes (at most, for ChunkKV's chunks)
        assert got == want if m.holds_exactly else all(g <= w for g, w in zip(got, want)), (got, want)
    unbounded = methods.get(name, **opts)
    ref = engine.generate(tiny, prompts(lengths), unbounded, max_new_tokens=steps + 1, driver="scan", stop_at_eos=False)
    assert all(st["held_bytes"] > 4 * b for st, b in zip(ref.stats, at_rounds[-1][0]))  # unbounded: 5x and growing


# ---- compiled once, in place, bucket-independent -----------------------------------------------------------------


def _copies(hlo: str, shapes) -> dict[str, list[str]]:
    """Per computation of a compiled program, the instructions that copy a buffer of one of ``shapes``, for the
    computations that do not re-compress (hold no sort or top-k)."""
    out, name, lines = {}, None, []
    for line in hlo.splitlines():
        if line.startswith(("%", "ENTRY")):
            name, lines = line.split(" ", 2)[1 if line.startswith("ENTRY") else 0], []
        elif line.startswith("}") and name:
            copies = [
                l.strip()[:160]
                for l in lines
                if " copy(" in l and any(s in l.split("=", 1)[1].split("copy(")[0] for s in shapes)
            ]
            if copies and not any("TopK" in l or " sort(" in l for l in lines):
                out[name] = copies
            name = None
        else:
            lines.append(line)
    return out


@pytest.mark.parametrize("name", ["snapkv", "chunkkv"])
def test_the_compiled_loop_updates_the_cache_in_place(tiny, name):
    """The compiled while loop holds the re-compression (a sort / top-k in a loop of at most one trip) and copies no K/V
    or position buffer ``[B, Hkv, D_l + every, ...]`` anywhere else: a step that does not re-compress writes its token
    in place (the re-compressing branch builds the new positions whole, once per ``every`` steps)."""
    cfg = tiny.config
    m = methods.get(name, budget=0.5, window=4, decode_budget=20, every=8)
    states = engine.init_states(cfg, m, 2, Capacity(32, 40), jnp.float32)
    b, h, s, d = states[0].cache.k.shape
    shapes = (f"f32[{b},{h},{s},{d}]", f"s32[{b},{h},{s}]")
    loop = engine.DecodeLoop(cfg, m, kvjax.engine.sampling.Greedy(), 16, (63,))
    args = (tiny.params, states, jnp.zeros((2,), jnp.int32), jnp.asarray([20, 30]), jax.random.PRNGKey(0))
    hlo = engine.run_loop.lower(loop, "while", *args).compile().as_text()
    assert hlo.count(shapes[0]) > 0 and ("TopK" in hlo or " sort(" in hlo)
    assert _copies(hlo, shapes) == {}


def test_scanned_layers_update_the_stack_in_place(tiny):
    """With the layers scanned (one loop body, stacked states), no copy of a stacked K/V or position buffer."""
    cfg = ModelConfig("llama", 64, 64, 96, 4, 4, 2, 16, max_position_embeddings=1024)
    m = methods.get("snapkv", budget=0.5, window=4, decode_budget=300, every=32)
    cap, b = Capacity(128, 37), 2
    states = jax.eval_shape(lambda: engine.init_states(cfg, m, b, cap, jnp.float32, scan_layers=True))
    assert [type(s) for s in states] == [engine.Stacked]
    params = jax.eval_shape(lambda: M.stack_layers(M.random_params(cfg, jax.random.PRNGKey(0))))
    loop = engine.DecodeLoop(cfg, m, kvjax.engine.sampling.Greedy(), cap.max_new_tokens, (63,))
    ints = jax.ShapeDtypeStruct((b,), jnp.int32)
    hlo = engine.run_loop.lower(loop, "while", params, states, ints, ints, jax.random.PRNGKey(0)).compile().as_text()
    L, _, h, s, d = states[0].state.cache.k.shape
    stacks = (f"f32[{L},{b},{h},{s},{d}]", f"s32[{L},{b},{h},{s}]")
    copied = [
        l for l in hlo.splitlines() if " copy(" in l and any(x in l.split("=", 1)[1].split("copy(")[0] for x in stacks)
    ]
    assert copied == [], copied[:3]


def test_scanned_layers_give_the_unrolled_tokens(tiny):
    """The same generation with the layers scanned as unrolled (a re-compression every 8 steps)."""
    m = methods.get("snapkv", budget=0.5, window=4, decode_budget=16, every=8)
    ps = prompts([40, 23])
    stacked = Model(tiny.config, M.stack_layers(tiny.params), None, "tiny-stacked")
    a = engine.generate(tiny, ps, m, max_new_tokens=40, driver="scan", stop_at_eos=False)
    b = engine.generate(stacked, ps, m, max_new_tokens=40, driver="scan", stop_at_eos=False)
    assert a.tokens == b.tokens and [s["held_bytes"] for s in a.stats] == [s["held_bytes"] for s in b.stats]


@pytest.mark.parametrize("threshold", [None, 0.1])
def test_the_bucket_is_a_shape_not_a_semantic(tiny, threshold):
    """The same prompts in buckets 64 and 256 (prefill re-compression at 256 only: its kept-prompt slots exceed the
    budget) give the same tokens and hold the same bytes, with and without a threshold."""
    m = methods.get("snapkv", budget=0.5, window=4, decode_budget=24, every=8, threshold=threshold)
    ps = prompts([40, 23])
    a = engine.generate(tiny, ps, m, max_new_tokens=30, driver="scan", stop_at_eos=False, prompt_len=64)
    b = engine.generate(tiny, ps, m, max_new_tokens=30, driver="scan", stop_at_eos=False, prompt_len=256)
    assert a.tokens == b.tokens
    assert [s["held_bytes"] for s in a.stats] == [s["held_bytes"] for s in b.stats]
    assert a.stats[0]["cache_bytes"] == b.stats[0]["cache_bytes"]  # D + every slots whatever the bucket


def test_bad_compositions():
    for name in ("h2o", "streaming_llm", "chelsea", "quest", "pqcache", "clusterkv", "full", "less"):
        with pytest.raises(ValueError, match="recompressible") as e:
            methods.get(name, decode_budget=64)
        why = methods.REGISTRY[name].why_no_decode_budget  # declared by the method, read through the registry
        assert why and str(e.value).endswith(why) and (name in why or "recall methods" in why), name
    with pytest.raises(ValueError, match="needs decode_budget"):
        methods.get("snapkv", every=8)
    with pytest.raises(ValueError, match="observation window"):
        methods.get("snapkv", window=8, decode_budget=8)
    with pytest.raises(ValueError, match="every"):
        methods.get("snapkv", decode_budget=64, every=0)
    with pytest.raises(ValueError, match="decode_budget"):
        methods.get("snapkv", decode_budget=64.0)
    with pytest.raises(ValueError, match="threshold=0.1 needs decode_budget"):
        methods.get("snapkv", threshold=0.1)
    for bad in (-0.1, float("nan"), float("inf"), True, "0.1"):
        with pytest.raises(ValueError, match="threshold"):
            methods.get("snapkv", decode_budget=64, threshold=bad)
    m = methods.get("chunkkv", budget=0.5, window=4, chunk_size=2, reuse=2, decode_budget=10)
    cfg = ModelConfig("llama", 64, 64, 96, 2, 4, 2, 16, max_position_embeddings=1024)
    with pytest.raises(ValueError, match="reuse"):
        m.init(cfg, 1, Capacity(64, 8), 0, jnp.float32)
    assert methods.get("snapkv", decode_budget=64, full_layers=1).at(0).name == "full"
    assert methods.get("snapkv", decode_budget=64, full_layers=1).at(1).decode_budget == 64


def test_a_sharded_model_gives_the_one_device_tokens():
    """On a data=2, model=2 mesh (the batch and the KV heads split, the query ring with them), the same tokens and
    held tokens as on one device, with re-compressions every 8 steps."""
    from kvjax import sharding

    cfg = ModelConfig("llama", 256, 64, 128, 2, 8, 2, 16, max_position_embeddings=512)
    model = Model(cfg, M.random_params(cfg, jax.random.PRNGKey(2), scale=0.15), None, "tiny-kv2")
    m = methods.get("snapkv", budget=0.5, window=4, decode_budget=16, every=8)
    ps = [list(np.random.RandomState(3).randint(1, 255, size=n)) for n in (40, 17, 33, 26)]
    one = engine.generate(model, ps, m, max_new_tokens=30, driver="scan", stop_at_eos=False)
    sharded = kvjax.shard(model, sharding.make_mesh("data=2,model=2"))
    got = engine.generate(sharded, ps, m, max_new_tokens=30, driver="scan", stop_at_eos=False)
    assert got.tokens == one.tokens
    assert [s["tokens_held"] for s in got.stats] == [s["tokens_held"] for s in one.stats]
