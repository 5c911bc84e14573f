"""The GPU/TPU prompt pass of H2O and LESS (``select.accumulated_attention`` with ``path="bands"``:
``kernels_pallas.accumulated_attention``'s XLA path), forced on CPU: against NumPy (``np_causal``,
``np_accumulated``, ``ref_baselines.accumulated_attention``) and against the CPU's tiled path, with several bands and
row blocks (a last block running past its band), ragged lengths (an empty and a 1-token sequence), NaN/inf in the
padding, GQA groups, bf16 inputs; H2O's and LESS's kept tokens and outputs the same on both paths; and the loop
census of H2O's and LESS's prefill traced for a GPU at 32k tokens, batch 8."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

import kernels_pallas.accumulated_attention as aa
from kernels_pallas.accumulated_attention import reference as aa_ref
from kvjax import methods
from kvjax.config import ModelConfig
from kvjax.methods.core import select
from kvjax.methods.base import Capacity

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_baselines as ref  # noqa: E402
import test_baselines as tb  # noqa: E402
from test_causal_attention import np_accumulated, np_causal  # noqa: E402


def garbage_inputs(lengths, hq, hkv, t, d=8, seed=0, dtype=np.float32):
    """q, k, v with NaN / inf / NaN past each length, and their clean copies (zeros there) for NumPy."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((len(lengths), hq, t, d)).astype(np.float32)
    k = rng.standard_normal((len(lengths), hkv, t, d)).astype(np.float32)
    v = rng.standard_normal((len(lengths), hkv, t, d)).astype(np.float32)
    q, k, v = (np.array(jnp.asarray(x, dtype), np.float32) for x in (q, k, v))  # representable in dtype
    clean = tuple(x.copy() for x in (q, k, v))
    for b, n in enumerate(lengths):
        for x in clean:
            x[b, :, n:] = 0
        q[b, :, n:], k[b, :, n:], v[b, :, n:] = np.nan, np.inf, np.nan
    return (q, k, v), clean


CASES = [  # (lengths, Hq, Hkv, T, rows, bands)
    ((45, 30, 1, 0), 4, 2, 45, 4, 3),  # GQA 2, 3 bands of 15 rows in blocks of 4 (the last block runs past its band)
    ((45, 30, 1, 0), 4, 2, 45, None, None),  # one band, one block: straight-line, no loop
    ((40, 17), 6, 2, 40, 7, 5),  # GQA 3
    ((33, 33), 2, 2, 33, 1, 4),  # MHA, one row per block
    ((37,), 8, 1, 37, 16, 2),  # one KV head for 8 query heads
]


@pytest.mark.parametrize("lengths,hq,hkv,t,rows,bands", CASES)
def test_bands_match_numpy(lengths, hq, hkv, t, rows, bands):
    (q, k, v), (cq, ck, cv) = garbage_inputs(lengths, hq, hkv, t, seed=t)
    lengths = np.asarray(lengths, np.int32)
    fn = jax.jit(lambda *a: aa.accumulated_attention(*a, impl="xla", rows=rows, bands=bands))
    out, acc = fn(q, k, v, lengths)
    _, acc_only = jax.jit(lambda q, k, n: aa.accumulated_attention(q, k, None, n, impl="xla", rows=rows, bands=bands))(
        q, k, lengths
    )
    want = np_accumulated(cq, ck, lengths)
    np.testing.assert_allclose(np.asarray(acc), want, atol=1e-6, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(acc_only), np.asarray(acc))
    np.testing.assert_allclose(np.asarray(out), np_causal(cq, ck, cv, lengths, None), atol=1e-5, rtol=1e-5)
    assert out.dtype == jnp.float32 and np.isfinite(np.asarray(out)).all()  # padded rows: exactly 0
    for b, n in enumerate(lengths):
        assert not np.asarray(out)[b, :, n:].any() and not np.asarray(acc)[b, :, n:].any()
        for h in range(hkv):  # the per-head float64 reference of the H2O tests, too
            if n:
                r = ref.accumulated_attention(cq[b, :, :n], ck[b, :, :n], n)[h]
                np.testing.assert_allclose(np.asarray(acc)[b, h, :n], r, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [None, 4])
