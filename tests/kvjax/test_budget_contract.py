"""The budget contract and the method interface, for every registered method (one budget contract).

- Budget arithmetic equals exact fractions (``fractions.Fraction`` of the decimal as written) over a sweep,
  including the float-tricky values (0.15, 0.3, 0.29).
- Invariant: the same prompts with ``prompt_len`` = bucket, 2x and 4x the bucket give identical kept positions,
  identical greedy tokens and identical reported tokens held (the bucket is a shape, not a semantic).
- Short prompts (1, 5, 30 tokens) work with every method at budgets 0.1..1.0 and hold no more than the contract.
- PyramidKV's per-sequence layer budgets equal the KVCache-Factory harness formula (ported in ``ref_baselines``).
- ``bytes_read_per_step`` and the bytes held are measured against what XLA compiles in ``test_measured.py``.
- Bad budgets raise a ValueError naming the option and the fix, from the Python API.
"""

from __future__ import annotations

import os
import sys
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import budget as kb
from kvjax import engine, methods
from kvjax.methods.base import Capacity, LayerContext, SlotCache
from extended import methods_params

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_baselines as ref  # noqa: E402
from methods_table import small_at_budget  # noqa: E402


def exact_tokens(b: float, n: int) -> int:
    f = Fraction(repr(b)) * n
    return max(min(n, -(-f.numerator // f.denominator)), min(1, n))


# ---------------------------------------------------------------------------------------------------------------
# arithmetic

TRICKY = [0.15, 0.3, 0.29, 0.1, 0.2, 0.7, 0.33, 0.07, 0.999, 0.5, 1.0, 0.0001]


@pytest.mark.parametrize("b", TRICKY)
def test_fraction_budgets_are_exact(b):
    ns = np.arange(0, 4097, dtype=np.int32)
    want = [exact_tokens(b, int(n)) for n in ns]
    assert [kb.budget_tokens(b, int(n)) for n in ns] == want  # host ints (static sizes)
    got = np.asarray(jax.jit(lambda n: kb.budget_tokens(b, n))(jnp.asarray(ns)))  # traced int32 (per sequence)
    np.testing.assert_array_equal(got, want)


def test_float32_trap_values():
    # 0.3f * 50 = 15.000001 -> 16 in float32; exactly 15 here. 0.29 * 100 = 28.999999999999996 in float64.
    assert kb.budget_tokens(0.3, 50) == 15 and kb.budget_tokens(0.29, 100) == 29
    assert int(kb.budget_tokens(0.3, jnp.asarray([50]))[0]) == 15
    assert kb.budget_tokens(0.15, 20) == 3 and kb.budget_tokens(0.15, 21) == 4


def test_large_lengths_do_not_overflow_int32():
    ns = np.asarray([2**20, 2**24 + 7, 2**31 - 1], np.int64)
    got = np.asarray(kb.budget_tokens(0.2999, jnp.asarray(ns, jnp.int32)))
    np.testing.assert_array_equal(got, [exact_tokens(0.2999, int(n)) for n in ns])


@pytest.mark.parametrize("p,q", [(3, 10), (1, 3), (2999, 10000), (7, 7), (0, 5), (9999, 10000)])
def test_floor_and_ceil_mul_are_exact(p, q):
    """``floor(n p / q)`` and ``ceil(n p / q)`` (Chelsea's budget and merge counts, PQCache's split, H2O's recent
    window) against Python's exact integers, on host ints and traced int32 up to ``2^31 - 1``."""
    ns = [0, 1, 2, 9, 10, 11, 29, 30, 31, 99, 100, 101, 4095, 2**20 + 3, 2**24 + 7, 2**31 - 1]
    floor, ceil = [n * p // q for n in ns], [-(-n * p // q) for n in ns]
    assert [kb.floor_mul(n, p, q) for n in ns] == floor and [kb.ceil_mul(n, p, q) for n in ns] == ceil
    arr = jnp.asarray(ns, jnp.int32)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda n: kb.floor_mul(n, p, q))(arr)), floor)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda n: kb.ceil_mul(n, p, q))(arr)), ceil)


def test_more_than_four_decimals_rounds_down():
    p, q = kb.as_fraction(0.123456)
    assert (
        q <= kb.MAX_DENOMINATOR and Fraction(p, q) <= Fraction("0.123456") and Fraction(p, q) == Fraction(1234, 10000)
    )


def test_token_budgets_are_counts():
    assert kb.budget_tokens(256, 100) == 100 and kb.budget_tokens(256, 1000) == 256
    assert kb.budget_tokens(256, 100, cap=300) == 256  # an evicting method's count covers generated tokens


@pytest.mark.parametrize("text,want", [("0.2", 0.2), ("256", 256), (" 1.0 ", 1.0), ("1", 1)])
def test_parse_budget(text, want):
    got = kb.parse_budget(text)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize(
    "b,text", [(0.2, "0.2"), (1.0, "1.0"), (1, "1"), (256, "256"), (0.125, "0.125"), (1e-4, "0.0001")]
)
def test_budget_text_tells_a_fraction_from_a_count(b, text):
    assert kb.budget_text(b) == text


