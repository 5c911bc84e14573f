"""Fidelity probes (eval/fidelity.py) on a tiny random model against numpy: the attention error of a method
recomputed from the layer's q/k/v over the kept slots, the top-k recall from numpy softmax weights, Jaccard."""

import jax
import numpy as np
import pytest

from eval import fidelity
from kvjax import methods
from kvjax import model as M
from kvjax.config import ModelConfig
from kvjax.loading import Model


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                      sliding_windows=(None, None, None))
    return Model(cfg, M.random_params(cfg, jax.random.PRNGKey(1), scale=0.3), None, "tiny")


def numpy_layers(model, ids):
    """Per-layer post-RoPE q, k, v ``[1, H, T, D]`` float64 of the full-attention forward."""
    cfg, params = model.config, model.params
    positions = np.arange(len(ids))[None]

    def attend(layer, x, q, k, v, out):
        return M.causal_attention(q, k, v), out + [tuple(np.asarray(a, np.float64) for a in (q, k, v))]

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


def test_methods_without_positions_report_error_only(tiny):
    ids = list(np.random.RandomState(2).randint(0, 64, 40))
    res = fidelity.probe(tiny, ids, methods.get("pqcache", budget=0.5, sink=2, bits=2), probes=2)
    assert len(res["rel_error"]) == 3 and res["recall"] is None and res["jaccard"] is None


def test_topk_recall_hand_example():
    w = np.array([[[0.1, 0.5, 0.2, 0.2]]])
    assert fidelity.topk_recall(w, np.array([[[False, True, True, False]]])) == 1.0  # top-2 = {1, 2} (tie -> lower)
    assert fidelity.topk_recall(w, np.array([[[False, True, False, True]]])) == 0.5  # top-2 = {1, 2}; kept {1, 3}


def test_bad_input(tiny):
    with pytest.raises(ValueError, match="probes"):
        fidelity.probe(tiny, [1, 2, 3], methods.get("full"), probes=0)
    with pytest.raises(ValueError, match="longer"):
        fidelity.probe(tiny, [1, 2, 3], methods.get("full"), probes=2)
