"""Property tests (hypothesis) of every registered method: prefill + 64 decode steps on tiny random models.

Each example draws a *static* case (batch 1-4, bucket 32/64, GQA ratio 1/2/3/4/8, head_dim 16/64/128, fp32 or
bf16, a budget from the smallest legal one to 1.0, fractions and token counts) and two *dynamic* draws on it
(prompt lengths from 1 token up to the bucket, different per sequence, and random tokens). Both draws run
``engine.prefill`` and the 64 decode steps as one compiled ``engine.run_loop``; the second must compile nothing
(``engine.TRACE_COUNTS`` and the helpers' jit caches unchanged). After prefill and after the 64 steps:

- logits are finite at every step (the loop's sampler marks a step with a non-finite logit), and so is every
  floating leaf of every layer's state;
- the budget contract: per layer and sequence, ``method.tokens_held`` and the per-KV-head count are at most
  ``method.held(n, steps)`` (exactly it where the contract is exact); the recall methods (``pqcache``,
  ``clusterkv``, ``quest``) hold ``n + steps`` and a step attends exactly ``method.attended(n, steps)`` tokens
  (``selected_positions`` plus the new token), never a position not yet written (Quest: at most ``B_b``;
  ClusterKV: at most ``B_b`` prompt-side tokens besides its unclustered window);
- ``memory_bytes`` equals the bytes the state holds (the sum of its leaves' nbytes; LESS's learned kernels are
  model weights and excluded, as documented);
- nothing beyond capacity and no write dropped: fill counts <= slot counts, every stored slot below its fill
  count, stored positions distinct and below ``n + steps``, the positions a method must keep are stored (every
  one for ``full`` and the recall methods, every decoded one for the appending methods, the recent window for
  the evicting ones), Chelsea's merged counts add up to the tokens seen.

Profiles (``KVJAX_HYPOTHESIS_PROFILE``): ``default`` (derandomized, the CI run: the method's fixed example and one
generated one; a bug only more examples found gets a fixed case of its own, as Quest's of 18dcc7d) and
``thorough`` (40 random examples per method: ``KVJAX_HYPOTHESIS_PROFILE=thorough python3 -m pytest
tests/kvjax/test_properties.py``).
``KVJAX_HYPOTHESIS_EXAMPLES=N`` overrides the examples per method, ``KVJAX_HYPOTHESIS_STATS=FILE`` writes the
examples, runs, cases and seconds per method as JSON, ``KVJAX_HYPOTHESIS_VERBOSE=1`` prints each case (with -s).
Documented in docs/interface.md#property-tests.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvjax import engine, methods
from kvjax.loading import Model
from kvjax.methods import H2O, ChunkKV, ClusterKV, Less, Quest, SnapKV, StreamingLLM
from kvjax.methods.base import Capacity, LayerContext, SlotCache
from kvjax.methods.chelsea import ChelseaState
from kvjax.methods.clusterkv import ClusterState
from kvjax.methods.less import LessState
from kvjax.methods.pqcache import PQState
from kvjax.methods.quest import QuestState
from methods_table import small, small_at_budget, small_variants
from tiny_models import tiny_model

# ---------------------------------------------------------------------------------------------------------------
# profiles

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], print_blob=True)
#: The CI run: derandomized (the same examples every run), one generated example per method besides the fixed one
#: (each example is a compile: more costs minutes of CPU the suite does not have). A bug that only more examples
#: found gets a fixed case of its own in the method's test file (Quest's fraction below one page, 18dcc7d, which the
#: 5th derandomized example found: tests/kvjax/test_quest.py's below-a-page rows and
#: test_quest_attends_at_most_its_budget).
settings.register_profile("default", max_examples=1, derandomize=True, database=None, **_COMMON)
settings.register_profile("thorough", max_examples=40, derandomize=False, **_COMMON)
PROFILE = os.environ.get("KVJAX_HYPOTHESIS_PROFILE", "default")
EXAMPLES = int(os.environ.get("KVJAX_HYPOTHESIS_EXAMPLES", "0")) or settings.get_profile(PROFILE).max_examples


VERBOSE = os.environ.get("KVJAX_HYPOTHESIS_VERBOSE") == "1"  # print each static case (with -s)
CLEAR_EVERY = 8  # examples between jax.clear_caches() in one method's test

STEPS = 64  # decode steps (run_loop with max_new_tokens = STEPS + 1 runs STEPS of them)
NEW = STEPS + 1
VOCAB = 64
NUM_LAYERS = 2

# Every method is built at its own test sizes (``methods_table.small``); its smallest legal
# count budget (``min_legal_budget``), whether it holds exactly ``held`` tokens (``holds_exactly``) and whether it
# recalls (``recalls``) are its declarations, not tables here.


# ---------------------------------------------------------------------------------------------------------------
# static cases (each distinct one compiles prefill + the decode loop) and dynamic draws


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    batch: int
    bucket: int
    ratio: int  # query heads per KV head
    kv_heads: int
    head_dim: int
    dtype: str
    budget: float | int
    options: tuple = ()  # extra static options, e.g. LESS's policy

    def method(self):
        return small_at_budget(self.name, self.budget, **dict(self.options))


def budgets(name: str, bucket: int):
    """Fractions from the smallest legal one (1/10000: one token) to 1.0, and counts from the smallest legal
    one to beyond the bucket + decode steps."""
    low = small(name).min_legal_budget()
    frac = st.one_of(
        st.sampled_from([0.0001, 0.1, 0.25, 0.3, 0.5, 1.0]), st.integers(1, 10_000).map(lambda i: i / 10_000)
    )
    count = st.one_of(
        st.sampled_from([low, low + 1, bucket // 2, bucket, bucket + NEW + 7]), st.integers(low, bucket + NEW)
    )
    return st.one_of(frac, count)


def cases(name: str):
    """A static case: the method's fixed case (:func:`explicit`) one time in ten, and as the simplest draw (so
    hypothesis's first, minimal example runs it with 1-token prompts and compiles nothing new for the explicit
    example), else any case."""
    return st.integers(0, 9).flatmap(lambda i: st.just(explicit(name)[0]) if i == 0 else any_case(name))


@st.composite
def any_case(draw, name: str):
    ratio = draw(st.sampled_from([1, 2, 3, 4, 8]))
    kv_heads = draw(st.sampled_from([1, 2])) if ratio <= 4 else 1
    bucket = draw(st.sampled_from([32, 64]))
    return Case(
        name,
        batch=draw(st.integers(1, 4)),
        bucket=bucket,
        ratio=ratio,
        kv_heads=kv_heads,
        head_dim=draw(st.sampled_from([16, 64, 128])),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        budget=draw(budgets(name, bucket)) if methods.takes_budget(name) else 0,
        options=draw(options(name)),
    )


def options(name: str):
    """Static options varied per method: its ``small_variants`` (tests/methods_table.py; each value compiles)."""
    return st.sampled_from([tuple(v.items()) for v in small_variants(name)])


#: A dynamic draw: up to 4 prompt lengths (clipped to the bucket, the first ``batch`` used; 1 and the bucket
#: often) and the token seed.
DRAW = st.tuples(
    st.lists(st.one_of(st.sampled_from([1, 64]), st.integers(1, 64)), min_size=4, max_size=4), st.integers(0, 2**16)
)


def lengths_of(case: Case, draw) -> list[int]:
    return [min(n, case.bucket) for n in draw[0][: case.batch]]


def explicit(name: str):
    """The fixed example every profile runs for this method: large batches, GQA, bf16, mid and extreme budgets,
    rotated over the methods so that the default profile covers every dimension; two draws of varied lengths."""
    i = methods.names().index(name)
    low = small(name).min_legal_budget()
    table = [
        dict(batch=4, bucket=32, ratio=3, kv_heads=2, head_dim=64, dtype="bfloat16", budget=0.3),
        dict(batch=3, bucket=32, ratio=8, kv_heads=1, head_dim=128, dtype="float32", budget=max(low, 12)),
        dict(batch=4, bucket=64, ratio=2, kv_heads=2, head_dim=16, dtype="bfloat16", budget=64 + NEW + 7),
        dict(batch=2, bucket=32, ratio=4, kv_heads=1, head_dim=64, dtype="bfloat16", budget=1.0),
        dict(batch=4, bucket=32, ratio=1, kv_heads=2, head_dim=16, dtype="float32", budget=low),
    ]
    row = dict(table[i % len(table)])
    row["budget"] = row["budget"] if methods.takes_budget(name) else 0
    case = Case(name, **row, options=tuple(small_variants(name)[0].items()))
    draws = [([1, 64, 17, 40], 1), ([64, 3, 33, 64], 2)]
    return case, draws


@functools.lru_cache(maxsize=None)
def tiny(ratio: int, kv_heads: int, head_dim: int, dtype: str) -> Model:
    return tiny_model(
        vocab_size=VOCAB,
        num_layers=NUM_LAYERS,
        num_heads=ratio * kv_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=256,
        seed=ratio * 1000 + kv_heads * 100 + head_dim,
        dtype=dtype,
    )


@dataclasses.dataclass(frozen=True)
class FiniteGreedy:
    """Greedy sampling that returns -1 for a sequence whose logits hold a NaN or an inf (static under jit)."""

    def __call__(self, logits, key):
        ok = jnp.all(jnp.isfinite(logits), axis=-1)
        return jnp.where(ok, jnp.argmax(logits, axis=-1), -1).astype(jnp.int32)


_selected = jax.jit(lambda m, layer, st, q: m.selected_positions(st, layer, q), static_argnums=(0, 1))


# ---------------------------------------------------------------------------------------------------------------
# one run and its checks


def run(case: Case, m, lens: list[int], seed: int):
    """Prefill + STEPS decode steps; returns host copies of the states after prefill and after the loop, and
    the checks' inputs."""
    model = tiny(case.ratio, case.kv_heads, case.head_dim, case.dtype)
    cfg = model.config
    rng = np.random.default_rng(seed)
    ids = [[int(x) for x in rng.integers(1, VOCAB, n)] for n in lens]
    tokens, lengths = engine.pad_prompts(ids, case.bucket)
    states = engine.init_states(cfg, m, case.batch, Capacity(case.bucket, NEW), model.dtype)
    states, logits = engine.prefill(cfg, m, model.params, jnp.asarray(tokens), jnp.asarray(lengths), states)
    assert np.isfinite(np.asarray(logits, np.float32)).all(), "prefill logits are not finite"
    q = jnp.asarray(rng.standard_normal((case.batch, cfg.num_heads, cfg.head_dim)), model.dtype)
    after_prefill = snapshot(m, states, q)
    loop = engine.DecodeLoop(cfg, m, FiniteGreedy(), NEW, ())
    first = FiniteGreedy()(logits, None)
    out, steps, states = engine.run_loop(
        loop, "scan", model.params, states, first, jnp.asarray(lengths), jax.random.PRNGKey(seed)
    )
    assert int(steps) == NEW
    out = np.asarray(out)
    assert (out >= 0).all(), f"non-finite logits at decode steps {sorted(set(np.nonzero(out < 0)[1].tolist()))}"
    after_loop = snapshot(m, states, q)
    return cfg, after_prefill, after_loop


