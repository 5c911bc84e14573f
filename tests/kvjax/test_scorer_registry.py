"""A scorer of one's own joins the scorer registry (``kvjax.methods.core.scorers.register_scorer``) the way a method
joins the method registry, and then every method with a ``scorer`` option takes it by name: here a key-norm scorer
(Knorm's rule, ``-||k||``) registered from the test runs inside SnapKV's and ChunkKV's selection, through the
pure functions (kept positions against NumPy) and through ``engine.generate``."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import engine, methods
from kvjax.methods import Capacity
from kvjax.methods.core.scorers import SCORERS, Scorer, make_scorer, register_scorer


@dataclasses.dataclass(frozen=True)
class KeyNormScorer(Scorer):
    """Low key norm first (kvpress's KnormPress as a scorer); ``window`` shared with the method, unused."""

    name: ClassVar[str] = "test_keynorm"
    window: int = 0

    def __call__(self, q, k, lengths, prefix_end):
        return -jnp.linalg.norm(k.astype(jnp.float32), axis=-1)  # [B, Hkv, T]


@pytest.fixture
def keynorm():
    register_scorer(KeyNormScorer)
    yield KeyNormScorer
    SCORERS.pop(KeyNormScorer.name, None)


def test_register_scorer_then_make_scorer_by_name(keynorm):
    assert SCORERS["test_keynorm"] is keynorm and {"snapkv", "h2o"} <= set(SCORERS)
    assert make_scorer("test_keynorm", window=4, kernel=5) == keynorm(window=4)  # the options it declares
    assert make_scorer("snapkv", window=4, kernel=3).kernel == 3  # the built-ins as before
    assert methods.get("snapkv", scorer="test_keynorm").score_fn == keynorm(window=8)
    with pytest.raises(ValueError, match="already registered"):
        register_scorer(
            dataclasses.dataclass(frozen=True)(
                type("Other", (Scorer,), {"name": "test_keynorm", "__call__": keynorm.__call__})
            )
        )
    with pytest.raises(ValueError, match="frozen dataclass subclassing"):
        register_scorer(int)


def test_unregistered_scorer_names_the_registered_ones(keynorm):
    with pytest.raises(ValueError, match="test_keynorm"):
        methods.get("snapkv", scorer="nope")
    SCORERS.pop("test_keynorm")
    with pytest.raises(ValueError, match="scorer='test_keynorm'"):
        methods.get("chunkkv", scorer="test_keynorm")


def kept_reference(k, lengths, budget, window):
    """NumPy: per sequence and KV head, the last ``window`` prompt positions plus the ``keep - window`` positions
    before them of lowest key norm (``keep = ceil(budget n)``), ascending."""
    out = []
    for b, n in enumerate(lengths):
        keep = min(n, int(np.ceil(budget * n)))
        w = min(window, keep)
        rows = []
        for h in range(k.shape[1]):
            norm = np.linalg.norm(k[b, h, : n - w].astype(np.float64), axis=-1)
            chosen = np.argsort(norm, kind="stable")[: keep - w]
            rows.append(sorted(chosen.tolist() + list(range(n - w, n))))
        out.append(rows)
    return out


def test_plugin_scorer_selects_in_snapkv_prefill(keynorm):
    """The kept positions of ``snapkv`` with ``scorer="test_keynorm"`` are the NumPy reference's, and the same as
    with the scorer passed as an instance (the name builds the same scorer)."""
    b, hq, hkv, t, d = 2, 4, 2, 24, 8
    cfg = kvjax.ModelConfig("llama", 64, 32, 48, num_layers=1, num_heads=hq, num_kv_heads=hkv, head_dim=d)
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=s).astype(np.float32) for s in ((b, hq, t, d), (b, hkv, t, d), (b, hkv, t, d)))
    lengths = np.array([24, 17], np.int32)
    for m in (
        methods.get("snapkv", budget=0.5, window=3, kernel=1, scorer="test_keynorm"),
        methods.get("snapkv", budget=0.5, window=3, kernel=1, scorer=KeyNormScorer(window=3)),
    ):
        state = m.prefill(m.init(cfg, b, Capacity(t, 2), 0, jnp.float32), 0, q, k, v, lengths)
        pos = np.asarray(state.pos)
        got = [[sorted(p for p in pos[i, h] if p >= 0) for h in range(hkv)] for i in range(b)]
        assert got == kept_reference(k, lengths, 0.5, 3)


def test_plugin_scorer_runs_end_to_end(keynorm):
    """``engine.generate`` with ``snapkv`` and ``chunkkv`` ranking by the plugin scorer: runs, holds ``held``."""
    cfg = kvjax.ModelConfig("llama", 64, 32, 48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    model = kvjax.Model(cfg, kvjax.model.random_params(cfg, jax.random.PRNGKey(0)), None, "tiny")
    for m in (
        methods.get("snapkv", budget=0.25, window=2, scorer="test_keynorm"),
        methods.get("chunkkv", budget=0.25, window=2, chunk_size=4, scorer="test_keynorm"),
    ):
        out = engine.generate(model, [list(range(1, 41))], m, max_new_tokens=4, driver="scan")
        st = out.stats[0]
        assert len(out.tokens[0]) == 4
        assert st["tokens_held_prefill"] <= m.held(40, 0), m.name