def test_bands_equal_the_cpu_tiles(dtype, rows, monkeypatch):
    """``select.accumulated_attention`` forced to ``bands`` (several bands: ``MIN_BAND`` lowered) against the CPU's
    ``tiles``: the same output (in q's dtype) and scores to float32 rounding; ``accumulated_scores`` alike."""
    monkeypatch.setattr(aa_ref, "MIN_BAND", 8)
    lengths = (45, 30, 1)
    (q, k, v), _ = garbage_inputs(lengths, 4, 2, 45, seed=5, dtype=np.float32 if dtype == "float32" else jnp.bfloat16)
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    n = jnp.asarray(lengths, jnp.int32)
    tiles = jax.jit(lambda *a: select.accumulated_attention(*a, 16, 4, path="tiles"))(q, k, v, n)
    bands = jax.jit(lambda *a: select.accumulated_attention(*a, rows=rows, path="bands"))(q, k, v, n)
    assert bands[0].dtype == q.dtype
    tol = 1e-6 if dtype == "float32" else 1e-2  # bf16: the output's own rounding (p is cast to bf16 for P v)
    for b, m in enumerate(lengths):
        np.testing.assert_allclose(
            np.asarray(bands[0][b, :, :m], np.float32), np.asarray(tiles[0][b, :, :m], np.float32), atol=tol, rtol=tol
        )
    np.testing.assert_allclose(np.asarray(bands[1]), np.asarray(tiles[1]), atol=1e-6, rtol=1e-5)
    scores = jax.jit(lambda q, k, n: select.accumulated_scores(q, k, n, path="bands"))(q, k, n)
    np.testing.assert_allclose(np.asarray(scores), np.asarray(tiles[1]), atol=1e-6, rtol=1e-5)


def test_the_path_is_chosen_by_backend_and_forced_by_the_variable(monkeypatch):
    monkeypatch.delenv(select.ENV_PROMPT_PASS, raising=False)
    assert select.prompt_pass_method() == "tiles"  # this CPU
    monkeypatch.setattr(select.attention, "one_pass", lambda: True)  # as on a GPU/TPU
    assert select.prompt_pass_method() == "bands"
    monkeypatch.setenv(select.ENV_PROMPT_PASS, "tiles")
    assert select.prompt_pass_method() == "tiles" and select.prompt_pass_method("bands") == "bands"
    monkeypatch.setenv(select.ENV_PROMPT_PASS, "rows")
    with pytest.raises(ValueError, match="KVJAX_PROMPT_PASS.*'rows' is not one of"):
        select.prompt_pass_method()
    monkeypatch.setenv(aa_ref.ENV_TILE_BYTES, "lots")
    with pytest.raises(ValueError, match="KVJAX_PROMPT_TILE_BYTES='lots' must be a positive number of bytes"):
        aa.band_plan(100, 4)
    with pytest.raises(ValueError, match="impl='pallas_tpu' must be one of"):
        aa.accumulated_attention(jnp.zeros((1, 2, 4, 8)), jnp.zeros((1, 1, 4, 8)), None, jnp.ones(1), impl="pallas_tpu")
    with pytest.raises(ValueError, match="Hkv dividing Hq=3"):
        aa.accumulated_attention(jnp.zeros((1, 3, 4, 8)), jnp.zeros((1, 2, 4, 8)), None, jnp.ones(1), impl="xla")