def snapshot(m, states, q):
    """Per layer: (host copy of the state, tokens_held [B], memory_bytes, selected positions or None)."""
    out = []
    for layer, (lm, st_) in enumerate(engine.layer_methods(m, states)):  # lm: the layer's method (m.at(layer))
        sel = None
        if m.recalls:  # a recall method's full layers run full, whose selection is every stored position
            sel = np.asarray(_selected(lm, layer, st_, q))
        out.append((jax.tree.map(np.asarray, st_), np.asarray(lm.tokens_held(st_)), lm.memory_bytes(st_), sel))
    return out


def check(case: Case, m, cfg, snap, lens: list[int], steps: int):
    for layer, (state, tokens_held, mem, sel) in enumerate(snap):
        where = f"layer {layer}, {steps} steps"
        # finite state
        for leaf in jax.tree.leaves(state):
            if np.issubdtype(leaf.dtype, np.floating) or leaf.dtype == jnp.bfloat16:
                assert np.isfinite(leaf.astype(np.float32)).all(), f"non-finite state leaf ({where})"
        # memory_bytes: every leaf (LESS: its learned kernels are model weights, not cache)
        leaves = (
            (jax.tree.leaves(state.sparse) + [state.H, state.z])
            if isinstance(state, LessState)
            else jax.tree.leaves(state)
        )
        assert mem == sum(np.asarray(x).nbytes for x in leaves), where
        for b, n in enumerate(lens):
            limit = m.held(n, steps, LayerContext(layer, NUM_LAYERS, Capacity(n, NEW)))
            per_head = per_head_held(state, b)
            got = float(tokens_held[b])
            assert got <= limit + 1e-6 and per_head.max() <= limit, (where, b, n, got, per_head, limit)
            if m.holds_exactly:
                assert got == limit and (per_head == limit).all(), (where, b, n, got, per_head, limit)
            check_stored(case, m, state, b, n, steps, where)
            if sel is not None and not isinstance(state, SlotCache):  # recall: what a step attends
                att = sel[b].sum(axis=-1)  # [Hq]
                want = m.attended(n, steps, LayerContext(layer, NUM_LAYERS, Capacity(n, NEW)))
                assert (att + 1 == want).all(), (where, b, n, att, want)
                if isinstance(m, Quest):  # at most B_b tokens (below a page: the current page cut to B_b)
                    assert want <= m.token_budget(n), (where, b, n, want)
                if isinstance(m, ClusterKV):  # B_b prompt-side tokens, sinks included, plus the window
                    sinks, bsel = m.split(n, NEW)
                    assert want - (steps % m.window) - 1 <= sinks + bsel, (where, b, n, want)
                assert not sel[b][:, n + steps :].any(), (where, b, "selects a position not yet written")


