"""Selection without a sort (``kvjax.methods.core.threshold``, ``cluster_recall.take_by_rank``) against the sorts it
replaces: ``lax.top_k``'s set (ties to the lower index) and a NumPy ranking of clusters, on scores with many ties (a few
distinct values), candidate masks, ``k`` of 0, within and beyond the candidates, and empty clusters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.methods.core import threshold as th
from kvjax.methods.clusterkv.recall import take_by_rank


def _tied_scores(rng, shape, distinct):
    """float32 scores drawn from ``distinct`` values (so most entries tie), ``-0.0`` and ``+0.0`` among them."""
    values = np.concatenate([[-0.0, 0.0], rng.normal(size=distinct - 2)]).astype(np.float32)
    return values[rng.integers(0, distinct, size=shape)]


@pytest.fixture(params=th.KTH_KEY_METHODS)
def how(request, monkeypatch):
    """Each of kth_key's methods (the CPU's bisection, the accelerators' sort), forced here on the CPU. jit caches a
    function's trace across wrappers, and the method is read at trace time: the caches are cleared around."""
    monkeypatch.setenv(th.ENV_KTH_KEY, request.param)
    jax.clear_caches()
    yield request.param
    jax.clear_caches()


@pytest.mark.parametrize("distinct", [3, 9, 1000])
def test_top_set_is_top_k_set(distinct, how):
    rng = np.random.default_rng(distinct)
    b, h, n, width = 3, 2, 96, 40
    x = _tied_scores(rng, (b, h, n), distinct)
    cand = rng.random((b, h, n)) < 0.7
    k = rng.integers(0, width + 1, size=(b, h)).astype(np.int32)
    k[0, 0], k[0, 1] = 0, width  # nothing; and (often) more than the candidates hold
    slots, ok = jax.jit(th.top_set, static_argnums=3)(
        th.sortable(jnp.asarray(x)), jnp.asarray(cand), jnp.asarray(k), width
    )
    slots, ok = np.asarray(slots), np.asarray(ok)
    for bi in range(b):
        for hi in range(h):
            masked = np.where(cand[bi, hi], x[bi, hi], -np.inf).astype(np.float32)
            kk = int(min(k[bi, hi], cand[bi, hi].sum()))
            _, want = jax.lax.top_k(jnp.asarray(masked), n)  # the full ranking, ties to the lower index
            want = sorted(int(i) for i in np.asarray(want)[:kk])
            got = slots[bi, hi][ok[bi, hi]].tolist()
            assert got == want, (bi, hi, kk)
            assert ok[bi, hi].sum() == kk and np.all(np.diff(got) > 0)


def _take_reference(score, size, bsel):
    """NumPy: rank clusters by score descending in ``lax.top_k``'s order (``+0.0`` above ``-0.0``), ties to the lower
    id, take whole until ``bsel``."""
    order = np.lexsort((np.arange(len(score)), np.signbit(score), -score.astype(np.float64)))
    before = np.cumsum(size[order]) - size[order]
    take = np.zeros_like(size)
    take[order] = np.clip(bsel - before, 0, size[order])
    return take


@pytest.mark.parametrize("distinct", [2, 5, 1000])
def test_take_by_rank_matches_a_sorted_ranking(distinct, how):
    rng = np.random.default_rng(10 + distinct)
    b, h, c = 2, 3, 50
    score = _tied_scores(rng, (b, h, c), max(distinct, 2))
    size = rng.integers(0, 40, size=(b, h, c)).astype(np.int32)
    size[0, 0, ::3] = 0  # empty clusters (the method scores them NEG_INF; any score must take nothing)
    bsel = rng.integers(0, 400, size=(b, h)).astype(np.int32)
    bsel[0, 1], bsel[1, 0] = 0, 10_000  # nothing; more than every cluster holds
    got = np.asarray(jax.jit(take_by_rank)(jnp.asarray(score), jnp.asarray(size), jnp.asarray(bsel)))
    for bi in range(b):
        for hi in range(h):
            want = _take_reference(score[bi, hi], size[bi, hi], int(bsel[bi, hi]))
            np.testing.assert_array_equal(got[bi, hi], want, err_msg=f"{bi},{hi}")
            assert got[bi, hi].sum() == min(int(bsel[bi, hi]), int(size[bi, hi].sum()))


@pytest.mark.parametrize("distinct", [2, 7, 1000])
def test_kth_key_against_numpy(distinct, how):
    """``tau`` = the largest key whose weighted count of keys >= it reaches ``k`` (NumPy, by brute force over the
    keys and 0), ``above`` = the weight strictly above it; zero weights, ``k <= 0`` and ``k`` above the total."""
    rng = np.random.default_rng(20 + distinct)
    x = _tied_scores(rng, (4, 64), max(distinct, 2))
    w = rng.integers(0, 4, size=x.shape).astype(np.int32)
    w[0, ::2] = 0
    k = rng.integers(1, 60, size=4).astype(np.int32)
    k[1], k[2] = 0, int(w[2].sum()) + 5
    keys = np.asarray(th.sortable(jnp.asarray(x)))
    tau, above = jax.jit(th.kth_key)(jnp.asarray(keys), jnp.asarray(w), jnp.asarray(k))
    text = str(jax.make_jaxpr(th.kth_key)(jnp.asarray(keys), jnp.asarray(w), jnp.asarray(k)))
    assert ("sort[" in text) == (how == "sort") and ("scan[" in text) == (how == "bisect")  # the path under test
    for r in range(4):
        cands = [t for t in np.unique(np.concatenate([keys[r], [0]])) if w[r][keys[r] >= t].sum() >= k[r]]
        want = np.uint32(0xFFFFFFFF) if k[r] <= 0 else max(cands, default=0)  # total below k: 0
        assert int(tau[r]) == int(want), (r, how)
        assert int(above[r]) == int(w[r][keys[r] > want].sum())


def test_kth_key_method_by_backend_and_variable(monkeypatch):
    monkeypatch.delenv(th.ENV_KTH_KEY, raising=False)
    assert th.kth_key_method() == ("bisect" if jax.default_backend() == "cpu" else "sort")
    monkeypatch.setenv(th.ENV_KTH_KEY, "sort")
    assert th.kth_key_method() == "sort"
    monkeypatch.setenv(th.ENV_KTH_KEY, "heap")
    with pytest.raises(ValueError, match="KVJAX_KTH_KEY='heap' is not one of"):
        th.kth_key_method()