@pytest.mark.parametrize("name", ["h2o", "less"])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 2)])
def test_kept_tokens_identical_on_both_paths(name, hq, hkv, monkeypatch):
    """H2O's and LESS's ``prefill_attend`` (and ``prefill``) keep the same tokens, hold the same scores and state and
    return the same attention on the ``bands`` path (several bands and blocks) as on the CPU's ``tiles``, for the
    test_baselines inputs (ragged lengths, loud padding)."""
    monkeypatch.setattr(aa_ref, "MIN_BAND", 8)
    q, k, v, lengths = (jnp.asarray(x) for x in tb.inputs(hq, hkv)[:4])
    opts = {"hidden": 16} if name == "less" else {}
    m = methods.get(name, budget=0.3, **opts)
    results = {}
    for path in ("tiles", "bands"):
        monkeypatch.setenv(select.ENV_PROMPT_PASS, path)
        st = m.init(tb.model_cfg(hq, hkv), tb.B, Capacity(tb.T, tb.MAX_NEW), 0, jnp.float32)
        out, st1 = jax.jit(lambda st, *a: m.prefill_attend(st, 0, *a))(st, q, k, v, lengths)  # a fresh trace per path
        st2 = jax.jit(lambda st, *a: m.prefill(st, 0, *a))(st, q, k, v, lengths)
        results[path] = out, st1, st2
    (o1, a1, b1), (o2, a2, b2) = results["tiles"], results["bands"]
    sparse = (lambda s: s.sparse) if name == "less" else (lambda s: s)
    for x, y in ((a1, a2), (b1, b2)):
        np.testing.assert_array_equal(np.asarray(sparse(x).pos), np.asarray(sparse(y).pos))  # the kept tokens
        assert tb.kept(sparse(x)) == tb.kept(sparse(y))
        for u, w in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
            np.testing.assert_allclose(np.asarray(u), np.asarray(w), atol=1e-5, rtol=1e-5)
    for b, n in enumerate(np.asarray(lengths)):
        np.testing.assert_allclose(np.asarray(o1)[b, :, :n], np.asarray(o2)[b, :, :n], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["h2o", "less"])
