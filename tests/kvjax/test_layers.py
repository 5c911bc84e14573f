"""Per-layer plans as composition (``kvjax.methods.plans.layers.FullFirst``, ``methods.get(..., full_layers=N)``,
``Hybrid``, ``Method.at``): the references are ``full`` itself and the same per-layer methods listed by hand. A
plan is not a method (nothing on it takes a state); its full layers hold and read what ``full`` does and give its
outputs; a plan whose every layer is full gives full's greedy tokens; a plan's generation is that of its layers'
methods listed by hand; unrolled and scanned engines agree; the layer plan never mixes the full layers into the
inner method's scanned run; and the misuses say how to fix them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import engine, methods, model as M
from kvjax.engine.core import LayerPlan
from kvjax.methods.base import Capacity, Method
from kvjax.methods.plans.hybrid import Hybrid, Window
from kvjax.methods.plans.layers import FullFirst, PerLayerPlan, method_of
from methods_table import small_options, small_variants

LAYERS = 4


# the sizes and weights of the tiny fixture's model (tests/conftest.py)
pytestmark = pytest.mark.tiny(
    vocab_size=256, intermediate_size=128, num_layers=LAYERS, max_position_embeddings=512, scale=0.15
)


def prompts():
    rng = np.random.RandomState(3)
    return [list(rng.randint(1, 255, size=n)) for n in (45, 21)]


def _layer_held(model, method, ids, scan=False):
    """(tokens held per layer ``[L, B]``, bytes read per layer) after prefill."""
    cfg, b = model.config, len(ids)
    cap = Capacity(64, 4)
    lengths = jnp.asarray([len(x) for x in ids], jnp.int32)
    tokens = jnp.asarray([x + [0] * (64 - len(x)) for x in ids], jnp.int32)
    params = M.stack_layers(model.params) if scan else model.params
    states = engine.init_states(cfg, method, b, cap, jnp.float32, scan_layers=scan)
    states, logits = engine.prefill(cfg, method, params, tokens, lengths, states)
    per = engine.layer_methods(method, states)
    held = np.stack([np.asarray(m.tokens_held(s)) for m, s in per])
    read = [m.bytes_read_per_step(s, cfg.num_heads) for m, s in per]
    return held, read, np.asarray(logits)


def _small(name):
    """``name``'s test-size options with its first declared variant (ChunkKV: index reuse, so layer 1 follows 0)."""
    return {**small_options(name), **small_variants(name)[0]}


@pytest.mark.parametrize("name", ["snapkv", "h2o", "chunkkv", "streaming_llm"])
def test_full_layers_hold_and_read_what_full_does(tiny, name):
    opts = _small(name)
    plan = methods.get(name, budget=0.25, full_layers=2, **opts)
    assert isinstance(plan, FullFirst) and method_of(plan).name == name and method_of(plan).budget == 0.25
    assert plan.at(0) == plan.at(1) == methods.get("full") and plan.at(2) == methods.get(name, budget=0.25, **opts)
    ids = prompts()
    held, read, _ = _layer_held(tiny, plan, ids)
    full_held, full_read, _ = _layer_held(tiny, methods.get("full"), ids)
    inner_held, inner_read, _ = _layer_held(tiny, methods.get(name, budget=0.25, **opts), ids)
    np.testing.assert_array_equal(held[:2], full_held[:2])  # the first two layers hold every prompt token
    assert read[:2] == full_read[:2]
    np.testing.assert_array_equal(held[2:], inner_held[2:])  # the others what the method alone holds there
    assert read[2:] == inner_read[2:]
    assert np.all(held[2:] < full_held[2:]) and all(r < f for r, f in zip(read[2:], full_read[2:]))  # compressed


def test_every_layer_full_is_full(tiny):
    """``full_layers`` = the depth: the greedy tokens, tokens held and bytes are full's (a budget that compresses
    every layer of the inner method otherwise), unrolled and scanned."""
    ids = prompts()
    want = kvjax.generate(tiny, ids, methods.get("full"), max_new_tokens=6, driver="scan", stop_at_eos=False)
    plan = methods.get("snapkv", budget=0.2, full_layers=LAYERS)
    got = kvjax.generate(tiny, ids, plan, max_new_tokens=6, driver="scan", stop_at_eos=False)
    assert got.tokens == want.tokens
    assert [s["tokens_held"] for s in got.stats] == [s["tokens_held"] for s in want.stats]
    inner = kvjax.generate(tiny, ids, methods.get("snapkv", budget=0.2), max_new_tokens=6, stop_at_eos=False)
    assert inner.stats[0]["tokens_held"] < want.stats[0]["tokens_held"]