def test_budgets_must_be_distinct():
    """1 == 1.0 in Python: a run keyed by budget would merge one token with the whole prompt."""
    assert kb.parse_budgets("0.2,256,1.0") == [0.2, 256, 1.0]
    with pytest.raises(ValueError, match=r"--budgets lists both 1 \(one token\) and 1.0"):
        kb.parse_budgets("1,0.5,1.0")
    with pytest.raises(ValueError, match="--budgets lists 0.2 twice"):
        kb.parse_budgets("0.2,0.2")
    with pytest.raises(ValueError, match="--budgets lists 256 twice"):
        kb.check_distinct([256, 0.5, 256])


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "abc", "1.5", "0.0", "-0.2", "", "true"])
def test_parse_budget_rejects(bad):
    with pytest.raises(ValueError, match="--budget"):
        kb.parse_budget(bad)


@pytest.mark.parametrize("name", [n for n in methods.names() if n != "full"])
@pytest.mark.parametrize("bad", [0, -1, 0.0, float("nan"), 1.5, True, "0.2", None], ids=repr)
def test_every_method_rejects_bad_budgets(name, bad):
    with pytest.raises(ValueError, match="budget"):
        methods.get(name, budget=bad)


def test_token_budget_above_the_model_context(tiny):
    with pytest.raises(ValueError, match="budget=99999 tokens exceeds the model context"):
        kvjax.generate(tiny, [[1, 2, 3]], methods.get("snapkv", budget=99999), max_new_tokens=2)


def test_public_api():
    assert kvjax.generate is engine.generate and kvjax.methods.get("h2o", budget=0.2).name == "h2o"
    assert isinstance(kvjax.methods.get("chunkkv"), kvjax.methods.Method)
    assert kvjax.engine.run_loop is engine.run_loop


# ---------------------------------------------------------------------------------------------------------------
# the bucket invariant and short prompts, every registered method


NEW = 5


def _method(name, budget):
    return small_at_budget(name, budget)


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(1, 64, n)] for n in lengths]


def _kept(states):
    """What each layer holds, in a bucket-independent form: kept positions of slot caches (LESS's sparse part
    too), occupied counts otherwise (Chelsea's cluster sizes, PQCache's stored tokens)."""
    out = []
    for st in states:
        st = getattr(st, "sparse", st)  # LESS: its sparse policy's cache
        if isinstance(st, SlotCache):
            pos = np.asarray(st.pos)
            out.append(
                [
                    [sorted(int(p) for p in pos[b, h] if p >= 0) for h in range(pos.shape[1])]
                    for b in range(pos.shape[0])
                ]
            )
        elif hasattr(st, "n"):  # Chelsea: sorted cluster counts per head
            n = np.asarray(st.n)
            out.append(
                [[sorted(float(x) for x in n[b, h] if x > 0) for h in range(n.shape[1])] for b in range(n.shape[0])]
            )
        else:
            out.append(np.asarray(st.lengths).tolist())
    return out


@pytest.mark.parametrize("name", methods_params())  # REPRESENTATIVES by default, every method in CI (extended)
@pytest.mark.parametrize("budget", [0.25, pytest.param(0.5, marks=pytest.mark.slow)])  # 0.5: KVJAX_SLOW=1
def test_same_prompts_in_any_bucket_keep_and_generate_the_same(tiny, name, budget):
    ids = _prompts((5, 30, 57))
    m = _method(name, budget)
    runs = []
    for bucket in (64, 256):  # the smallest bucket the prompts fit and one four times as large
        tokens, lengths = engine.pad_prompts(ids, bucket)
        states = engine.init_states(tiny.config, m, len(ids), Capacity(bucket, NEW), jnp.float32)
        states, _ = engine.prefill(tiny.config, m, tiny.params, jnp.asarray(tokens), jnp.asarray(lengths), states)
        res = kvjax.generate(tiny, ids, m, max_new_tokens=NEW, driver="scan", stop_at_eos=False, prompt_len=bucket)
        runs.append(
            (
                _kept(states),
                res.tokens,
                [s["tokens_held"] for s in res.stats],
                [s["tokens_held_prefill"] for s in res.stats],
                [s["held_bytes"] for s in res.stats],
            )
        )
        _check_expected_held_bytes(tiny.config, m, Capacity(bucket, NEW), [len(i) for i in ids], res.stats)
    for bucket, other in zip((256,), runs[1:]):
        assert other[0] == runs[0][0], f"kept differ at bucket {bucket}"
        assert other[1] == runs[0][1], f"greedy tokens differ at bucket {bucket}"
        assert other[2:4] == runs[0][2:4], f"tokens held differ at bucket {bucket}"
        assert other[4] == runs[0][4], f"held bytes differ at bucket {bucket}"