def test_the_kernel_path_keeps_the_same_tokens(name, monkeypatch):
    """``bands`` with the GPU kernels chosen (``KVJAX_ACCUMULATED_ATTENTION_IMPL=pallas_gpu``, run here in interpret
    mode): H2O's and LESS's ``prefill_attend`` keep the tokens, and return the attention, of the CPU path."""
    import kernels_pallas.accumulated_attention.pallas_gpu as gpu

    kernel = gpu.accumulated_attention_gpu
    monkeypatch.setattr(gpu, "accumulated_attention_gpu", lambda *a, **kw: kernel(*a, **{**kw, "interpret": True}))
    q, k, v, lengths = (jnp.asarray(x) for x in tb.inputs(4, 2)[:4])
    m = methods.get(name, budget=0.3, **({"hidden": 16} if name == "less" else {}))
    got = {}
    for path, impl in (("tiles", "xla"), ("bands", "pallas_gpu")):
        monkeypatch.setenv(select.ENV_PROMPT_PASS, path)
        monkeypatch.setenv(aa.ENV_IMPL, impl)
        st = m.init(tb.model_cfg(4, 2), tb.B, Capacity(tb.T, tb.MAX_NEW), 0, jnp.float32)
        got[path] = jax.jit(lambda st, *a: m.prefill_attend(st, 0, *a))(st, q, k, v, lengths)
    sparse = (lambda s: s.sparse) if name == "less" else (lambda s: s)
    (o1, s1), (o2, s2) = got["tiles"], got["bands"]
    np.testing.assert_array_equal(np.asarray(sparse(s1).pos), np.asarray(sparse(s2).pos))
    for u, w in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(w), atol=1e-5, rtol=1e-5)
    for b, n in enumerate(np.asarray(lengths)):
        np.testing.assert_allclose(np.asarray(o1)[b, :, :n], np.asarray(o2)[b, :, :n], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ loop census

#: The prefill the census traces: Llama-3.1-8B attention shapes, 32k tokens, batch 8, bf16.
CENSUS = dict(b=8, t=32768, hq=32, hkv=8, d=128)


def census(closed) -> dict:
    """While loops, scan trips and conds of a closed jaxpr, nested ones included (a Pallas kernel's inner loops
    run on the device: a ``pallas_call`` is not entered)."""
    found = {"while": 0, "scan_trips": 0, "cond": 0, "pallas_call": 0}

    def walk(jaxpr):
        for e in jaxpr.eqns:
            name = e.primitive.name
            if name == "while":
                found["while"] += 1
            elif name == "scan":
                found["scan_trips"] += e.params["length"]
            elif name in found:
                found[name] += 1
            if name == "pallas_call":
                continue
            for p in e.params.values():
                for x in p if isinstance(p, (tuple, list)) else (p,):
                    if isinstance(x, jcore.ClosedJaxpr):
                        walk(x.jaxpr)
                    elif isinstance(x, jcore.Jaxpr):
                        walk(x)

    walk(closed.jaxpr)
    return found


def prefill_census(name: str, monkeypatch, path: str, impl: str = "xla", **size) -> dict:
    """The census of ``name``'s one-layer ``prefill_attend`` traced abstractly (nothing allocated) for a GPU
    (``jax.default_backend`` patched), the prompt pass forced to ``path`` and the kernel package to ``impl``; size:
    :data:`CENSUS` overrides."""
    c = dict(CENSUS, **size)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setenv(select.ENV_PROMPT_PASS, path)
    monkeypatch.setenv(aa.ENV_IMPL, impl)
    cfg = ModelConfig("llama", 256, 4096, 14336, 1, c["hq"], c["hkv"], c["d"], max_position_embeddings=131072)
    m = methods.get(name, budget=0.2)
    st = jax.eval_shape(lambda: m.init(cfg, c["b"], Capacity(c["t"], 64), 0, jnp.bfloat16))
    S = jax.ShapeDtypeStruct
    qs, kvs = S((c["b"], c["hq"], c["t"], c["d"]), jnp.bfloat16), S((c["b"], c["hkv"], c["t"], c["d"]), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda st, q, k, v, n: m.prefill_attend(st, 0, q, k, v, n))(
        st, qs, kvs, kvs, S((c["b"],), jnp.int32)
    )
    return census(jaxpr)


#: LESS's prefill also folds the evicted tokens into its low-rank state: a 16-trip scan (less.py ``_fold``).
LESS_FOLD_TRIPS = 16


@pytest.mark.parametrize("name", ["h2o", "less"])
def test_prefill_loop_census_for_a_gpu(name, monkeypatch):
    """Declared bound: one while loop per query band of more than one block (:data:`BANDS` = 8), and in all
    :func:`loop_trips` of the plan: with 1 GiB tiles of ``[B Hq = 256, rows, keys]`` float32, band ``j`` (keys
    ``[0, 4096 (j + 1))``) takes ``floor(256 / (j + 1))`` rows a trip, 582 trips in all, about ``B Hq T^2 4 bytes
    (9/16) / 1 GiB``: the causal square's share the bands compute over the tile budget. The CPU's tiled path (the
    prompt pass before) traces 3 while loops (query blocks of 64 rows, and per block the key tiles up to the
    diagonal twice): 512 + 2 x 16,128 + 512 = 33,280 trips at this size."""
    c = CENSUS
    got = prefill_census(name, monkeypatch, "bands")
    plan = aa.band_plan(c["t"], c["b"] * c["hq"])
    assert len(plan) == aa.BANDS and all(n > 1 for *_, n in plan)
    assert got["while"] == aa.BANDS
    assert aa.loop_trips(plan) == 582 <= 600
    assert got["scan_trips"] == (LESS_FOLD_TRIPS if name == "less" else 0)
    assert got["cond"] == 0 and got["pallas_call"] == 0
    before = prefill_census(name, monkeypatch, "tiles")
    assert before["while"] == 3 and before["scan_trips"] == got["scan_trips"]


@pytest.mark.parametrize("name", ["h2o", "less"])
def test_the_kernel_prefill_traces_no_loop(name, monkeypatch):
    """With the Pallas kernels (``pallas_gpu``: where verified, or forced) the prompt pass traces no while loop:
    the forward and column-sum kernels' loops run on the device, inside the two ``pallas_call``s."""
    got = prefill_census(name, monkeypatch, "bands", impl="pallas_gpu")
    assert got == {"while": 0, "scan_trips": LESS_FOLD_TRIPS if name == "less" else 0, "cond": 0, "pallas_call": 2}