@pytest.mark.parametrize("name", ["snapkv", "chunkkv"])
def test_scanned_equals_unrolled_and_the_plan_splits_at_the_full_layers(tiny, name):
    opts = _small(name)
    n = 2 if methods.REGISTRY[name].reuses_previous_layer else 1  # chunkkv's layer 1 follows layer 0
    plan = methods.get(name, budget=0.25, full_layers=n, **opts)
    runs = engine.scan_runs(tiny.config, plan, 2, Capacity(64, 4), jnp.float32)
    assert [(r.start, r.stop) for r in runs] == [(0, n), (n, LAYERS)]
    ids = prompts()
    held_u, read_u, logits_u = _layer_held(tiny, plan, ids)
    held_s, read_s, logits_s = _layer_held(tiny, plan, ids, scan=True)
    np.testing.assert_array_equal(held_u, held_s)
    assert read_u == read_s
    np.testing.assert_allclose(logits_u, logits_s, atol=1e-5)


@pytest.mark.parametrize(
    "name,opts",  # ClusterKV in CI's second line (tests/extended.py)
    [
        ("quest", dict(page_size=4)),
        pytest.param(
            "clusterkv", dict(sink=2, tokens_per_cluster=4, window=2, window_clusters=1), marks=pytest.mark.extended
        ),
    ],
)
def test_recall_methods_n_full_is_the_same_plan(tiny, name, opts):
    """ClusterKV's and Quest's ``n_full`` answer ``at`` as ``FullFirst`` does: the same tokens through ``generate``."""
    ids = prompts()
    own = methods.get(name, budget=0.3, n_full=2, **opts)
    composed = methods.get(name, budget=0.3, n_full=0, full_layers=2, **opts)
    a = kvjax.generate(tiny, ids, own, max_new_tokens=5, driver="scan", stop_at_eos=False)
    b = kvjax.generate(tiny, ids, composed, max_new_tokens=5, driver="scan", stop_at_eos=False)
    assert a.tokens == b.tokens, name
    assert [s["tokens_held"] for s in a.stats] == [s["tokens_held"] for s in b.stats]


def test_misuse_says_how_to_fix_it(tiny):
    plan = methods.get("snapkv", budget=0.25, full_layers=1)
    with pytest.raises(TypeError, match="static int layer"):
        jax.jit(lambda l: plan.at(l).decode)(0)
    with pytest.raises(ValueError, match="neither a kvjax method nor a per-layer plan"):
        method_of("snapkv")
    with pytest.raises(ValueError, match="inner must be a kvjax method"):
        FullFirst(1, "snapkv")
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="full_layers"):
            methods.get("snapkv", budget=0.25, full_layers=bad)
    with pytest.raises(ValueError, match="full_layers a multiple of its reuse"):
        methods.get("chunkkv", budget=0.25, reuse=2, full_layers=1)


def _plans():
    snap = methods.get("snapkv", budget=0.25, **_small("snapkv"))
    return snap, [
        FullFirst(2, snap),
        Hybrid((8, None, 8, None), snap),
        Hybrid((8, None, None, None), FullFirst(2, snap)),
    ]


#: What takes a layer's state, or a layer, on a :class:`Method`: a plan offers none of it.
STATEFUL = [
    name for name in dir(Method) if not name.startswith("_") and callable(getattr(Method, name)) and name != "at"
]


def test_a_plan_is_not_a_method_and_takes_no_state():
    """A plan answers ``at`` (and its own fields); nothing on it takes a state or a layer, so nothing can call it and
    get a TypeError back. What names it is its inner method's, through nested plans; it compares and hashes by its
    typed fields, as a method does (a static ``jit`` argument)."""
    snap, plans = _plans()
    assert {"init", "prefill", "decode", "tokens_held", "memory_bytes", "held", "state_axes"} <= set(STATEFUL)
    for plan in plans:
        assert isinstance(plan, PerLayerPlan) and not isinstance(plan, Method)
        assert [name for name in STATEFUL if hasattr(plan, name)] == [], type(plan).__name__
        assert not hasattr(plan, "name") and not hasattr(plan, "budget") and not hasattr(plan, "recalls")
        assert method_of(plan) is snap and method_of(snap) is snap
        assert all(isinstance(plan.at(layer), Method) for layer in range(LAYERS))
    assert [plans[0].at(l) for l in range(LAYERS)] == [methods.Full()] * 2 + [snap] * 2
    assert [plans[1].at(l) for l in range(LAYERS)] == [Window(8), snap, Window(8), snap]
    assert [plans[2].at(l) for l in range(LAYERS)] == [Window(8), methods.Full(), snap, snap]
    one, other = methods.get("snapkv", budget=1, full_layers=2), methods.get("snapkv", budget=1.0, full_layers=2)
    assert one == methods.get("snapkv", budget=1, full_layers=2) and hash(one) == hash(
        FullFirst(2, methods.get("snapkv", budget=1))
    )
    assert one != other and one != one.inner and len({one, other, one.inner}) == 3