def per_head_held(state, b: int) -> np.ndarray:
    """Tokens each KV head of sequence ``b`` holds."""
    if isinstance(state, LessState):
        state = state.sparse
    if isinstance(state, (SlotCache, ClusterState)):
        return (state.pos[b] >= 0).sum(-1)
    if isinstance(state, ChelseaState):
        comp = (state.n[b] > 0).sum(-1)
        return np.concatenate([comp, np.full(state.ko.shape[1], state.seen[b])])
    return np.full(state.k.shape[1], state.filled[b])  # PQState, QuestState: every token stored


def check_stored(case: Case, m, state, b: int, n: int, steps: int, where: str):
    """Capacity and stored positions of sequence ``b``."""
    total = n + steps
    inner = m.sparse if isinstance(m, Less) else m  # LESS: its eviction policy's slots
    if isinstance(state, LessState):
        state = state.sparse
    if isinstance(state, SlotCache):
        s = state.pos.shape[-1]
        length = int(state.length[b])
        assert 0 <= length <= s and 0 <= int(state.limit[b]) <= s, (where, b, length, int(state.limit[b]), s)
        for h in range(state.pos.shape[1]):
            pos = state.pos[b, h]
            live = pos >= 0
            assert not live[length:].any(), (where, b, h, "a stored slot beyond the fill count")
            p = pos[live]
            assert len(set(p.tolist())) == len(p) and (p < total).all(), (where, b, h, sorted(p))
            stored = set(p.tolist())
            if inner.budget is None or m.recalls:  # full; recall methods' full layers (n_full) are Full's
                assert stored == set(range(total)), (where, b, h)
            elif isinstance(inner, (SnapKV, ChunkKV)):  # prompt compressed once (PyramidKV is a SnapKV)
                assert set(range(n, total)) <= stored, (where, b, h, "a decoded token was dropped")
                assert all(x < n for x in stored - set(range(n, total)))
            elif isinstance(inner, StreamingLLM):
                budget = int(state.limit[b])
                sk = inner.sinks_for(budget)
                want = (
                    set(range(total)) if total <= budget else set(range(sk)) | set(range(total - (budget - sk), total))
                )
                assert stored == want, (where, b, h, sorted(stored), sorted(want))
            elif isinstance(inner, H2O):
                recent = inner.recent_tokens(int(state.limit[b]))
                assert set(range(max(total - recent, 0), total)) <= stored, (where, b, h, "recent window")
    elif isinstance(state, ChelseaState):
        s = state.n.shape[-1]
        length = int(state.length[b])
        assert 0 <= length <= s and int(state.seen[b]) == total, (where, b, length, s)
        for h in range(state.n.shape[1]):
            cnt = state.n[b, h]
            assert (cnt[:length] > 0).all() and not cnt[length:].any(), (where, b, h, "occupied slots")
            assert cnt.sum() == total, (where, b, h, "merged counts do not add up to the tokens seen")
    elif isinstance(state, ClusterState):
        s = state.pos.shape[-1]
        assert int(state.filled[b]) == total <= s, (where, b)
        assert int(state.clustered[b]) <= total, (where, b)
        for h in range(state.pos.shape[1]):
            pos = state.pos[b, h]
            assert sorted(pos[pos >= 0].tolist()) == list(range(total)), (where, b, h, "positions stored once")
            assert not (pos[total:] >= 0).any(), (where, b, h)
            sizes = state.csize[b, h]
            assert sizes.sum() == int(state.clustered[b]) - int(state.sinks[b]), (where, b, h, "cluster sizes")
    elif isinstance(state, (PQState, QuestState)):
        assert int(state.filled[b]) == total <= state.k.shape[2], (where, b)
        assert int(state.lengths[b]) == n, (where, b)
    else:  # pragma: no cover
        raise AssertionError(f"no capacity check for {type(state).__name__}")


