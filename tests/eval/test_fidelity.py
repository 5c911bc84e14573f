"""Fidelity probes (eval/fidelity.py) on a tiny random model against numpy: the attention error of a method
recomputed from the layer's q/k/v over the kept slots, the top-k recall from numpy softmax weights, Jaccard;
the top-B recall of recall methods (``topb_recall`` against numpy on random data, and the probe's per-layer
values recomputed step by step from the layer's q/k and the method's ``selected_positions``)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eval import fidelity
from kvjax import methods
from kvjax import model as M


# the sizes and seed of the tiny fixture's model (tests/conftest.py)
pytestmark = pytest.mark.tiny(num_layers=3, max_position_embeddings=256)


def numpy_layers(model, ids):
    """Per-layer post-RoPE q, k, v ``[1, H, T, D]`` float64 of the full-attention forward."""
    cfg, params = model.config, model.params
    positions = np.arange(len(ids))[None]

    def attend(layer, x, q, k, v, out):
        attn = M.causal_attention(q, k, v, None, cfg.sliding_windows[layer])  # a local layer: its sliding window
        return attn, out + [tuple(np.asarray(a, np.float64) for a in (q, k, v))]

    _, out = M.run_layers(cfg, params, M.embed(params, np.asarray([ids], np.int32)), positions, attend, [])
    return out


def softmax(s):
    p = np.exp(s - s.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def test_full_method_is_exact(tiny):
    ids = list(np.random.RandomState(0).randint(0, 64, 40))
    res = fidelity.probe(tiny, ids, methods.get("full"), probes=4)
    assert res["rel_error"] == pytest.approx([0.0] * 3, abs=1e-6)
    assert res["recall"] == pytest.approx([1.0] * 3) and res["jaccard"] == pytest.approx([1.0] * 2)
    assert res["topb_recall"] is None  # not a recall method


def test_snapkv_error_recall_and_jaccard_match_numpy(tiny):
    ids = list(np.random.RandomState(1).randint(0, 64, 44))
    probes, n = 4, 40
    m = methods.get("snapkv", budget=12, window=4)
    res = fidelity.probe(tiny, ids, m, probes=probes)
    per_layer = fidelity._probe_fn(tiny.config, m, n, probes, tiny.dtype)(tiny.params, np.asarray([ids]))
    kept_sets = []
    for layer, (q, k, v) in enumerate(numpy_layers(tiny, ids)):
        pos = np.asarray(per_layer[layer][2].pos)[0]  # [Hkv, S]: the method's own selection (tested elsewhere)
        kept = [set(int(p) for p in row if 0 <= p < n) for row in pos]
        assert all(len(s) == 12 for s in kept)
        kept_sets.append(kept)
        errs, rec = [], []
        for h in range(4):
            kv = h // 2
            w_full = softmax(q[0, h, n] @ k[0, kv, :n].T / 4.0)
            for i in range(probes):
                t = n + i
                full = softmax(q[0, h, t] @ k[0, kv, : t + 1].T / 4.0) @ v[0, kv, : t + 1]
                keep = sorted(kept[kv]) + list(range(n, t + 1))  # decode appends the probes
                comp = softmax(q[0, h, t] @ k[0, kv, keep].T / 4.0) @ v[0, kv, keep]
                errs.append(np.linalg.norm(comp - full) / np.linalg.norm(full))
            rec.append(w_full)
        assert res["rel_error"][layer] == pytest.approx(np.mean(errs), rel=1e-3, abs=1e-5)
        got = []
        for kv in range(2):
            w = (rec[2 * kv] + rec[2 * kv + 1]) / 2
            top = np.argsort(-w, kind="stable")[:12]
            got.append(len(set(top.tolist()) & kept[kv]) / 12)
        assert res["recall"][layer] == pytest.approx(np.mean(got), abs=1e-6)
    for layer in range(2):
        want = np.mean([len(a & b) / len(a | b) for a, b in zip(kept_sets[layer], kept_sets[layer + 1])])
        assert res["jaccard"][layer] == pytest.approx(want)
    assert 0 < np.mean(res["rel_error"]) and all(0 <= r <= 1 for r in res["recall"])
    assert res["topb_recall"] is None


def test_methods_without_positions_report_no_kept_recall(tiny):
    ids = list(np.random.RandomState(2).randint(0, 64, 40))
    res = fidelity.probe(tiny, ids, methods.get("pqcache", budget=0.5, sink=2, bits=2), probes=2)
    assert len(res["rel_error"]) == 3 and res["recall"] is None and res["jaccard"] is None
    assert len(res["topb_recall"]) == 3  # a recall method: the per-step top-B recall instead


# --------------------------------------------------------------------------------------------- top-B recall


def numpy_topb_recall(selected, q, k, n):
    """``[B, Hq]`` float64: per query head, |sel ∩ topB(q k^T)| / B over the prompt ``[0, n_b)``, B = |sel|
    (1.0 when B = 0); ties to the lower position (stable sort)."""
    b, hq, _ = q.shape
    g = hq // k.shape[1]
    out = np.ones((b, hq))
    for bi in range(b):
        nb = int(np.broadcast_to(n, (b,))[bi])
        for h in range(hq):
            sel = set(np.flatnonzero(selected[bi, h, :nb]).tolist())
            if not sel:
                continue
            logits = np.asarray(k[bi, h // g, :nb], np.float64) @ np.asarray(q[bi, h], np.float64)
            top = set(np.argsort(-logits, kind="stable")[: len(sel)].tolist())
            out[bi, h] = len(sel & top) / len(sel)
    return out


def test_topb_recall_against_numpy():
    """GQA 4/2, batch 2, prompts of 32 and 23 tokens in a 40-key buffer: the exact top-B gives 1.0, the bottom-B
    0.0, random selections the numpy overlap; positions past the prompt are ignored; an empty selection is 1.0;
    the same under jit and with an int n."""
    rng = np.random.default_rng(0)
    b, hq, hkv, t, d = 2, 4, 2, 40, 8
    n = np.array([32, 23])
    q = rng.standard_normal((b, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, t, d)).astype(np.float32)
    logits = np.einsum("bhgd,bhtd->bhgt", q.reshape(b, hkv, 2, d), k).reshape(b, hq, t)
    sizes = rng.integers(1, 12, size=(b, hq))
    exact, bottom = np.zeros((b, hq, t), bool), np.zeros((b, hq, t), bool)
    for bi in range(b):
        for h in range(hq):
            order = np.argsort(-logits[bi, h, : n[bi]], kind="stable")
            exact[bi, h, order[: sizes[bi, h]]] = True
            bottom[bi, h, order[::-1][: sizes[bi, h]]] = True
    past = np.zeros((b, hq, t + 5), bool)
    past[..., 32:] = True  # decoded / padding positions: ignored (and, with nothing else, an empty selection)
    exact_past = past.copy()
    exact_past[..., :t] |= exact
    got = lambda sel, nn=n: np.asarray(fidelity.topb_recall(jnp.asarray(sel), jnp.asarray(q), jnp.asarray(k), nn))
    np.testing.assert_array_equal(got(exact), 1.0)
    np.testing.assert_array_equal(got(bottom), 0.0)
    np.testing.assert_array_equal(got(exact_past), 1.0)
    np.testing.assert_array_equal(got(past), 1.0)
    assert got(exact).shape == (b, hq) and got(exact).dtype == np.float32
    jitted = jax.jit(fidelity.topb_recall)
    for seed in range(5):
        sel = np.random.default_rng(seed).random((b, hq, t)) < 0.3
        want = numpy_topb_recall(sel, q, k, n)
        np.testing.assert_allclose(got(sel), want, atol=1e-6)
        np.testing.assert_allclose(np.asarray(jitted(sel, q, k, jnp.asarray(n))), want, atol=1e-6)
        np.testing.assert_allclose(got(sel, 23), numpy_topb_recall(sel, q, k, 23), atol=1e-6)
    # Ties go to the lower position: equal keys, B = 1.
    kt = np.ones((1, 1, 4, d), np.float32)
    qt = np.ones((1, 1, d), np.float32)
    assert float(fidelity.topb_recall(np.eye(4, dtype=bool)[None, None, 0], qt, kt, 4)[0, 0]) == 1.0
    assert float(fidelity.topb_recall(np.eye(4, dtype=bool)[None, None, 2], qt, kt, 4)[0, 0]) == 0.0


def test_topb_recall_random_selection_expected_overlap():
    """A uniformly random B-subset of n prompt positions hits B/n of the top-B on average (hypergeometric mean)."""
    rng = np.random.default_rng(1)
    b, hq, hkv, n, d, size = 512, 4, 2, 40, 8, 10
    q = rng.standard_normal((b, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, n, d)).astype(np.float32)
    sel = np.argsort(rng.random((b, hq, n)), axis=-1) < size  # exactly `size` random positions per head
    r = np.asarray(fidelity.topb_recall(sel, q, k, n))
    assert r.mean() == pytest.approx(size / n, abs=0.02)  # std of the mean ~ 0.14 / sqrt(2048) = 0.003


def test_pqcache_topb_recall_per_layer_matches_stepwise_numpy(tiny):
    """The probe's per-layer top-B recall = the mean over probes and query heads of the numpy recall of the
    method's ``selected_positions`` at each step (state advanced by its own decode on the layer's q/k/v) against
    the exact top-B of that step's query over the prompt keys; values in [0, 1]."""
    ids = list(np.random.RandomState(3).randint(0, 64, 44))
    probes, n = 4, 40
    m = methods.get("pqcache", budget=0.3, sink=2, bits=2, iters=3)
    res = fidelity.probe(tiny, ids, m, probes=probes)
    assert len(res["topb_recall"]) == 3 and all(isinstance(r, float) and 0 <= r <= 1 for r in res["topb_recall"])
    assert res["topb_recall"] == pytest.approx(stepwise_topb_recall(tiny, m, ids, n, probes), abs=1e-6)
    assert min(res["topb_recall"]) < 1.0  # a 30% budget misses some of the exact top-B