def test_as_run_normalises_a_method_once():
    """``engine.as_run``: a name (None: ``full``), a method, a per-layer plan or a :class:`LayerPlan` become the one
    form the layer core runs on the model (a hybrid model's :class:`Hybrid`), and normalising it again changes
    nothing."""
    flat = kvjax.ModelConfig("llama", 64, 32, 48, LAYERS, 4, 2, 8)
    hybrid = kvjax.ModelConfig("llama", 64, 32, 48, LAYERS, 4, 2, 8, sliding_windows=(8, None, 8, None))
    snap = methods.get("snapkv", budget=0.25)
    assert engine.as_run(flat, None) == methods.Full() and engine.as_run(flat, "snapkv") == methods.get("snapkv")
    assert engine.as_run(flat, snap) is snap and engine.as_run(flat, engine.plan(flat, snap)) is snap
    run = engine.as_run(hybrid, snap)
    assert run == Hybrid((8, None, 8, None), snap) and engine.as_run(hybrid, run) is run


def _greedy_by_hand(model, layers, ids, steps):
    """Greedy tokens, tokens held and bytes read per step of ``layers`` (one method per layer, listed by hand, no
    plan's ``at``): the engine's prefill and decode steps over a :class:`LayerPlan` built from the list."""
    cfg = model.config
    by_hand = LayerPlan(layers[-1], tuple(layers), tuple(cfg.sliding_windows))
    cap = Capacity(64, steps)
    lengths = jnp.asarray([len(x) for x in ids], jnp.int32)
    tokens = jnp.asarray([x + [0] * (64 - len(x)) for x in ids], jnp.int32)
    states = engine.init_states(cfg, by_hand, len(ids), cap, jnp.float32)
    states, logits = engine.prefill(cfg, by_hand, model.params, tokens, lengths, states)
    out, pos = [], lengths
    for step in range(steps):
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out.append(np.asarray(token))
        if step + 1 < steps:
            logits, states = engine.decode_step(cfg, by_hand, model.params, states, token, pos)
            pos = pos + 1
    read = engine.bytes_read_per_step(by_hand, states, cfg.num_heads) // len(ids)
    return np.stack(out, axis=1).tolist(), engine.tokens_held(by_hand, states).tolist(), read


@pytest.mark.parametrize("name,opts,n_full", [("snapkv", {}, 2), ("quest", dict(page_size=4, n_full=0), 1)])
def test_a_plan_generates_what_its_layers_by_hand_do(tiny, name, opts, n_full):
    """``methods.get(name, ..., full_layers=N)`` through ``generate`` gives the greedy tokens and the tokens held of
    ``full`` on the first ``N`` layers and the method on the others, run from that list of methods; and its stats
    are the inner method's name and what those layers hold and read."""
    ids, steps = prompts(), 5
    inner = methods.get(name, budget=0.45, **{**_small(name), **opts})
    plan = methods.get(name, budget=0.45, full_layers=n_full, **{**_small(name), **opts})
    got = kvjax.generate(tiny, ids, plan, max_new_tokens=steps, driver="scan", stop_at_eos=False)
    want, held, read = _greedy_by_hand(tiny, [methods.Full()] * n_full + [inner] * (LAYERS - n_full), ids, steps)
    assert got.tokens == want
    assert [s["tokens_held"] for s in got.stats] == held
    assert all(s["method"] == name and s["bytes_read_per_step"] == read for s in got.stats)
    alone = kvjax.generate(tiny, ids, inner, max_new_tokens=steps, driver="scan", stop_at_eos=False)
    assert alone.stats[0]["bytes_read_per_step"] < read  # the full layers read more: the plan was not ignored


@pytest.mark.parametrize("name", ["clusterkv", "quest"])
def test_a_method_with_its_own_full_layers_gives_them_to_full_and_refuses_them(name):
    """ClusterKV and Quest (``FullFirstLayers``): ``at`` is ``full`` below ``n_full`` and the method above it, and the
    method's own ``init`` on one of those layers is refused with the fix; above them it builds its state."""
    cfg = kvjax.ModelConfig("llama", 64, 32, 48, 4, 4, 2, 8)
    m = methods.get(name, budget=0.25, n_full=1)
    assert m.at(0) == methods.get("full") and m.at(1) is m and m.at(3) is m
    with pytest.raises(ValueError, match=r"n_full=1 full layers: build and run it with method.at\(0\)"):
        m.init(cfg, 2, Capacity(64, 4), 0, jnp.float32)
    assert (
        type(m.init(cfg, 2, Capacity(64, 4), 1, jnp.float32)).__name__
        == {"clusterkv": "ClusterState", "quest": "QuestState"}[name]
    )