@pytest.mark.parametrize("name", methods_params(n for n in methods.names() if methods.get(n).recalls))
def test_recall_methods_hold_the_same_bytes_in_any_bucket(tiny, name):
    """A 177-token prompt in buckets 256 and 1024: the recall methods' index (Quest's page bounds, PQCache's codes,
    ClusterKV's centroids) is allocated for the bucket but counted for what the sequence holds
    (``Method.index_bytes``), so the held bytes are the same, and the contract's (``expected_held_bytes``); the
    allocated ``cache_bytes`` grow with the bucket. (Before, Quest held 9.03 MB at 256 and 11.09 MB at 1024 on
    SmolLM2: the page bounds of the whole bucket were counted.)"""
    ids = _prompts((177,), seed=5)
    m = _method(name, 0.25)
    held, alloc = [], []
    for bucket in (256, 1024):
        res = kvjax.generate(tiny, ids, m, max_new_tokens=3, driver="scan", stop_at_eos=False, prompt_len=bucket)
        want = engine.expected_held_bytes(tiny.config, m, Capacity(bucket, 3), jnp.float32, [177], 2)
        assert res.stats[0]["held_bytes"] == int(want[0])
        held.append(res.stats[0]["held_bytes"])
        alloc.append(res.stats[0]["cache_bytes"])
    assert held[0] == held[1] and alloc[1] > alloc[0]


def _check_expected_held_bytes(cfg, m, capacity: Capacity, lengths: list[int], stats: list[dict]):
    """What a sequence holds at the end (``stats["held_bytes"]``, measured from the state) is at most what the
    budget contract predicts from shapes (``engine.expected_held_bytes``, ``kvjax-eval --equal-bytes``), and equal
    to it where the tokens held are the contract's (every method but ChunkKV, whose chunks may keep fewer)."""
    want = engine.expected_held_bytes(cfg, m, capacity, jnp.float32, lengths, NEW - 1, batch=len(lengths))
    for n, w, st in zip(lengths, want, stats):
        held = [m.held(n, NEW - 1, LayerContext(i, cfg.num_layers, capacity, cfg)) for i in range(cfg.num_layers)]
        assert st["held_bytes"] <= w, (capacity, n, st["held_bytes"], w)
        if st["tokens_held"] == pytest.approx(np.mean(held)):
            assert st["held_bytes"] == w, (capacity, n, st["held_bytes"], w)


@pytest.mark.parametrize("name", methods_params())
def test_short_prompts_work_within_the_contract(tiny, name):
    ids = _prompts((1, 5, 30), seed=3)
    for budget in (0.1, 0.5, 1.0):  # 0.25: the bucket-invariance test above checks the same bounds
        m = _method(name, budget)
        res = kvjax.generate(tiny, ids, m, max_new_tokens=NEW, driver="scan", stop_at_eos=False)
        for n, st in zip((1, 5, 30), res.stats):
            assert all(len(t) == NEW for t in res.tokens)
            # every layer holds at most held(n, steps) per KV head; the reported mean is within it
            ctx = LayerContext(capacity=Capacity(n, NEW))  # Chelsea's B = R (n + Gamma), Gamma = NEW
            assert st["tokens_held_prefill"] <= m.held(n, 0, ctx) + 1e-6, (budget, n, st)
            assert st["tokens_held"] <= m.held(n, NEW - 1, ctx) + 1e-6, (budget, n, st)
            if methods.takes_budget(name) and not m.recalls:  # recall methods keep every token stored
                assert st["tokens_held_prefill"] <= max(exact_tokens(budget, n), 1) + 1e-6 or name == "chelsea"


# ---------------------------------------------------------------------------------------------------------------
# PyramidKV against the harness formula


@pytest.mark.parametrize("budget,window", [(0.2, 8), (0.3, 4), (64, 8), (0.05, 8), (9, 8)])
@pytest.mark.parametrize("num_layers", [4, 30])
def test_pyramid_layer_budgets_follow_the_harness(budget, window, num_layers):
    m = methods.get("pyramidkv", budget=budget, window=window, slot_multiple=1)  # exact static slots
    ns = np.arange(1, 700, dtype=np.int32)
    for layer in range(num_layers):
        got = np.asarray(m.layer_budgets(jnp.asarray(ns), layer, num_layers))
        want = []
        for n in ns:
            total = ref.sequence_budget(budget, int(n)) if isinstance(budget, float) else min(budget, int(n))
            want.append(ref.pyramid_layer_budget(total, int(n), layer, num_layers, min(window, total), 20))
        np.testing.assert_array_equal(got, want, err_msg=f"layer {layer}")
        assert m.prompt_slots(699, layer, num_layers) == max(want)
        rounded = methods.get("pyramidkv", budget=budget, window=window).prompt_slots(699, layer, num_layers)
        r = max(16, -(-int(kb.budget_tokens(budget, 699)) // 8))  # an eighth of the budget, at least 16
        assert (rounded % r == 0 or rounded == 699) and max(want) <= rounded < max(want) + r