def stepwise_topb_recall(model, m, ids, n: int, probes: int) -> list[float]:
    """Per layer: the mean over probes of the numpy top-B recall of ``m``'s ``selected_positions`` at each step,
    its state advanced by its own decode on the layer's q/k/v (``numpy_layers``)."""
    cap = fidelity.Capacity(n, probes + 1)
    out = []
    for layer, (q, k, v) in enumerate(numpy_layers(model, ids)):
        prefill = jax.jit(lambda st, q, k, v, layer=layer: m.prefill(st, layer, q, k, v, jnp.asarray([n])))
        step = jax.jit(
            lambda st, q, k, v, p, layer=layer: (m.selected_positions(st, layer, q), m.decode(st, layer, q, k, v, p)[1])
        )
        q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
        st = prefill(m.init(model.config, 1, cap, layer, model.dtype), q[:, :, :n], k[:, :, :n], v[:, :, :n])
        rs = []
        for i in range(probes):
            sel, st = step(st, q[:, :, n + i], k[:, :, n + i], v[:, :, n + i], jnp.asarray([n + i]))
            rs.append(numpy_topb_recall(np.asarray(sel), np.asarray(q[:, :, n + i]), np.asarray(k[:, :, :n]), n))
        out.append(float(np.mean(rs)))
    return out