# ---------------------------------------------------------------------------------------------------------------
# the property test, one per method


#: Per method: examples, runs (prefill + STEPS steps) and seconds; written as JSON to $KVJAX_HYPOTHESIS_STATS.
STATS: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _write_stats():
    yield
    path = os.environ.get("KVJAX_HYPOTHESIS_STATS")
    if path:
        with open(path, "w") as f:
            json.dump({"profile": PROFILE, "examples_per_method": EXAMPLES, "methods": STATS}, f, indent=1)


@pytest.mark.parametrize("name", methods.names())
def test_method_properties(name):
    seen: dict = {}
    stats = STATS.setdefault(name, {"examples": 0, "runs": 0, "cases": [], "seconds": 0.0, "cpu_seconds": 0.0})
    t0, c0 = time.perf_counter(), time.process_time()

    @settings(settings.get_profile(PROFILE), max_examples=EXAMPLES)
    @given(case=cases(name), draws=st.lists(DRAW, min_size=2, max_size=2))
    @example(*explicit(name))
    def prop(case, draws):
        m = case.method()
        stats["examples"] += 1
        stats["cases"].append(dataclasses.astuple(case)[1:])
        if VERBOSE:
            print(f"\n{case}", flush=True)
        if stats["examples"] % CLEAR_EVERY == 0:  # free compiled programs (see conftest: vm.max_map_count)
            jax.clear_caches()
            seen.clear()
        for i, draw in enumerate(draws):  # the second draw: same static shapes, other lengths and tokens
            lens = lengths_of(case, draw)
            before = dict(engine.TRACE_COUNTS), _selected._cache_size()
            cfg, after_prefill, after_loop = run(case, m, lens, draw[1])
            if i or case in seen:
                assert (dict(engine.TRACE_COUNTS), _selected._cache_size()) == before, "retraced"
            seen[case] = True
            stats["runs"] += 1
            check(case, m, cfg, after_prefill, lens, 0)
            check(case, m, cfg, after_loop, lens, STEPS)

    try:
        prop()
    finally:
        stats["seconds"] += time.perf_counter() - t0
        stats["cpu_seconds"] += time.process_time() - c0


# ---------------------------------------------------------------------------------------------------------------
# regressions of examples the properties found


def test_quest_attends_at_most_its_budget():
    """Found by the recall property: a fraction whose ``B_b = ceil(b n)`` is below one page attended the whole
    current page (up to ``page_size`` tokens), more than ``B_b``, e.g. ``budget=0.1, page_size=4``: ``n = 5`` gives
    ``B_b = 1`` and the first step attended 2 tokens (3 at ``n = 2``). By the budget contract the method shrinks
    instead: below one page the current page is cut to its most recent ``min(B_b, t mod page_size + 1)`` tokens,
    so every step attends at most ``B_b`` (and at least the new token)."""
    m = methods.get("quest", budget=0.1, page_size=4, n_full=0)
    assert m.token_budget(5) == 1 and m.attended(5, 0) == 1 and m.attended(2, 0) == 1
    for budget in (0.0001, 0.1, 0.25, 0.5, 1.0, 4, 5, 9, 64):
        q = methods.get("quest", budget=budget, page_size=4, n_full=0)
        for n in range(1, 80):
            bb = q.token_budget(n)
            for s in range(0, 70, 3):
                att = q.attended(n, s)
                assert 1 <= att <= min(n + s + 1, bb), (budget, n, s, att)