@pytest.mark.parametrize("name", ["pqcache", "clusterkv", "quest"])
def test_recall_probe_on_a_hybrid_model_scores_its_global_layers(tiny, name):
    """On a model with sliding-window layers (Gemma 3's pattern) the local layers keep their window: no top-B recall
    there (None), the global layer's equals the stepwise numpy recall, and the row's means are over the global
    layer only (the windows' zero error would dilute them)."""
    hybrid = dataclasses.replace(tiny, config=dataclasses.replace(tiny.config, sliding_windows=(8, None, 8)))
    ids = list(np.random.RandomState(5).randint(0, 64, 44))
    probes, n = 4, 40
    kw = {
        "pqcache": dict(sink=2, bits=2, iters=3),
        "clusterkv": dict(n_full=0, sink=2, tokens_per_cluster=8, iters=3),
        "quest": dict(n_full=0, page_size=4),
    }
    m = methods.get(name, budget=0.3, **kw[name])
    res = fidelity.probe(hybrid, ids, m, probes=probes)
    assert res["compressed_layers"] == [1]
    assert res["topb_recall"][0] is None and res["topb_recall"][2] is None
    assert res["topb_recall"][1] == pytest.approx(stepwise_topb_recall(hybrid, m, ids, n, probes)[1], abs=1e-6)
    assert res["rel_error"][0] == pytest.approx(0.0, abs=1e-6) and res["rel_error"][1] > 0
    row = fidelity.FidelityTask(probes=probes).run_batch(hybrid, m, None, [ids], {})[0]
    assert row["score"] == pytest.approx(res["rel_error"][1]) and row["topb_recall_mean"] == res["topb_recall"][1]


@pytest.mark.parametrize("kw", [dict(budget=100, sink=2, bits=2), dict(budget=0.2)], ids=["covering", "dense-short"])
def test_pqcache_topb_recall_is_one_when_every_token_is_selected(tiny, kw):
    """A window covering the whole prompt (int budget 100 > 40 tokens), or the dense_short fallback (40 - 32
    sinks <= 64 centroids): every prompt token is attended at every step, so the top-B is the whole prompt."""
    ids = list(np.random.RandomState(4).randint(0, 64, 44))
    res = fidelity.probe(tiny, ids, methods.get("pqcache", **kw), probes=4)
    assert res["topb_recall"] == pytest.approx([1.0] * 3)
    rows = fidelity.FidelityTask(probes=4).run_batch(tiny, methods.get("pqcache", **kw), None, [ids], {})
    assert rows[0]["topb_recall_mean"] == pytest.approx(1.0) and rows[0]["recall_mean"] is None


def test_topk_recall_hand_example():
    w = np.array([[[0.1, 0.5, 0.2, 0.2]]])
    assert fidelity.topk_recall(w, np.array([[[False, True, True, False]]])) == 1.0  # top-2 = {1, 2} (tie -> lower)
    assert fidelity.topk_recall(w, np.array([[[False, True, False, True]]])) == 0.5  # top-2 = {1, 2}; kept {1, 3}


def test_bad_input(tiny):
    with pytest.raises(ValueError, match="probes"):
        fidelity.probe(tiny, [1, 2, 3], methods.get("full"), probes=0)
    with pytest.raises(ValueError, match="longer"):
        fidelity.probe(tiny, [1, 2, 3], methods.get("full"), probes=2)


def test_clusterkv_with_one_token_per_cluster_recalls_the_exact_top_b_and_quest_less(tiny):
    """ClusterKV with singleton clusters and no sinks attends exactly the top-B prompt tokens by ``q·k`` of each
    query head (``mu = k``) under the authors' per-query-head rule (``gqa="query"``), so its top-B recall is 1.0
    in every layer (the first ``n_full`` are full); Quest's pages at the same budget miss some of them."""
    ids = list(np.random.RandomState(5).randint(0, 64, 60))
    ck = fidelity.probe(
        tiny, ids, methods.get("clusterkv", budget=12, sink=0, tokens_per_cluster=1, n_full=1, gqa="query"), probes=3
    )
    assert ck["topb_recall"] == pytest.approx([1.0] * 3) and ck["recall"] is None
    qu = fidelity.probe(tiny, ids, methods.get("quest", budget=12, page_size=4, n_full=1), probes=3)
    assert qu["topb_recall"][0] == pytest.approx(1.0) and all(0.0 <= r < 1.0 for r in qu["topb_recall"][1:])
